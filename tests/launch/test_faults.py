"""Faults injected into real 4-rank ``mpiexec`` jobs (``debug.fault``), and
what the user sees: the job ends by itself, in time, with one line naming
the rank to blame, and nothing already saved is lost.

The hang tests time the job from the moment the faulty rank says it injects
the fault to the job's end: the watchdog must stop it within twice
``reliability.hang_timeout_s`` (5 s here)."""
import os
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
    """``hpctrain-ckpt verify``: every checksum and every value finite."""
    exe = os.path.join(os.path.dirname(sys.executable), "hpctrain-ckpt")
    return subprocess.run([exe, "verify", str(path)], env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


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
                              tmp_path)
    assert code == 5, out
    assert took is not None and took < 2 * HANG_TIMEOUT, (took, out)
    [line] = _one_error(out)
    assert "rank 1 (host" in line and "stopped responding" in line and "wait for it" in line, line


def test_a_rank_stalled_before_a_checkpoint_save_is_named_and_older_checkpoints_kept(tmp_path):
    """The other ranks wait inside the save's MPI collectives (where, unwatched, they would wait for ever)."""
    ckpt = tmp_path / "ckpt"
    code, out, took = _launch(["trainer.steps=40", "checkpoint.every=2", f"checkpoint.dir={ckpt}", "debug.fault=stall",
                               "debug.fault_at=checkpoint", "debug.fault_rank=3", "debug.fault_step=4"], tmp_path)
    assert code == 5, out
    assert took is not None and took < 2 * HANG_TIMEOUT, (took, out)
    [line] = _one_error(out)
    assert "rank 3 (host" in line and "rank(s) 0, 1, 2 wait for it" in line and "checkpoint save #2" in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == [".hpctrain.lock", "latest", "step_00000002.h5"]
    verify = _verify(ckpt)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_killed_rank_ends_the_job_with_one_line_naming_it(tmp_path):
    """Rank 0 sees the dead rank's heartbeat connection close and says so in
    one line, instead of a 'connection reset' traceback from each gloo survivor."""
    code, out, took = _launch(["trainer.steps=40", "comm.backend=torch", "debug.fault=die", "debug.fault_rank=2",
                               "debug.fault_step=5"], tmp_path)
    assert code != 0
    assert took is not None and took < 60, (took, out)
    [line] = _one_error(out)
    assert "rank 2 (host" in line and "died" in line, line
    assert "Traceback" not in out and "Connection reset" not in out


def test_nan_at_step_3_with_stop_keeps_the_last_finite_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out, _ = _launch(["trainer.steps=6", "checkpoint.every=1", f"checkpoint.dir={ckpt}", "debug.fault=nan",
                            "debug.fault_rank=1", "debug.fault_step=3"], tmp_path, n=2)
    assert code == 3, out
    [line] = _one_error(out)
    assert "step 3:" in line and "not all finite" in line, line
    assert [m["step"] for m in _metrics(tmp_path)] == [1, 2]
    saved = sorted(p.name for p in ckpt.glob("*.h5"))
    assert saved == ["step_00000001.h5", "step_00000002.h5"]
    verify = _verify(ckpt)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_nan_at_step_3_with_skip_trains_on_and_counts_it(tmp_path):
    code, out, _ = _launch(["trainer.steps=5", "reliability.nonfinite=skip", "debug.fault=nan", "debug.fault_rank=1",
                            "debug.fault_step=3"], tmp_path, n=2)
    assert code == 0, out
    m = _metrics(tmp_path)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5]
    assert m[2]["loss"] is None and m[2]["skipped_steps"] == 1 and m[4]["skipped_steps"] == 1
    assert "skipped_steps" not in m[1] and all(x["loss"] is not None for x in m if x["step"] != 3)
    assert "update skipped" in out and not _errors(out)


def test_a_corrupted_replica_is_named(tmp_path):
    # 4 replicas (not 2): the one differing from the rest is named
    code, out, _ = _launch(["trainer.steps=6", "reliability.weight_check_every=1", "debug.fault=corrupt",
                            "debug.fault_rank=1", "debug.fault_step=2"], tmp_path)
    assert code == 4, out
    [line] = _one_error(out)
    assert "step 2:" in line and "rank(s) 1 differ" in line, line


def test_a_slowed_rank_is_named_as_a_straggler(tmp_path):
    code, out, _ = _launch(["trainer.steps=4", "reliability.straggler_every=1", "reliability.straggler_factor=3",
                            "debug.fault=slow", "debug.slow_s=0.2", "debug.fault_rank=3", "debug.fault_step=1"],
                           tmp_path)
    assert code == 0, out
    reports = [line for line in out.splitlines() if "straggler rank(s) " in line]
    assert reports and all(r.split("straggler rank(s) ")[1].startswith("3") for r in reports), out
    assert all(x["straggler.slowest_rank"] == 3 for x in _metrics(tmp_path))


def test_a_heartbeat_address_that_is_not_rank_0s_is_one_clear_line(tmp_path):
    """Rank 0 listens only on the address it advertises (not on every interface)."""
    code, out, _ = _launch(["trainer.steps=2"], tmp_path, n=2, HPCTRAIN_MASTER_ADDR="0.0.0.1")
    assert code == 2, out
    [line] = _one_error(out)
    assert "rank 0 cannot listen on 0.0.0.1" in line and "HPCTRAIN_MASTER_ADDR" in line, line
    assert "reliability.hang_timeout_s=0" in line and "Traceback" not in out


def test_a_persistent_straggler_stops_the_run_with_a_checkpoint_and_its_node_recorded(tmp_path):
    """reliability.straggler_stop_after=2: the second report in a row naming rank 3 saves, stops (76) and
    leaves last_failure.json naming rank 3 and its node, for slurm/train.sbatch to restart without it."""
    ckpt = tmp_path / "ckpt"
    code, out, _ = _launch(["trainer.steps=20", "reliability.straggler_every=1", "reliability.straggler_factor=3",
                            "reliability.straggler_stop_after=2", "debug.fault=slow", "debug.slow_s=0.2",
                            "debug.fault_rank=3", "debug.fault_step=1", f"checkpoint.dir={ckpt}"], tmp_path)
    assert code == 76, out
    reports = [line for line in out.splitlines() if "straggler rank(s) 3:" in line]
    assert len(reports) == 2, out  # the first report names it, the second in a row stops the run
    stop = [line for line in out.splitlines() if "named in 2 report(s) in a row" in line and "committed" in line]
    assert stop, out
    step = int(stop[0].split("step ")[1].split(":")[0])
    assert step < 20 and (ckpt / f"step_{step:08d}.h5").is_file(), (step, sorted(p.name for p in ckpt.glob("*")))
    import json
    import socket
    failure = json.loads((tmp_path / "last_failure.json").read_text())
    assert failure["ranks"] == [3] and failure["hosts"] == [socket.gethostname()] and failure["last_step"] == step
