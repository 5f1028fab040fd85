"""Fixtures of the per-op communicator tests.

The hierarchical backend needs several nodes, so when the launcher did not
set ``HPCTRAIN_RANKS_PER_NODE`` and the world size is even, this file sets it
to 2 while it creates the runtime (then unsets it): at 4 ranks that is 2 emulated nodes
of 2, at 8 ranks 4 nodes of 2 (at 2 ranks a single node). Only topology-aware
code reads node membership, so other tests in the same session are unaffected
(``tests/mpi/test_bootstrap.py`` checks both the emulated and the real case).
"""
from __future__ import annotations

import os
from typing import Callable, Dict

import pytest
from mpi4py import MPI

from hpctrain.bootstrap import RANKS_PER_NODE_ENV

if MPI.COMM_WORLD.Get_size() % 2 == 0 and RANKS_PER_NODE_ENV not in os.environ:
    # Create the (once per process) runtime with emulated nodes, then take the
    # variable out again: one-process runs that other tests start as
    # subprocesses must not inherit "2 ranks per node" for a world of 1.
    from hpctrain.bootstrap import init_runtime

    os.environ[RANKS_PER_NODE_ENV] = "2"
    try:
        init_runtime()
    finally:
        del os.environ[RANKS_PER_NODE_ENV]


def compose_config(*overrides: str):
    """A typed run config, composed like the CLI does (``make_config`` is
    per-test; composing once per session keeps hundreds of tiny tests fast)."""
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import get_manager

    pm = get_manager()
    return compose_resolved(overrides, pm)


def world_group(name: str = "world"):
    from hpctrain.mesh import Group

    world = MPI.COMM_WORLD
    ranks = tuple(range(world.Get_size()))
    return Group(name=name, ranks=ranks, rank=world.Get_rank(), partition=(ranks,))


@pytest.fixture(scope="session")
def base_config():
    return compose_config()


@pytest.fixture(scope="session")
def comms(base_config) -> Callable[[str], object]:
    """``comms("mpi")``: the communicator of backend ``mpi`` over the whole
    world (``gloo`` = the torch plugin on CPU, ``mpi``, ``hier``), made once."""
    from hpctrain.plugins import get_manager

    made: Dict[str, object] = {}

    def get(backend: str):
        if backend not in made:
            made[backend] = get_manager().hook.hpctrain_make_backend(name=backend, group=world_group(),
                                                                     cfg=base_config)
        return made[backend]

    return get
