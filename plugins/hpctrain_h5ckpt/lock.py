"""One run at a time per checkpoint directory: an advisory lock.

Two runs writing one directory resume from each other, write the same step
names and prune each other's files. So rank 0 takes ``.hpctrain.lock`` in the
directory before the run's first save or resume, and holds it until the run
ends; a second run gets one line naming the holder and exits with status 2.

How: ``flock`` on the lock file (Linux local file systems, NFS, Lustre
mounted with ``flock``, GPFS). The kernel (or the file system's lock
manager) drops it when the holder's process dies, so a crashed run never
leaves a stale lock. The holder writes its host, pid, Slurm job id, run
directory and start time into the file, which is how the second run names
it. The file itself stays (deleting a ``flock``-ed file races with a run
opening it).

Where ``flock`` is not available (Lustre mounted without it or with
``noflock``: ``ENOSYS``/``EOPNOTSUPP``/``ENOLCK``), the lock is the
creation of ``.hpctrain.lock.held`` with ``O_EXCL``, holding the same
details, deleted when the run ends. A held file is stale, and taken over,
when its holder ran on this host and its pid is gone, or when its Slurm job
is no longer running (``squeue``); otherwise the message says how to remove
it by hand.

Within one process the lock is shared: a second checkpointer on the same
directory in the same process (a Hydra sweep run point after point, a
test) is the same job, not a rival.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import time
from typing import Any, Dict, Optional, Tuple

LOCK_NAME = ".hpctrain.lock"
HELD_SUFFIX = ".held"
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}
if hasattr(errno, "ENOTSUP"):
    _NO_FLOCK.add(errno.ENOTSUP)


class DirInUse(Exception):
    """The directory's lock is held by another run; the message names it."""


def holder_details(run_dir: Optional[str] = None) -> Dict[str, Any]:
    """What a lock says about the run that holds it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "run_dir": run_dir, "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe_holder(info: Optional[Dict[str, Any]]) -> str:
    if not info:
        return "another run (it has not written its details yet)"
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if info.get("slurm_job"):
        parts.append(f"Slurm job {info['slurm_job']}")
    if info.get("run_dir"):
        parts.append(f"run directory {info['run_dir']}")
    if info.get("since"):
        parts.append(f"since {info['since']}")
    return "the run on " + ", ".join(parts)


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            text = f.read()
        info = json.loads(text) if text.strip() else None
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def _slurm_job_running(job: str) -> Optional[bool]:
    """Whether Slurm says ``job`` is still pending or running (None: cannot tell)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return bool(out.stdout.strip())


def is_stale(info: Optional[Dict[str, Any]]) -> bool:
    """Whether a ``.held`` file's holder is provably gone."""
    if not info:
        return False
    if info.get("host") == socket.gethostname() and not _pid_alive(info.get("pid")):
        return True
    if info.get("slurm_job") and info.get("slurm_job") != os.environ.get("SLURM_JOB_ID"):
        return _slurm_job_running(info["slurm_job"]) is False
    return False


# realpath of the directory -> (lock, users in this process)
_HELD: Dict[str, Tuple["DirLock", int]] = {}


class DirLock:
    """The lock of one checkpoint directory, held by this process."""

    def __init__(self, directory: str, fd: Optional[int], held_path: Optional[str]):
        self.directory, self._fd, self._held_path = directory, fd, held_path
        self.mode = "flock" if fd is not None else "lock file"

    def _release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # no details left behind for a later reader
            except OSError:
                pass
            os.close(self._fd)  # drops the flock
            self._fd = None
        if self._held_path is not None:
            try:
                os.remove(self._held_path)
            except OSError:
                pass
            self._held_path = None


def _take_flock(path: str, details: Dict[str, Any]) -> Optional[int]:
    """The locked file's descriptor; None when this file system has no flock.
    Raises DirInUse when another run holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DirInUse(describe_holder(_read(path))) from None
        if e.errno in _NO_FLOCK:
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(details) + "\n").encode())
    os.fsync(fd)
    return fd


def _take_lock_file(path: str, details: Dict[str, Any]) -> str:
    held = path + HELD_SUFFIX
    for _ in range(2):
        try:
            fd = os.open(held, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = _read(held)
            if is_stale(info):
                try:
                    os.remove(held)
                except FileNotFoundError:
                    pass
                continue
            raise DirInUse(describe_holder(info) + f" (if that run is gone, remove {held})") from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(details) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return held
    raise DirInUse(f"another run, which took {held} while this one removed a stale copy")


def acquire(directory: str, run_dir: Optional[str] = None) -> DirLock:
    """Lock ``directory`` (created if missing) for this run; raises DirInUse naming the holder."""
    os.makedirs(directory, exist_ok=True)
    key = os.path.realpath(directory)
    if key in _HELD:
        lock, users = _HELD[key]
        _HELD[key] = (lock, users + 1)
        return lock
    path = os.path.join(directory, LOCK_NAME)
    details = holder_details(run_dir)
    fd = _take_flock(path, details)
    lock = DirLock(directory, fd, None if fd is not None else _take_lock_file(path, details))
    _HELD[key] = (lock, 1)
    return lock


def release(lock: DirLock) -> None:
    """One user of this process lets go; the last one drops the lock."""
    key = os.path.realpath(lock.directory)
    held = _HELD.get(key)
    if held is None or held[0] is not lock:
        return
    if held[1] > 1:
        _HELD[key] = (lock, held[1] - 1)
        return
    del _HELD[key]
    lock._release()
