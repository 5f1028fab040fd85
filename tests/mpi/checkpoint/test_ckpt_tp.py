"""Tensor-parallel checkpoints hold logical tensors: a run at tp 2 saves at
step 2; one process (tp 1) and, with 4 ranks or more, tp 4 resume it and
continue with the losses of an uninterrupted one-process run (fp32:
relative 1e-6, the parity tests' tolerance). The vocabulary of 257 tokens
is padded to 258 rows at tp 2 and 260 at tp 4; the file holds 257."""
from __future__ import annotations

import h5py
import pytest
from mpi4py import MPI

from hpctrain.run import reference_trainer

from ckpt_helpers import BASE, build_trainer, config, load_alone, losses

pytestmark = pytest.mark.mpi(min_size=2)
MODEL = ("trainer.steps=4", "model.vocab_size=257", "model.tie_embeddings=false")



@pytest.fixture(scope="module")
def straight():
    """The uninterrupted one-process losses of 4 steps."""
    return losses(reference_trainer(config(*BASE, *MODEL)), 4)


@pytest.fixture(scope="module")
def saved_at_tp2(module_dir, straight):
    trainer = build_trainer(*MODEL, "parallel.tp=2", f"checkpoint.dir={module_dir}", "checkpoint.every=100")
    assert trainer.model.tok_embeddings.weight.shape == (129, 64)  # 258 padded rows / 2
    assert losses(trainer, 2) == pytest.approx(straight[:2], rel=1e-6)
    path = trainer.save_checkpoint(f"{module_dir}/tp2.h5")
    MPI.COMM_WORLD.Barrier()
    return path


def test_file_holds_the_unpadded_vocabulary(saved_at_tp2):
    with h5py.File(saved_at_tp2, "r") as f:
        assert f["/model/tok_embeddings.weight"].shape == (257, 64)
        assert f["/model/output.weight"].shape == (257, 64)
        assert f["/model/layers.0.attn.wq.weight"].shape == (64, 64)


def test_tp2_resumes_in_one_process(saved_at_tp2, straight):
    alone = reference_trainer(config(*BASE, *MODEL))
    load_alone(alone, saved_at_tp2)
    assert alone.step == 2
    assert losses(alone, 2) == pytest.approx(straight[2:], rel=1e-6)


@pytest.mark.mpi(min_size=4)
def test_tp2_resumes_at_tp4(saved_at_tp2, straight):
    trainer = build_trainer(*MODEL, "parallel.tp=4", f"checkpoint.resume={saved_at_tp2}")
    assert trainer.step == 2 and trainer.model.tok_embeddings.weight.shape == (65, 64)
    assert losses(trainer, 2) == pytest.approx(straight[2:], rel=1e-6)
