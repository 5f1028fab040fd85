"""Meshes whose partitions mix one-rank and larger groups get working
communicators on every backend, and so does every mesh built after them.

At pp >= 3 the first/last-stage group (``pp_ends``) pairs the two ends of
each pipeline while every middle stage is alone. Backends make a group's
communicator collectively over the world once per partition, so the
middle ranks must join that call even though their own group has one rank.
A middle rank that skipped it (a one-rank group shortcut) would match the
ends' split with a later, different split: communicators cross and the next
mesh's build hangs (pp 4 followed by tp 2 x pp 2 at 8 ranks, as here). Each
group's all-reduce of ones must give its size.
"""
from __future__ import annotations

import pytest
import torch

from hpctrain.bootstrap import get_runtime
from hpctrain.comm.protocol import ReduceOp
from hpctrain.plugins import get_manager
from hpctrain.run import build_mesh

from conftest import compose_config

pytestmark = pytest.mark.every_size  # the world size changes what is tested


def _check_every_group(mesh):
    for name, group in sorted(mesh.groups.items()):
        t = torch.ones(3)
        group.communicator().all_reduce(t, ReduceOp.SUM)
        assert t.tolist() == [float(group.size)] * 3, (name, group.ranks)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_pipeline_ends_then_another_mesh(world, backend):
    n = world.Get_size()
    rt, pm = get_runtime(), get_manager()
    deep = build_mesh(compose_config(f"parallel.pp={n}", "parallel.dp=1", f"comm.backend={backend}"), rt, pm)
    assert any(len(r) == 1 for r in deep.pp_ends().partition) and deep.pp_ends().partition != ()
    _check_every_group(deep)
    other = build_mesh(compose_config("parallel.tp=2", "parallel.pp=2", f"comm.backend={backend}"), rt, pm)
    _check_every_group(other)
