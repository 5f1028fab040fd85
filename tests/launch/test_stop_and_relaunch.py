"""Stopping a 2-rank ``mpiexec`` job on purpose, outside SLURM: SIGTERM sent
to its ranks (what a scheduler's preemption does), SIGTERM and SIGUSR1 sent
to ``mpiexec`` itself (a terminal closing, a wrapper script, ``kill``), and
``trainer.max_time``. One run is stopped each of these ways in turn, five
launches of the same command: each stop ends with a committed checkpoint, the
first also when the run never set ``checkpoint.every`` or ``checkpoint.resume``
(the command line's default directory receives it); each next launch with
``checkpoint.resume=auto`` goes on from it, and the per-step losses of all
launches together are those of an uninterrupted run, bit for bit. What each
launcher gives the ranks (measured): docs/slurm.md. The SLURM version
(SIGUSR1, requeue): tests/slurm/test_slurm_launch.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

# alone (a job beside it would skew what it times): signals sent to a running job and trainer.max_time
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.alone]

STEPS = 16
COMMON = [f"trainer.steps={STEPS}", "trainer.log_every=1", "trainer.progress=off"]
RANKS = 2
"""Ranks per job: what is tested (every rank saves and stops as one, mpiexec forwards
or delays the signal) holds at any count, and each rank costs seconds of start-up."""
KILL_DELAY_S = 6
"""Open MPI's kill delay for the launch whose mpiexec gets SIGTERM: the ranks get
SIGTERM this long after mpiexec does, and SIGKILL as long again, which must
cover the rest of a step (2 s there) and the save."""
RESUME = "checkpoint.resume=auto"


def _cmd(run_dir, *extra):
    return [MPIEXEC, "-n", str(RANKS), sys.executable, "-m", "hpctrain", *COMMON, *extra, f"hydra.run.dir={run_dir}"]


def _uninterrupted(tmp_path):
    """The per-step losses of the run never stopped."""
    r = subprocess.run(_cmd(tmp_path / "ref"), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return [m["loss"] for m in _metrics(tmp_path / "ref")]


def _steps_done(run):
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _start(tmp_path, run, *extra, env=None):
    return subprocess.Popen(_cmd(run, *extra), env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)


def _wait_for_steps(job, run, steps):
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and job.poll() is None:
        if _steps_done(run) >= steps:
            return
        time.sleep(0.2)


def _ranks_of(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _stopped(out, run, before, name):
    """The launch saved and stopped after a step of its own: the step it stopped at."""
    assert f"{name}: saving and stopping" in out and "hpctrain: stopped: step" in out and "committed" in out, out
    at = _steps_done(run)
    assert before < at < STEPS, (before, at, out)
    return at


def test_each_kind_of_stop_saves_and_the_next_launch_goes_on_exactly(tmp_path):
    want = _uninterrupted(tmp_path)
    run = tmp_path / "run"

    # 1. SIGTERM to mpiexec, a run with no checkpoint settings. Open MPI's mpiexec sends its ranks
    # SIGTERM only after its kill delay, and SIGKILL after the same delay again, so the delay is raised
    # as docs/slurm.md says; its own exit status is then 1, whatever the ranks return. Steps of about
    # 2 s (rank 0 sleeps in each), so the signal lands mid-step.
    job = _start(tmp_path, run, "debug.fault=slow", "debug.slow_s=2",
                 env=_env(OMPI_MCA_odls_base_sigkill_timeout=str(KILL_DELAY_S)))
    _wait_for_steps(job, run, 2)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=TIMEOUT)
    assert job.returncode == 1, out
    at = _stopped(out, run, 1, "SIGTERM")
    saved = list(tmp_path.glob("checkpoints/tiny-*/*.h5"))  # the default directory: nothing set it
    assert [p.name for p in saved] == [f"step_{at:08d}.h5"], out
    assert f"checkpoint {saved[0]} committed" in out

    # 2. trainer.max_time: saves and stops before the limit
    limited = ["trainer.max_time=4", "trainer.end_margin_s=0", "debug.fault=slow", "debug.slow_s=0.5"]
    first = subprocess.run(_cmd(run, RESUME, *limited), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                           cwd=tmp_path)
    assert first.returncode == 75, first.stderr
    assert f"resumed from {saved[0]}" in first.stderr
    assert "stopped on trainer.max_time=4" in first.stderr and "committed" in first.stderr
    before, at = at, _steps_done(run)
    assert before < at < STEPS, (before, at)
    assert sum(m["step_time_s"] for m in _metrics(run)[before:]) < 4  # stopped before the limit, not after

    # 3. SIGTERM to the ranks, not mpiexec (which would kill them): as a scheduler's preemption does
    job = _start(tmp_path, run, RESUME, "debug.fault=slow", "debug.slow_s=0.3")
    _wait_for_steps(job, run, at + 1)
    ranks = _ranks_of(job.pid)
    assert len(ranks) == RANKS, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    out, _ = job.communicate(timeout=TIMEOUT)
    assert job.returncode == 75, out
    at = _stopped(out, run, at, "SIGTERM")

    # 4. SIGUSR1 to mpiexec: Open MPI forwards it at once (no raised kill delay needed), and the
    # ranks' 75 is mpiexec's status
    job = _start(tmp_path, run, RESUME, "debug.fault=slow", "debug.slow_s=0.5")
    _wait_for_steps(job, run, at + 1)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=TIMEOUT)
    assert job.returncode == 75, out
    at = _stopped(out, run, at, "SIGUSR1")

    # 5. the same command again finishes the run: every step once, the losses of the run never stopped
    again = subprocess.run(_cmd(run, RESUME), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                           cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"step_{at:08d}.h5" in again.stderr and "resumed from" in again.stderr
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in got] == want
