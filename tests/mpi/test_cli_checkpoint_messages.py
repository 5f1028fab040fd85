"""What a user sees when the checkpoint does not fit the run, as
``mpiexec -n 2 hpctrain-train ... checkpoint.resume=...`` shows it, run in
this session's ranks (tests/mpi/cli_session.py): a few ``hpctrain: error:``
lines, exit status 2 on every rank, no traceback, the checkpoints as they
were. (Formerly real launches in tests/launch/test_messages.py.)

The cases share one checkpoint directory of the tiny model (d_model 64,
global batch 16): steps 2 and 4, made once for the module."""
import os
from pathlib import Path

import pytest
from cli_session import metrics, module_dir, remove_dir, train

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def saved():
    """A checkpoint directory of the tiny model (d_model 64, global batch 16): steps 2 and 4."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    run = module_dir(world, "hpctrain-saved-")
    j = train(world, None, ["trainer.steps=4", "checkpoint.every=2", f"checkpoint.dir={run}/ckpt"], run)
    assert j.codes == [0] * len(j.codes)
    ckpt = Path(run) / "ckpt"
    assert (ckpt / "step_00000002.h5").exists() and (ckpt / "step_00000004.h5").exists()
    yield ckpt
    remove_dir(world, run)


@pytest.fixture
def job(world, capfd, monkeypatch, shared_tmp):
    monkeypatch.chdir(shared_tmp)
    return lambda *args: train(world, capfd, args, shared_tmp)


def _refused_before_step_1(j, shared_tmp):
    assert j.codes == [2] * len(j.codes), j.out
    assert "Traceback" not in j.out and not os.path.exists(f"{shared_tmp}/metrics.jsonl"), j.out


def test_a_checkpoint_of_another_model_is_a_few_lines_before_the_first_step(saved, job, shared_tmp):
    j = job("model.d_model=32", f"checkpoint.resume={saved}/step_00000004.h5")
    _refused_before_step_1(j, shared_tmp)
    lines = j.errors()
    assert lines[0].startswith(f"checkpoint {saved}/step_00000004.h5 does not fit this model: ")
    assert "the model config differs from the one that saved it (model.d_model=64 there, 32 here)" in lines[0]
    tensors = [line for line in lines if line.startswith("  /model/")]
    assert len(tensors) == 3 and all("in the checkpoint" in t and "in this model" in t for t in tensors), j.out
    assert lines[4].startswith("  and ") and lines[4].endswith(" more tensors differ"), j.out
    assert lines[5].startswith("resume with the model settings it was saved with") and len(lines) == 6, j.out


def test_resume_auto_says_once_that_it_tries_no_older_checkpoint(saved, job, shared_tmp):
    j = job("model.d_model=32", "checkpoint.resume=auto", f"checkpoint.dir={saved}")
    _refused_before_step_1(j, shared_tmp)
    lines = j.errors()
    assert len([line for line in lines if "does not fit this model" in line]) == 1, j.out
    assert "step_00000004.h5 does not fit" in lines[0] and "step_00000002.h5" not in "\n".join(lines), j.out
    assert lines[-1].endswith("checkpoint.resume=auto tries no older checkpoint of its directory: a checkpoint "
                              "that does not fit is not damaged, and the others there were saved by the same model")
    assert len(lines) == 6 and "skipping" not in j.out, j.out


def _files(saved):  # (the lock file is taken by every run that resumes here)
    return {p.name: p.stat().st_mtime_ns for p in saved.iterdir() if p.name != ".hpctrain.lock"}


def test_another_optimizer_is_refused_before_the_first_step(saved, job, shared_tmp):
    """AdamW's state resumed by LARS (it would carry AdamW's moments into every later save) or the other way
    (AdamW failed at its first step without its moments): one line naming both and the fixes."""
    before = _files(saved)
    j = job("optim=lars", "checkpoint.resume=auto", f"checkpoint.dir={saved}")
    _refused_before_step_1(j, shared_tmp)
    path = f"{saved}/step_00000004.h5"
    assert j.errors() == [
        f"checkpoint {path} holds the optimizer state of optim.name='adamw', and this run uses 'lars'; resume with "
        f"optim=adamw, or start lars from its weights alone in another checkpoint.dir with "
        f"checkpoint.init_from={path} (step 0, a fresh optimizer state)"], j.out
    assert _files(saved) == before


def test_another_global_batch_is_refused_through_an_explicit_path(saved, job, shared_tmp):
    j = job("trainer.global_batch_size=32", f"checkpoint.resume={saved}/step_00000004.h5")
    _refused_before_step_1(j, shared_tmp)
    assert j.errors() == [
        f"checkpoint {saved}/step_00000004.h5: saved with trainer.global_batch_size=16, resumed with "
        "trainer.global_batch_size=32; resume with trainer.global_batch_size=16, or set "
        "checkpoint.allow_batch_change=true to continue the same sample stream in batches of the new size"], j.out


def test_an_allowed_batch_change_continues_the_sample_stream_and_says_how(saved, job, shared_tmp):
    j = job("trainer.global_batch_size=32", "trainer.steps=6", "checkpoint.allow_batch_change=true",
            f"checkpoint.resume={saved}/step_00000004.h5")
    assert j.codes == [0] * len(j.codes), j.out
    assert ("the global sample cursor continues at sample 64, so the stream of samples is the same, cut into "
            "batches of 32; the learning-rate schedule follows the step") in j.out, j.out
    assert [(m["step"], m["consumed_samples"]) for m in metrics(shared_tmp)] == [(5, 96), (6, 128)]


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_and_they_stay(saved, job, shared_tmp):
    """A run without checkpoint.resume whose checkpoint.dir holds another run's checkpoints would save beside
    them (keep prunes by step; resume=auto would continue whichever run is further): refused before step 1,
    on every rank in one line, with the directory as it was. save_on_stop alone is enough to be refused."""
    before = {p.name: p.stat().st_mtime_ns for p in saved.iterdir()}
    j = job("trainer.steps=3", f"checkpoint.dir={saved}")
    _refused_before_step_1(j, shared_tmp)
    assert j.errors() == [
        f"checkpoint.dir {saved} already holds checkpoints of another run (newest step_00000004.h5) and this run "
        "starts afresh (checkpoint.resume is not set): its saves would mix with them, and checkpoint.resume=auto "
        "would then continue whichever run reached the higher step; continue that run with "
        "checkpoint.resume=auto, or give this one its own checkpoint.dir"], j.out
    assert {p.name: p.stat().st_mtime_ns for p in saved.iterdir()} == before
