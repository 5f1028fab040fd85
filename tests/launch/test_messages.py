"""What a user sees when the command line or the checkpoint does not fit the
run, in real ``mpiexec`` jobs: one ``hpctrain: error:`` line (a few for a
checkpoint of another model), exit status 2 on every rank, no traceback, no
hang; and a 450-step run of the README's 4-rank demo that names no
straggler.

The checkpoint cases share one 2-rank checkpoint directory (the tiny model,
global batch 16, steps 2 and 4) made once for the module."""
import subprocess
import sys

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

QUIET = ["trainer.progress=off", "trainer.log_every=100"]


def _launch(args, run_dir, n=2, quiet=QUIET):
    cmd = ([MPIEXEC, "-n", str(n)] if n else []) + [sys.executable, "-m", "hpctrain", *quiet, *args,
                                                     f"hydra.run.dir={run_dir}"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=run_dir)
    return r.returncode, r.stdout + r.stderr


def _errors(out):
    return [line[len("hpctrain: error: "):] for line in out.splitlines() if line.startswith("hpctrain: error: ")]


@pytest.mark.parametrize("override,expected", [
    ("optim.lr=abc", "optim.lr='abc': must be a number (float), e.g. optim.lr=0.003"),
    ("trainer.steps=1.5", "trainer.steps=1.5: must be an integer (int), e.g. trainer.steps=40"),
    ("trainer.stepz=3", "trainer.stepz is not a config key (trainer has no 'stepz'); did you mean trainer.steps?"),
])
def test_a_wrong_type_or_unknown_key_is_one_line_and_status_2_on_every_rank(tmp_path, override, expected):
    code, out = _launch([override], tmp_path)
    assert code == 2, out
    assert _errors(out) == [expected], out
    assert "Traceback" not in out and "full_key" not in out and "HYDRA_FULL_ERROR" not in out, out


