"""A checkpoint saved by the whole world loads with identical logical
tensors (parameters, optimizer state), step and data cursor on every
smaller layout: dp = each divisor of the world size, down to one process.
The smaller worlds are sub-communicators of this job, which is possible
because the checkpointer takes its communicator as an argument."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.protocol import LocalCommunicator
from hpctrain.mesh import AXES, Mesh
from hpctrain.plugins import get_manager
from hpctrain.shard import get_spec
from hpctrain.train.trainer import Trainer

from ckpt_helpers import BASE, build_trainer, config
from hpctrain_h5ckpt import options
from hpctrain_h5ckpt.checkpointer import H5Checkpointer

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.every_size]  # the world size changes what is tested


def test_every_smaller_layout_loads_the_logical_tensors(shared_tmp):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    build_trainer(f"checkpoint.dir={shared_tmp}", "trainer.steps=2", "checkpoint.every=2").fit()
    path = f"{shared_tmp}/step_00000002.h5"
    with h5py.File(path, "r") as f:
        stored = {name: f[name][()] for name in f["model"].keys() for name in [f"/model/{name}"]}
        stored.update({f"/optim/{k}/{n}": f[f"/optim/{k}/{n}"][()] for k in f["optim"] for n in f["optim"][k]})
    for k in (s for s in range(1, size) if size % s == 0):
        sub = comm.Split(rank // k, rank)
        cfg = config(*BASE, "trainer.steps=4")
        mesh = Mesh({a: cfg.parallel[a] for a in AXES}, sub.Get_rank(), k, cfg.parallel.order)
        mesh.attach_backends(lambda group: LocalCommunicator())  # loading runs no training collectives
        trainer = Trainer(cfg, mesh, get_manager(), torch.device("cpu"))
        restored = H5Checkpointer(sub, options.resolve(options.H5Config()), None, 0, False).load(trainer.state, path)
        assert restored.step == 2 and restored.path == path and trainer.step == 0  # the caller sets the step
        assert trainer.cursor.consumed_samples == 16 and mesh.size("dp") == k
        for p in trainer.model.parameters():
            spec = get_spec(p)
            sl = spec.local_slices(mesh.coords, mesh.sizes)
            np.testing.assert_array_equal(p.detach().numpy(), stored[f"/model/{spec.logical_name}"][sl])
            for key, value in trainer.optimizer.state[p].items():
                want = stored[f"/optim/{key}/{spec.logical_name}"]
                np.testing.assert_array_equal(value.numpy(), want[sl] if value.dim() else want)
        sub.Free()
