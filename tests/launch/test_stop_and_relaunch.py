"""Stopping a 4-rank ``mpiexec`` job on purpose, outside SLURM: SIGTERM sent
to its ranks (what a scheduler's preemption does) and ``trainer.max_time``.
Each ends with a committed checkpoint and exit status 75; the same command
again (``checkpoint.resume=auto``) finishes the run, and the per-step losses
of both launches together are those of an uninterrupted run, bit for bit.
The SLURM version (SIGUSR1, requeue): tests/slurm/test_slurm_launch.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

COMMON = ["trainer.steps=10", "trainer.log_every=1", "trainer.progress=off"]


def _cmd(run_dir, *extra):
    return [MPIEXEC, "-n", "4", sys.executable, "-m", "hpctrain", *COMMON, *extra, f"hydra.run.dir={run_dir}"]


def _reference(tmp_path):
    r = subprocess.run(_cmd(tmp_path / "ref"), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return [m["loss"] for m in _metrics(tmp_path / "ref")]


def _ranks_of(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_sigterm_to_the_ranks_saves_stops_and_the_relaunch_is_exact(tmp_path):
    want = _reference(tmp_path)
    run = tmp_path / "run"
    resumable = ["checkpoint.resume=auto", "debug.fault=slow", "debug.slow_s=0.3"]
    job = subprocess.Popen(_cmd(run, *resumable), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=tmp_path)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and job.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    ranks = _ranks_of(job.pid)
    assert len(ranks) == 4, ranks
    for pid in ranks:  # the ranks, not mpiexec (which would kill them): as a scheduler's preemption does
        os.kill(pid, signal.SIGTERM)
    out, _ = job.communicate(timeout=TIMEOUT)
    assert job.returncode == 75, out
    assert "SIGTERM: saving and stopping" in out and "hpctrain: stopped: step" in out and "committed" in out, out
    stopped_at = len(_metrics(run))
    assert 3 <= stopped_at < 10
    again = subprocess.run(_cmd(run, *resumable), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                           cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"step_{stopped_at:08d}.h5" in again.stderr and "resumed from" in again.stderr
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, 11))
    assert [m["loss"] for m in got] == want


def test_max_time_saves_and_stops_before_the_limit_and_the_relaunch_is_exact(tmp_path):
    want = _reference(tmp_path)
    run = tmp_path / "run"
    limited = ["checkpoint.resume=auto", "trainer.max_time=4", "trainer.max_time_margin_s=0", "debug.fault=slow",
               "debug.slow_s=0.5"]
    first = subprocess.run(_cmd(run, *limited), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                           cwd=tmp_path)
    assert first.returncode == 75, first.stderr
    assert "stopped on trainer.max_time=4" in first.stderr and "committed" in first.stderr
    stopped_at = len(_metrics(run))
    assert 1 <= stopped_at < 10
    assert sum(m["step_time_s"] for m in _metrics(run)) < 4  # stopped before the limit, not after
    rest = [x for x in limited if not x.startswith("trainer.max_time")]
    again = subprocess.run(_cmd(run, *rest), env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, 11))
    assert [m["loss"] for m in got] == want
