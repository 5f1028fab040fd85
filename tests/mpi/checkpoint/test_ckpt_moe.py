"""MoE checkpoints hold logical tensors: a run at ep 4 saves at step 2
(each rank writes its experts' slice of the [experts, ...] tensors); one
process (ep 1) and ep 2 resume it and continue with the losses of an
uninterrupted one-process run (fp32: relative 1e-6, the parity tests'
tolerance). The sigmoid router's selection biases, which move every step,
are saved and restored with the weights."""
from __future__ import annotations

import h5py
import pytest
from mpi4py import MPI

from hpctrain.run import reference_trainer

from ckpt_helpers import BASE, build_trainer, config, load_alone, losses

pytestmark = pytest.mark.mpi(min_size=4)
MODEL = ("trainer.steps=4", "model=tiny-moe", "model.moe.router=sigmoid", "model.moe.aux_free_bias_rate=0.01",
         "trainer.device=cpu")


@pytest.fixture(scope="module")
def straight():
    return losses(reference_trainer(config(*BASE, *MODEL)), 4)


@pytest.fixture(scope="module")
def saved_at_ep4(module_dir, straight):
    trainer = build_trainer(*MODEL, "parallel.ep=4", f"checkpoint.dir={module_dir}", "checkpoint.every=100")
    assert losses(trainer, 2) == pytest.approx(straight[:2], rel=1e-6)
    path = trainer.save_checkpoint(f"{module_dir}/ep4.h5")
    MPI.COMM_WORLD.Barrier()
    return path


def test_experts_are_stored_as_logical_tensors(saved_at_ep4):
    with h5py.File(saved_at_ep4, "r") as f:
        assert f["/model/layers.0.ffn.experts.w1"].shape == (4, 64, 64)  # [experts, ffn_hidden, d_model]
        assert f["/model/layers.1.ffn.experts.w2"].shape == (4, 64, 64)
        assert f["/model/layers.0.ffn.router.weight"].shape == (4, 64)
        bias = f["/buffers/layers.0.ffn.router.expert_bias"][()]
    assert abs(bias).sum() > 0  # two steps of bias updates were saved


def test_ep4_resumes_in_one_process(saved_at_ep4, straight):
    alone = reference_trainer(config(*BASE, *MODEL))
    load_alone(alone, saved_at_ep4)
    assert alone.step == 2
    assert losses(alone, 2) == pytest.approx(straight[2:], rel=1e-6)


def test_ep4_resumes_at_ep2(saved_at_ep4, straight):
    trainer = build_trainer(*MODEL, "parallel.ep=2", f"checkpoint.resume={saved_at_ep4}")
    assert trainer.step == 2
    assert losses(trainer, 2) == pytest.approx(straight[2:], rel=1e-6)
