"""What an operator meets with a real 2-rank ``mpiexec`` job: a checkpoint
directory on a full file system (a small tmpfs mounted here, root only),
with an earlier checkpoint in it or empty, and two runs started on one
directory. The job ends by itself with one line saying what is wrong;
nothing already saved is lost."""
import os
import subprocess
import sys
import time

import pytest

from test_faults import _errors, _verify
from test_launchers import MPIEXEC, TIMEOUT, _env

# alone (a job beside it would skew what it times): a second run beside it, the seconds from a full
# disk to the exit
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.alone]

BASE = ["trainer.progress=off", "trainer.log_every=1", "checkpoint.keep=0"]


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MB tmpfs: one tiny checkpoint (about 1.6 MB) fits, two do not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    path = tmp_path / "fs"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mount -t tmpfs failed: {done.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def _job(args, run_dir, n=2):
    cmd = ["timeout", str(TIMEOUT), MPIEXEC, "-n", str(n), sys.executable, "-m", "hpctrain", *BASE, *args,
           f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=run_dir.parent)


def _until_exit(job, mark=None):
    """(exit status, output, seconds from the line containing ``mark`` to the end)."""
    lines, seen = [], None
    for line in job.stdout:
        lines.append(line)
        if mark and seen is None and mark in line:
            seen = time.monotonic()
    code = job.wait()
    return code, "".join(lines), (time.monotonic() - seen if seen else None)


def _space_line(out, ck):
    [line] = _errors(out)
    assert line.startswith("hpctrain: error: checkpoint step ") and f"{ck} has " in line, line
    assert "MB free but the checkpoint needs" in line and "no space left on device" in line, line
    return line


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_after_a_first_checkpoint_stops_the_run_and_keeps_it(small_fs, tmp_path, async_save):
    ck = small_fs / "ck"
    code, out, took = _until_exit(_job(["trainer.steps=6", "checkpoint.every=2", f"checkpoint.dir={ck}",
                                        f"checkpoint.async_save={str(async_save).lower()}"], tmp_path / "run"),
                                  mark="step 4/6")
    assert code == 6, out
    assert took is not None and took < 30, (took, out)
    assert "step 4 not saved" in _space_line(out, ck)
    assert "Traceback" not in out
    assert sorted(p.name for p in ck.iterdir()) == [".hpctrain.lock", "latest", "step_00000002.h5"]
    verify = _verify(ck)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_full_disk_with_no_checkpoint_yet_stops_the_run_at_its_first_save(small_fs, tmp_path):
    (small_fs / "filler").write_bytes(b"\0" * (2 << 20))  # someone else's file leaves 1 MB
    ck = small_fs / "ck"
    code, out, took = _until_exit(_job(["trainer.steps=4", "checkpoint.every=2", f"checkpoint.dir={ck}"],
                                       tmp_path / "run"), mark="step 2/4")
    assert code == 6, out
    assert took is not None and took < 30, (took, out)
    assert "step 2 not saved" in _space_line(out, ck)
    assert sorted(p.name for p in ck.iterdir()) == [".hpctrain.lock"]


def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_finishes(tmp_path):
    ck = tmp_path / "ck"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    # the first run's steps take a while (rank 1 slowed: 12 steps of 0.6 s after step 4), so the
    # second starts while it trains, even on a loaded machine where starting takes seconds
    first = _job(["trainer.steps=16", "checkpoint.every=4", f"checkpoint.dir={ck}", "debug.fault=slow",
                  "debug.fault_rank=1", "debug.fault_step=1", "debug.slow_s=0.6"], tmp_path / "first", n=2)
    lines = []
    for line in first.stdout:
        lines.append(line)
        if "checkpoint step 4 committed" in line:
            break
    second = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "hpctrain", *BASE, "trainer.steps=4",
                             "checkpoint.every=2", "checkpoint.resume=auto", f"checkpoint.dir={ck}",
                             f"hydra.run.dir={tmp_path / 'second'}"], env=_env(), capture_output=True, text=True,
                            timeout=TIMEOUT)
    code, rest, _ = _until_exit(first)
    out = "".join(lines) + rest
    assert second.returncode == 2, second.stdout + second.stderr
    [line] = _errors(second.stderr)
    assert f"checkpoint.dir {ck} is in use by the run on host " in line
    assert f"run directory {tmp_path / 'first'}" in line
    assert "give this run its own checkpoint.dir" in line
    assert code == 0, out
    assert sorted(p.name for p in ck.glob("step_*.h5")) == [f"step_{s:08d}.h5" for s in (4, 8, 12, 16)]
    verify = _verify(ck)
    assert verify.returncode == 0, verify.stdout + verify.stderr
