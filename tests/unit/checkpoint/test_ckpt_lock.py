"""The checkpoint directory's lock (hpctrain_h5ckpt.lock): a second process
is refused with the holder named; the holder's death frees it; within one
process the lock is shared; without flock the lock file takes over, stale
holders are detected, and a live one is named with how to remove it."""
import errno
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from hpctrain_h5ckpt import lock

HOLD = textwrap.dedent("""
    import sys, time
    from hpctrain_h5ckpt import lock
    held = lock.acquire(sys.argv[1], run_dir="/runs/first")
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/ck``'s lock."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "ck")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_process_is_refused_and_told_who_holds_it(tmp_path, holder):
    with pytest.raises(lock.DirInUse) as refused:
        lock.acquire(str(tmp_path / "ck"))
    message = str(refused.value)
    assert f"pid {holder.pid}" in message and "run directory /runs/first" in message and "host " in message


def test_the_holders_death_frees_the_lock(tmp_path, holder):
    holder.kill()
    holder.wait()
    held = lock.acquire(str(tmp_path / "ck"))
    info = json.loads((tmp_path / "ck" / lock.LOCK_NAME).read_text())
    assert info["pid"] == os.getpid()
    lock.release(held)
    assert (tmp_path / "ck" / lock.LOCK_NAME).read_text() == ""  # no stale details left


def test_one_process_shares_its_lock_until_the_last_user_lets_go(tmp_path):
    d = str(tmp_path / "ck")
    a = lock.acquire(d)
    b = lock.acquire(d)
    assert a is b
    lock.release(a)
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(60)", ""), d], capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "DirInUse" in probe.stderr  # still held: one user left
    lock.release(b)
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(60)", ""), d], capture_output=True,
                           text=True)
    assert probe.returncode == 0, probe.stderr


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without flock (Lustre mounted with noflock)."""
    def flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(lock.fcntl, "flock", flock)


def test_without_flock_a_lock_file_is_taken_and_removed(tmp_path, no_flock):
    d = str(tmp_path / "ck")
    held = lock.acquire(d)
    assert held.mode == "lock file"
    path = tmp_path / "ck" / (lock.LOCK_NAME + lock.HELD_SUFFIX)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release(held)
    assert not path.exists()


def test_without_flock_a_live_holder_is_named_with_how_to_remove_its_file(tmp_path, no_flock):
    d = tmp_path / "ck"
    d.mkdir()
    held = d / (lock.LOCK_NAME + lock.HELD_SUFFIX)
    held.write_text(json.dumps({"host": "elsewhere", "pid": 12, "slurm_job": None, "run_dir": "/r", "since": "x"}))
    with pytest.raises(lock.DirInUse, match=f"host elsewhere, pid 12.*if that run is gone, remove {held}"):
        lock.acquire(str(d))


def test_without_flock_a_dead_holder_on_this_host_is_taken_over(tmp_path, no_flock):
    d = tmp_path / "ck"
    d.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    info = {**lock.holder_details(), "pid": int(dead.stdout)}
    (d / (lock.LOCK_NAME + lock.HELD_SUFFIX)).write_text(json.dumps(info))
    held = lock.acquire(str(d))
    assert json.loads((d / (lock.LOCK_NAME + lock.HELD_SUFFIX)).read_text())["pid"] == os.getpid()
    lock.release(held)


def test_without_flock_a_holder_whose_slurm_job_ended_is_stale(monkeypatch):
    monkeypatch.setattr(lock, "_slurm_job_running", lambda job: job == "7")
    elsewhere = {"host": "n17", "pid": 1, "slurm_job": "8"}
    assert lock.is_stale(elsewhere)
    assert not lock.is_stale({**elsewhere, "slurm_job": "7"})
    assert not lock.is_stale({**elsewhere, "slurm_job": None})  # nothing proves it gone


def test_a_run_that_never_saves_reads_a_locked_directory_without_its_lock(tmp_path, holder):
    """hpctrain-eval (and any run with every=0, save_on_stop=false) reads committed checkpoints while a
    training run holds the directory; a run that may save is refused it, and the reader leaves the
    training run's unfinished saves alone."""
    from mpi4py import MPI

    from hpctrain_h5ckpt import options
    from hpctrain_h5ckpt.checkpointer import H5Checkpointer
    from hpctrain_h5ckpt.errors import CheckpointDirInUse

    d = tmp_path / "ck"
    (d / "step_00000003.h5").write_bytes(b"")
    (d / "step_00000004.h5.tmp").write_bytes(b"")  # the holder's save in flight
    opts = options.resolve(options.H5Config())
    reader = H5Checkpointer(MPI.COMM_SELF, opts, str(d), 3, False, lock_now=True, read_only=True)
    assert reader.resolve("auto") == str(d / "step_00000003.h5")
    assert (d / "step_00000004.h5.tmp").exists()
    with pytest.raises(CheckpointDirInUse):  # a save asked for in code still needs the lock
        reader.save(types.SimpleNamespace(step=5))  # (refused before anything of the trainer is read)
    with pytest.raises(CheckpointDirInUse, match=f"in use by the run on .*pid {holder.pid}"):
        H5Checkpointer(MPI.COMM_SELF, opts, str(d), 3, False, lock_now=True)
