"""A 450-step run of the README's 4-rank demo that names no straggler.

(What a user sees when the command line or the checkpoint does not fit the
run, on every rank of an MPI job, is checked in the 2-rank session:
tests/mpi/test_cli_messages.py, test_cli_checkpoint_messages.py; ``--cfg``,
``--help`` and a bad sweep point in one process: tests/unit/test_cli_one_process.py.)"""
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


# alone: a job beside it would make its ranks stragglers for real
@pytest.mark.alone
def test_the_readme_demo_for_450_steps_names_no_straggler(tmp_path):
    """``scripts/demo.sh`` (``mpirun -n 4 hpctrain-train``, default straggler
    settings) for 450 steps: on small steps the ranks' compute times differ
    by milliseconds of scheduling noise, which the floor
    (``reliability.straggler_min_s``) keeps out of the report. The four ranks
    share rank 0's run directory, the loss falls and only rank 0 speaks."""
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "hpctrain", "trainer.progress=off", "trainer.log_every=450",
           "trainer.steps=450"]  # the run directory Hydra names (runs/<date>/<time>), as the demo's
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    code, out = r.returncode, r.stdout + r.stderr
    assert code == 0, out
    assert "straggler rank(s)" not in out, [line for line in out.splitlines() if "straggler" in line]
    [run_dir] = [p.parent for p in (tmp_path / "runs").rglob("metrics.jsonl")]  # every rank uses rank 0's
    metrics = _metrics(run_dir)
    checks = [m for m in metrics if "straggler.min_s" in m]
    assert len(checks) == 45 and all(m["straggler.min_s"] >= 0.010 for m in checks)
    assert len(metrics) == 450 and metrics[-1]["loss"] < metrics[0]["loss"] - 0.5  # it learns
    assert "dp=4" in (run_dir / "train.log").read_text()
    assert "[rank 1]" not in r.stderr and "step 450/450" in r.stderr  # rank 0 speaks; the others stay quiet
