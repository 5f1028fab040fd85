"""Room on disk for a checkpoint: how many bytes a file will take, how many
the directory's file system has free, reserving them, and the one line
that says so.

Three guards, because a write that fails half-way inside parallel HDF5 is
the one failure the ranks cannot always agree on (OMPIO's collective writes
do not report ENOSPC to every rank, and HDF5's collective metadata flush
then waits for a rank that has given up):

1. before a save opens its file, rank 0 compares the plan's size with the
   free space (``shortage``) and the run stops without touching the
   directory;
2. right after the file is created, rank 0 reserves the whole size for it
   (``reserve``: ``fallocate`` with ``FALLOC_FL_KEEP_SIZE``, so the file's
   length is unchanged), and a refusal is agreed before any data is
   written; the writes then land in blocks the file already owns, so
   another job filling the file system during the save cannot make them
   fail; the reservation beyond the file's end is trimmed after the close;
3. where the file system cannot reserve (``EOPNOTSUPP``), failures are still
   agreed phase by phase (``writer``), and the line naming the space is
   measured once the partial file is gone.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional

from hpctrain_h5ckpt.layout import Plan

HEADER_BYTES = 64 << 10
"""The file's superblock, root group and ``/meta`` (a few KiB; generous)."""
PER_DATASET_BYTES = 2 << 10
"""One dataset's object header with its attributes (path, spec, checksum: under 1 KiB; generous)."""


def needed_bytes(plan: Plan, alignment: int = 0) -> int:
    """An upper estimate of the file's size: the tensors, each dataset's
    header and, with alignment, the padding before each aligned dataset."""
    data = sum(d.nbytes for d in plan.datasets)
    padding = alignment * sum(1 for d in plan.datasets if alignment and d.nbytes >= alignment)
    return data + padding + PER_DATASET_BYTES * len(plan.datasets) + HEADER_BYTES


def free_bytes(directory: str) -> Optional[int]:
    """Bytes an unprivileged writer may still use in ``directory``'s file system (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def shortage(directory: str, needed: int) -> Optional[str]:
    """The line naming the missing room, or None when ``needed`` bytes fit."""
    free = free_bytes(directory)
    if free is None or free >= needed:
        return None
    return (f"{directory} has {_mb(free)} free but the checkpoint needs {_mb(needed)} (no space left on device); "
            "free space there or point checkpoint.dir at a larger file system, then relaunch with "
            "checkpoint.resume=auto")


_FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h: allocate blocks, leave the file's length alone


def _libc_fallocate():
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


def reserve(path: str, nbytes: int) -> Optional[str]:
    """Allocate ``nbytes`` of blocks for ``path`` without changing its length;
    the failure (no room), or None (reserved, or this file system cannot
    reserve, which the caller cannot help)."""
    if _fallocate is None:
        return None
    fd = os.open(path, os.O_WRONLY)
    try:
        if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
            return None
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if err in (errno.ENOSPC, errno.EDQUOT):
        return os.strerror(err)
    return None  # EOPNOTSUPP, ENOSYS, EINVAL: no reservation on this file system


def trim(path: str) -> None:
    """Give back what ``reserve`` allocated beyond the file's end."""
    try:
        os.truncate(path, os.path.getsize(path))
    except OSError:
        pass
