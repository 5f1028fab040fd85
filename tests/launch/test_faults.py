"""Faults injected into real ``mpiexec`` jobs (``debug.fault``; 4 ranks where the
others' list or the straggler's median needs them, else 2), and
what the user sees: the job ends by itself, in time, with one line naming
the rank to blame, and nothing already saved is lost. (Faults the job ends
through its own agreement, no rank hanging or dead: a NaN with stop or skip,
a corrupted replica, a heartbeat address rank 0 cannot listen on, run in the
MPI session's ranks: tests/mpi/test_cli_faults.py.)

The hang tests time the job from the moment the faulty rank says it injects
the fault to the job's end: the watchdog must stop it within twice
``reliability.hang_timeout_s`` (5 s here)."""
import contextlib
import io
import subprocess
import sys
import time

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

# alone (a job beside it would skew what it times): stalls, freezes, stragglers and a killed rank,
# found by the watchdog's timeouts
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.alone]

HANG_TIMEOUT = 5
BASE = ["trainer.progress=off", "trainer.log_every=1", f"reliability.hang_timeout_s={HANG_TIMEOUT}"]


def _launch(args, tmp_path, n=4, **env):
    """(exit status, the job's output, seconds from the fault's injection to the end or None)."""
    cmd = ["timeout", str(TIMEOUT), MPIEXEC, "-n", str(n), sys.executable, "-m", "hpctrain", *BASE, *args,
           f"hydra.run.dir={tmp_path}"]
    job = subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=tmp_path)
    lines, injected = [], None
    for line in job.stdout:
        lines.append(line)
        if injected is None and "injecting it now" in line:
            injected = time.monotonic()
    code = job.wait()
    return code, "".join(lines), (time.monotonic() - injected if injected is not None else None)


def _errors(out):
    return [line for line in out.splitlines() if line.startswith("hpctrain: error:")]


def _one_error(out):
    lines = _errors(out)
    assert len(lines) == 1, out
    return lines


def _verify(path):
    """``hpctrain-ckpt verify`` (its ``main``, in this process): every checksum and every value finite.
    (returncode, stdout, stderr), as ``subprocess.run`` gives them."""
    from hpctrain_h5ckpt.cli import main as ckpt_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ckpt_main(["verify", str(path)])
    return subprocess.CompletedProcess(["hpctrain-ckpt", "verify", str(path)], code, out.getvalue(), err.getvalue())


def test_a_stalled_rank_is_named_with_its_op_and_the_job_aborted(tmp_path):
    code, out, took = _launch(["trainer.steps=40", "debug.fault=stall", "debug.fault_rank=2", "debug.fault_step=5"],
                              tmp_path)
    assert code == 5, out
    assert took is not None and took < 2 * HANG_TIMEOUT, (took, out)
    [line] = _one_error(out)
    assert "rank 2 (host" in line and "stopped making progress in step 5" in line, line
    assert "rank(s) 0, 1, 3 wait for it" in line and "all_reduce #" in line and "on dp" in line, line
    assert "Traceback" not in out


def test_a_frozen_rank_is_named_as_not_responding(tmp_path):
    """SIGSTOP: the process's heartbeats stop too, and MPI_Abort still ends it."""
    code, out, took = _launch(["trainer.steps=40", "debug.fault=freeze", "debug.fault_rank=1", "debug.fault_step=5"],
                              tmp_path, n=2)
    assert code == 5, out
    assert took is not None and took < 2 * HANG_TIMEOUT, (took, out)
    [line] = _one_error(out)
    assert "rank 1 (host" in line and "stopped responding" in line and "wait for it" in line, line


def test_a_rank_stalled_before_a_checkpoint_save_is_named_and_older_checkpoints_kept(tmp_path):
    """The other ranks wait inside the save's MPI collectives (where, unwatched, they would wait for ever)."""
    ckpt = tmp_path / "ckpt"
    code, out, took = _launch(["trainer.steps=40", "checkpoint.every=2", f"checkpoint.dir={ckpt}", "debug.fault=stall",
                               "debug.fault_at=checkpoint", "debug.fault_rank=1", "debug.fault_step=4"], tmp_path, n=2)
    assert code == 5, out
    assert took is not None and took < 2 * HANG_TIMEOUT, (took, out)
    [line] = _one_error(out)
    assert "rank 1 (host" in line and "rank(s) 0 wait for it" in line and "checkpoint save #2" in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == [".hpctrain.lock", "latest", "step_00000002.h5"]
    verify = _verify(ckpt)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_killed_rank_ends_the_job_with_one_line_naming_it(tmp_path):
    """Rank 0 sees the dead rank's heartbeat connection close and says so in
    one line, instead of a 'connection reset' traceback from each gloo survivor."""
    code, out, took = _launch(["trainer.steps=40", "comm.backend=torch", "debug.fault=die", "debug.fault_rank=1",
                               "debug.fault_step=5"], tmp_path, n=2)
    assert code != 0
    assert took is not None and took < 60, (took, out)
    [line] = _one_error(out)
    assert "rank 1 (host" in line and "died" in line, line
    assert "Traceback" not in out and "Connection reset" not in out


def test_a_slowed_rank_is_named_as_a_straggler_and_a_persistent_one_stops_the_run_with_its_node_recorded(
        tmp_path):
    """Rank 3 sleeps 0.2 s in every step: each straggler report and every step's metrics name it, and
    with reliability.straggler_stop_after=2 the second report in a row saves, stops (76) and leaves
    last_failure.json naming rank 3 and its node, for slurm/train.sbatch to restart without it."""
    ckpt = tmp_path / "ckpt"
    code, out, _ = _launch(["trainer.steps=20", "reliability.straggler_every=1", "reliability.straggler_factor=3",
                            "reliability.straggler_stop_after=2", "debug.fault=slow", "debug.slow_s=0.2",
                            "debug.fault_rank=3", "debug.fault_step=1", f"checkpoint.dir={ckpt}"], tmp_path)
    assert code == 76, out
    reports = [line for line in out.splitlines() if "straggler rank(s) 3:" in line]
    assert len(reports) == 2, out  # the first report names it, the second in a row stops the run
    named = [line.split("straggler rank(s) ")[1] for line in out.splitlines() if "straggler rank(s) " in line]
    assert named and all(n.startswith("3") for n in named), out  # rank 3 first in every report
    assert all(x["straggler.slowest_rank"] == 3 for x in _metrics(tmp_path))
    stop = [line for line in out.splitlines() if "named in 2 report(s) in a row" in line and "committed" in line]
    assert stop, out
    step = int(stop[0].split("step ")[1].split(":")[0])
    assert step < 20 and (ckpt / f"step_{step:08d}.h5").is_file(), (step, sorted(p.name for p in ckpt.glob("*")))
    import json
    import socket
    failure = json.loads((tmp_path / "last_failure.json").read_text())
    assert failure["ranks"] == [3] and failure["hosts"] == [socket.gethostname()] and failure["last_step"] == step
