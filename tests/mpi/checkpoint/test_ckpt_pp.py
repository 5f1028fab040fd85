"""Pipeline checkpoints hold logical tensors: a run at pp 2 saves at step
2; one process (pp 1) and, with 4 ranks or more, pp 4 resume it and
continue with the losses of an uninterrupted one-process run (fp32:
relative 1e-6, the parity tests' tolerance). Every stage writes its own
blocks, so the file holds the whole model."""
from __future__ import annotations

import h5py
import pytest
from mpi4py import MPI

from hpctrain.run import reference_trainer

from ckpt_helpers import BASE, build_trainer, config, load_alone, losses

pytestmark = pytest.mark.mpi(min_size=2)
MODEL = ("trainer.steps=4", "model.n_layers=4")



@pytest.fixture(scope="module")
def straight():
    return losses(reference_trainer(config(*BASE, *MODEL)), 4)


@pytest.fixture(scope="module")
def saved_at_pp2(module_dir, straight):
    trainer = build_trainer(*MODEL, "parallel.pp=2", f"checkpoint.dir={module_dir}", "checkpoint.every=100")
    assert losses(trainer, 2) == pytest.approx(straight[:2], rel=1e-6)
    path = trainer.save_checkpoint(f"{module_dir}/pp2.h5")
    MPI.COMM_WORLD.Barrier()
    return path


def test_file_holds_every_stage(saved_at_pp2):
    with h5py.File(saved_at_pp2, "r") as f:
        names = set()
        f["/model"].visit(names.add)
    assert {f"layers.{i}.attn.wq.weight" for i in range(4)} <= names
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= names


def test_pp2_resumes_in_one_process(saved_at_pp2, straight):
    alone = reference_trainer(config(*BASE, *MODEL))
    load_alone(alone, saved_at_pp2)
    assert alone.step == 2
    assert losses(alone, 2) == pytest.approx(straight[2:], rel=1e-6)


@pytest.mark.mpi(min_size=4)
def test_pp2_resumes_at_pp4(saved_at_pp2, straight):
    trainer = build_trainer(*MODEL, "parallel.pp=4", f"checkpoint.resume={saved_at_pp2}")
    assert trainer.step == 2
    assert losses(trainer, 2) == pytest.approx(straight[2:], rel=1e-6)


@pytest.mark.mpi(min_size=4)
def test_tied_embeddings_under_zero3_resume_in_one_process(module_dir):
    """pp 2 x dp 2 with ZeRO-3 and tied embeddings: both ends hold the
    table's shards; the file holds it once and one process continues."""
    tied = (*MODEL, "model.tie_embeddings=true")
    straight = losses(reference_trainer(config(*BASE, *tied)), 4)
    trainer = build_trainer(*tied, "parallel.pp=2", "parallel.zero.stage=3", f"checkpoint.dir={module_dir}",
                            "checkpoint.every=100")
    assert losses(trainer, 2) == pytest.approx(straight[:2], rel=1e-6)
    path = trainer.save_checkpoint(f"{module_dir}/tied-zero3.h5")
    MPI.COMM_WORLD.Barrier()
    with h5py.File(path, "r") as f:
        assert "tok_embeddings.weight" in f["/model"] and "output.weight" not in f["/model"]
    alone = reference_trainer(config(*BASE, *tied))
    load_alone(alone, path)
    assert alone.step == 2
    assert losses(alone, 2) == pytest.approx(straight[2:], rel=1e-6)
