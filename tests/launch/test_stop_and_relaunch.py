"""Stopping a 2-rank ``mpiexec`` job on purpose, outside SLURM: SIGTERM sent
to its ranks (what a scheduler's preemption does), SIGTERM and SIGUSR1 sent
to ``mpiexec`` itself (a terminal closing, a wrapper script, ``kill``), and
``trainer.max_time``. Each ends with a committed checkpoint, also when the
run never set ``checkpoint.every`` or ``checkpoint.resume`` (the command
line's default directory receives it); the same command again with
``checkpoint.resume=auto`` finishes the run, and the per-step losses of both
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

COMMON = ["trainer.steps=10", "trainer.log_every=1", "trainer.progress=off"]
RANKS = 2
"""Ranks per job: what is tested (every rank saves and stops as one, mpiexec forwards
or delays the signal) holds at any count, and each rank costs seconds of start-up."""
KILL_DELAY_S = 6
"""Open MPI's kill delay for the test that signals mpiexec: the ranks get
SIGTERM this long after mpiexec does, and SIGKILL as long again, which must
cover the rest of a step (2 s here) and the save."""


def _cmd(run_dir, *extra):
    return [MPIEXEC, "-n", str(RANKS), sys.executable, "-m", "hpctrain", *COMMON, *extra, f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The per-step losses of the run never stopped (one run for the module)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    r = subprocess.run(_cmd(tmp_path / "ref"), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return [m["loss"] for m in _metrics(tmp_path / "ref")]


def _wait_for_steps(job, run, steps):
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and job.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)


def _ranks_of(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_sigterm_to_the_ranks_saves_stops_and_the_relaunch_is_exact(tmp_path, reference):
    want = reference
    run = tmp_path / "run"
    resumable = ["checkpoint.resume=auto", "debug.fault=slow", "debug.slow_s=0.3"]
    job = subprocess.Popen(_cmd(run, *resumable), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=tmp_path)
    _wait_for_steps(job, run, 3)
    ranks = _ranks_of(job.pid)
    assert len(ranks) == RANKS, ranks
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


def _stop_mpiexec(tmp_path, sig, slow_s, env):
    """Launch with no checkpoint settings, send ``sig`` to mpiexec after two
    steps; (mpiexec's exit status, its output, the steps run, the checkpoint
    committed in the default directory)."""
    run = tmp_path / "run"
    job = subprocess.Popen(_cmd(run, "debug.fault=slow", f"debug.slow_s={slow_s}"), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    _wait_for_steps(job, run, 2)
    job.send_signal(sig)
    out, _ = job.communicate(timeout=TIMEOUT)
    assert f"{signal.Signals(sig).name}: saving and stopping" in out and "hpctrain: stopped: step" in out, out
    stopped_at = len(_metrics(run))
    assert 2 <= stopped_at < 10
    saved = list(tmp_path.glob("checkpoints/tiny-*/*.h5"))  # the default directory: nothing set it
    assert [p.name for p in saved] == [f"step_{stopped_at:08d}.h5"], out
    assert f"checkpoint {saved[0]} committed" in out
    return job.returncode, out, stopped_at, saved[0]


def test_sigterm_to_mpiexec_saves_without_checkpoint_every_and_the_relaunch_is_exact(tmp_path, reference):
    """Open MPI's mpiexec sends its ranks SIGTERM only after its kill delay,
    and SIGKILL after the same delay again, so the delay is raised as
    docs/slurm.md says; its own exit status is then 1, whatever the ranks
    return. Steps of about 2 s (rank 0 sleeps in each), so the signal lands
    mid-step."""
    env = _env(OMPI_MCA_odls_base_sigkill_timeout=str(KILL_DELAY_S))
    code, out, stopped_at, saved = _stop_mpiexec(tmp_path, signal.SIGTERM, 2, env)
    assert code == 1, out
    again = subprocess.run(_cmd(tmp_path / "run", "checkpoint.resume=auto"), env=_env(), capture_output=True,
                           text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {saved}" in again.stderr
    got = _metrics(tmp_path / "run")
    assert [m["step"] for m in got] == list(range(1, 11))
    assert [m["loss"] for m in got] == reference


def test_sigusr1_to_mpiexec_is_forwarded_and_the_stop_status_comes_through(tmp_path):
    """No raised kill delay needed: Open MPI forwards SIGUSR1 at once, and
    the ranks' 75 is mpiexec's status. (The resume is the one above.)"""
    code, out, _, _ = _stop_mpiexec(tmp_path, signal.SIGUSR1, 0.5, _env())
    assert code == 75, out


def test_max_time_saves_and_stops_before_the_limit_and_the_relaunch_is_exact(tmp_path, reference):
    """The first launch sets neither checkpoint.every nor checkpoint.resume."""
    want = reference
    run = tmp_path / "run"
    limited = ["trainer.max_time=4", "trainer.max_time_margin_s=0", "debug.fault=slow", "debug.slow_s=0.5"]
    first = subprocess.run(_cmd(run, *limited), env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                           cwd=tmp_path)
    assert first.returncode == 75, first.stderr
    assert "stopped on trainer.max_time=4" in first.stderr and "committed" in first.stderr
    stopped_at = len(_metrics(run))
    assert 1 <= stopped_at < 10
    assert sum(m["step_time_s"] for m in _metrics(run)) < 4  # stopped before the limit, not after
    rest = ["checkpoint.resume=auto"] + [x for x in limited if not x.startswith("trainer.max_time")]
    again = subprocess.run(_cmd(run, *rest), env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, 11))
    assert [m["loss"] for m in got] == want