def test_cfg_help_and_a_bad_sweep_point_in_one_process(tmp_path):
    """``--cfg job`` and ``--help`` still work; a sweep with a bad value is refused
    before any point runs, in one line."""
    code, out = _launch(["--cfg", "job", "trainer.steps=3"], tmp_path, n=0, quiet=[])
    assert code == 0 and "steps: 3" in out, out
    code, out = _launch(["--help"], tmp_path, n=0, quiet=[])
    assert code == 0 and "Configuration groups" in out, out
    code, out = _launch(["--multirun", "trainer.steps=1", "optim.lr=1e-3,abc", f"hydra.sweep.dir={tmp_path}/sweep"],
                        tmp_path, n=0, quiet=[])
    assert code == 2 and _errors(out) == ["optim.lr='abc': must be a number (float), e.g. optim.lr=0.003"], out
    assert not (tmp_path / "sweep" / "0" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint directory of the tiny model (d_model 64, global batch 16): steps 2 and 4."""
    run = tmp_path_factory.mktemp("saved")
    code, out = _launch(["trainer.steps=4", "checkpoint.every=2", f"checkpoint.dir={run}/ckpt"], run)
    assert code == 0, out
    assert (run / "ckpt" / "step_00000002.h5").exists() and (run / "ckpt" / "step_00000004.h5").exists()
    return run / "ckpt"


def test_a_checkpoint_of_another_model_is_a_few_lines_before_the_first_step(saved, tmp_path):
    code, out = _launch(["model.d_model=32", f"checkpoint.resume={saved}/step_00000004.h5"], tmp_path)
    assert code == 2, out
    lines = _errors(out)
    assert lines[0].startswith(f"checkpoint {saved}/step_00000004.h5 does not fit this model: ")
    assert "the model config differs from the one that saved it (model.d_model=64 there, 32 here)" in lines[0]
    tensors = [line for line in lines if line.startswith("  /model/")]
    assert len(tensors) == 3 and all("in the checkpoint" in t and "in this model" in t for t in tensors), out
    assert lines[4].startswith("  and ") and lines[4].endswith(" more tensors differ"), out
    assert lines[5].startswith("resume with the model settings it was saved with") and len(lines) == 6, out
    assert "Traceback" not in out and not (tmp_path / "metrics.jsonl").exists(), out


def test_resume_auto_says_once_that_it_tries_no_older_checkpoint(saved, tmp_path):
    code, out = _launch(["model.d_model=32", "checkpoint.resume=auto", f"checkpoint.dir={saved}"], tmp_path)
    assert code == 2, out
    lines = _errors(out)
    assert len([line for line in lines if "does not fit this model" in line]) == 1, out
    assert "step_00000004.h5 does not fit" in lines[0] and "step_00000002.h5" not in "\n".join(lines), out
    assert lines[-1].endswith("checkpoint.resume=auto tries no older checkpoint of its directory: a checkpoint "
                              "that does not fit is not damaged, and the others there were saved by the same model")
    assert len(lines) == 6 and "skipping" not in out and "Traceback" not in out, out


def test_another_optimizer_is_refused_before_the_first_step(saved, tmp_path):
    """AdamW's state resumed by LARS (it would carry AdamW's moments into every later save) or the other way
    (AdamW failed at its first step without its moments): one line naming both and the fixes."""
    def files():  # (the lock file is taken by every run that resumes here)
        return {p.name: p.stat().st_mtime_ns for p in saved.iterdir() if p.name != ".hpctrain.lock"}

    before = files()
    code, out = _launch(["optim=lars", "checkpoint.resume=auto", f"checkpoint.dir={saved}"], tmp_path)
    assert code == 2, out
    path = f"{saved}/step_00000004.h5"
    assert _errors(out) == [
        f"checkpoint {path} holds the optimizer state of optim.name='adamw', and this run uses 'lars'; resume with "
        f"optim=adamw, or start lars from its weights alone in another checkpoint.dir with "
        f"checkpoint.init_from={path} (step 0, a fresh optimizer state)"], out
    assert "Traceback" not in out and not (tmp_path / "metrics.jsonl").exists(), out
    assert files() == before


def test_another_global_batch_is_refused_through_an_explicit_path(saved, tmp_path):
    code, out = _launch(["trainer.global_batch_size=32", f"checkpoint.resume={saved}/step_00000004.h5"], tmp_path)
    assert code == 2, out
    assert _errors(out) == [
        f"checkpoint {saved}/step_00000004.h5: saved with trainer.global_batch_size=16, resumed with "
        "trainer.global_batch_size=32; resume with trainer.global_batch_size=16, or set "
        "checkpoint.allow_batch_change=true to continue the same sample stream in batches of the new size"], out
    assert "Traceback" not in out and not (tmp_path / "metrics.jsonl").exists(), out


def test_an_allowed_batch_change_continues_the_sample_stream_and_says_how(saved, tmp_path):
    code, out = _launch(["trainer.global_batch_size=32", "trainer.steps=6", "checkpoint.allow_batch_change=true",
                         f"checkpoint.resume={saved}/step_00000004.h5"], tmp_path)
    assert code == 0, out
    assert ("the global sample cursor continues at sample 64, so the stream of samples is the same, cut into "
            "batches of 32; the learning-rate schedule follows the step") in out, out
    assert [(m["step"], m["consumed_samples"]) for m in _metrics(tmp_path)] == [(5, 96), (6, 128)]


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_and_they_stay(saved, tmp_path):
    """A run without checkpoint.resume whose checkpoint.dir holds another run's checkpoints would save beside
    them (keep prunes by step; resume=auto would continue whichever run is further): refused before step 1,
    on every rank in one line, with the directory as it was. save_on_stop alone is enough to be refused."""
    before = {p.name: p.stat().st_mtime_ns for p in saved.iterdir()}
    code, out = _launch(["trainer.steps=3", f"checkpoint.dir={saved}"], tmp_path)
    assert code == 2, out
    assert _errors(out) == [
        f"checkpoint.dir {saved} already holds checkpoints of another run (newest step_00000004.h5) and this run "
        "starts afresh (checkpoint.resume is not set): its saves would mix with them, and checkpoint.resume=auto "
        "would then continue whichever run reached the higher step; continue that run with "
        "checkpoint.resume=auto, or give this one its own checkpoint.dir"], out
    assert "Traceback" not in out and not (tmp_path / "metrics.jsonl").exists(), out
    assert {p.name: p.stat().st_mtime_ns for p in saved.iterdir()} == before


# alone: a job beside it would make its ranks stragglers for real
@pytest.mark.alone
def test_the_readme_demo_for_450_steps_names_no_straggler(tmp_path):
    """``scripts/demo.sh`` (``mpirun -n 4 hpctrain-train``, default straggler
    settings) for 450 steps: on small steps the ranks' compute times differ
    by milliseconds of scheduling noise, which the floor
    (``reliability.straggler_min_s``) keeps out of the report."""
    code, out = _launch(["trainer.steps=450"], tmp_path, n=4, quiet=["trainer.progress=off", "trainer.log_every=450"])
    assert code == 0, out
    assert "straggler rank(s)" not in out, [line for line in out.splitlines() if "straggler" in line]
    checks = [m for m in _metrics(tmp_path) if "straggler.min_s" in m]
    assert len(checks) == 45 and all(m["straggler.min_s"] >= 0.010 for m in checks)
