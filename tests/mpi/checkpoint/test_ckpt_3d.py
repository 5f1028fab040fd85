"""A checkpoint written by an 8-rank 3D layout (tp 2 x pp 2 x dp 2, ZeRO-1)
holds the logical model and optimizer: one process resumes it, and so does a
different 8-rank layout (tp 2 x dp 4 with ZeRO-3, which cuts weights and
AdamW moments differently), each continuing with the losses of an
uninterrupted one-process run (fp32: relative 1e-6, the parity tests'
tolerance; AdamW moments restored wrongly would show at the first resumed
step)."""
from __future__ import annotations

import pytest
from mpi4py import MPI

from hpctrain.run import reference_trainer

from ckpt_helpers import BASE, build_trainer, config, load_alone, losses

pytestmark = pytest.mark.mpi(min_size=8)
MODEL = ("trainer.steps=4", "model.n_layers=4")
THREE_D = ("parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero.stage=1")


@pytest.fixture(scope="module")
def straight():
    return losses(reference_trainer(config(*BASE, *MODEL)), 4)


@pytest.fixture(scope="module")
def saved_at_3d(module_dir, straight):
    if MPI.COMM_WORLD.Get_size() != 8:
        pytest.skip("the layouts are for 8 ranks")
    trainer = build_trainer(*MODEL, *THREE_D, f"checkpoint.dir={module_dir}", "checkpoint.every=100")
    assert losses(trainer, 2) == pytest.approx(straight[:2], rel=1e-6)
    path = trainer.save_checkpoint(f"{module_dir}/3d.h5")
    MPI.COMM_WORLD.Barrier()
    return path


def test_3d_checkpoint_resumes_in_one_process(saved_at_3d, straight):
    alone = reference_trainer(config(*BASE, *MODEL))
    load_alone(alone, saved_at_3d)
    assert alone.step == 2
    assert losses(alone, 2) == pytest.approx(straight[2:], rel=1e-6)


def test_3d_checkpoint_resumes_as_tp2_dp4_zero3(saved_at_3d, straight):
    trainer = build_trainer(*MODEL, "parallel.tp=2", "parallel.dp=4", "parallel.zero.stage=3",
                            f"checkpoint.resume={saved_at_3d}")
    assert trainer.step == 2
    assert losses(trainer, 2) == pytest.approx(straight[2:], rel=1e-6)
