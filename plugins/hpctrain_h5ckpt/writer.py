"""Write one checkpoint file from every rank's owned hyperslabs.

Order of work, identical on every rank (parallel HDF5 requires file,
dataset and attribute creation to be collective with the same arguments):

1. create every dataset of the Plan in path order, with its attributes,
   and the ``/meta`` attributes;
2. write: datasets of at least ``collective_min_bytes`` are written with
   collective MPI-IO, every rank taking part (with an empty selection when
   it owns nothing of that dataset), so MPI-IO can aggregate the requests;
   smaller ones are written independently by their owner, which avoids a
   synchronisation per tiny tensor;
3. checksums: each rank sums its owned boxes (``checksum.partial``) while
   the kernel writes the data back; one ``Allreduce`` gives every dataset's
   checksum to every rank, so the ``checksum`` attributes are created
   collectively with the same values;
4. flush (``MPI_File_sync``: the fsync) and close.

Without MPI-enabled h5py (``IOOptions.parallel`` false) the same file is
written serially: rank 0 creates every dataset and attribute and writes its
boxes, then a token passes rank to rank; each opens the file, writes its
boxes, closes it and passes the token on. The result is the same file (the
tests compare them dataset by dataset); only the speed differs.

Failures are agreed, never raised locally: a rank that fails (a full disk,
an I/O error) records it, writes nothing more, and still joins every
collective call of the phase (with an empty selection); the ranks then
agree (one allgather) before the next collective phase, so none is left
alone in a collective another skipped. After an agreed failure rank 0
empties the file before the collective close (see ``_release_space``) and
every rank raises the same ``CheckpointError``; the caller deletes the
file. A failure inside the creation of the datasets' metadata on some
ranks only can still leave the others in HDF5's own metadata
synchronisation (rare: no data is written there); the hang watchdog
names that.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from hpctrain_h5ckpt import checksum, h5io, space
from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.layout import Box, Plan
from hpctrain_h5ckpt.options import IOOptions

_TOKEN_TAG = 7301
WRITEBACK_EVERY = 32 << 20
"""Bytes a rank writes between requests to start writing back (``h5io.start_writeback``)."""
Owned = Dict[str, List[Tuple[Box, np.ndarray]]]


def local_checksums(plan: Plan, owned: Owned) -> np.ndarray:
    """(n_datasets, 2) uint32: this rank's share of every dataset's checksum."""
    sums = np.zeros((len(plan.datasets), 2), dtype=np.uint32)
    for i, decl in enumerate(plan.datasets):
        for box, arr in owned.get(decl.path, []):
            sums[i] = checksum.add(sums[i], checksum.partial(arr, decl.shape, box))
    return sums


def compute_checksums(plan: Plan, owned: Owned, comm: Any) -> np.ndarray:
    """(n_datasets, 2) uint32 checksums, identical on every rank."""
    sums = local_checksums(plan, owned)
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    return sums


def _write_meta(f: Any, attrs: Mapping[str, Any]) -> None:
    meta = f.require_group("meta")
    for key, value in attrs.items():
        meta.attrs[key] = np.int64(value) if isinstance(value, (bool, int)) else value


_MPI_FAILURE = re.compile(r"\s*\((MPI_\w+) failed: MPI error string is '(MPI_ERR_\w+): ([^']*)'\)")
"""How HDF5 (through h5py) reports an MPI-IO call's failure: ``Unable to create file (MPI_File_open failed:
MPI error string is 'MPI_ERR_NO_SUCH_FILE: no such file or directory')``."""

FIXES: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("MPI_ERR_NO_SUCH_FILE", "No such file or directory"),
     "checkpoint.dir must be on a file system every rank sees (a shared one, not a node-local path) and stay "
     "there while the run saves"),
    (("MPI_ERR_ACCESS", "Permission denied"),
     "make checkpoint.dir writable by the user the job runs as, or choose another checkpoint.dir"),
    (("MPI_ERR_READ_ONLY", "Read-only file system"), "choose a checkpoint.dir on a writable file system"),
    (("MPI_ERR_NO_SPACE", "No space left on device", "MPI_ERR_QUOTA", "Disk quota exceeded"),
     "free space (or quota) there, lower checkpoint.keep, or choose another checkpoint.dir"),
    (("MPI_ERR_IO", "Input/output error"),
     "the file system reported an I/O error: check its health (the site's status page, dmesg) before relaunching, "
     "or choose another checkpoint.dir"),
)
"""What a failed write's text holds (MPI-IO's error class, or the errno text of a serial write) -> the fix."""


def fix_for(text: str) -> Optional[str]:
    """The fix for a write failure described by ``text``, or None when it is not one we know."""
    folded = text.lower()
    return next((fix for marks, fix in FIXES if any(m.lower() in folded for m in marks)), None)


def _describe(e: BaseException) -> str:
    """One rank's failure in words: an MPI-IO failure as what failed, the reason and where MPI said it
    (``Unable to create file: no such file or directory (MPI_File_open: MPI_ERR_NO_SUCH_FILE)``), not
    HDF5's nesting of MPI's error string."""
    text = str(e)
    m = _MPI_FAILURE.search(text)
    if m:
        return f"{text[:m.start()]}: {m.group(3)} ({m.group(1)}: {m.group(2)}){text[m.end():]}"
    return f"{type(e).__name__}: {text}"


def _write_owned(f: Any, plan: Plan, owned: Owned, opts: IOOptions, collective: bool,
                 written: Optional[Callable[[], None]] = None) -> Optional[str]:
    """Write this rank's boxes; returns this rank's first failure (None: all written).

    A failure does not end the loop: the rank writes nothing more of its own
    but still joins every collective write (with nothing), so no other rank
    is left alone inside MPI-IO; the caller agrees on the failures after
    the loop. ``written``: called after every ``WRITEBACK_EVERY`` bytes this
    rank wrote, and at the end."""
    dxpl = h5io.collective_dxpl() if collective else None
    pending = 0
    error: Optional[str] = None
    for decl in plan.datasets:
        mine = owned.get(decl.path, [])
        dset = f[decl.path]
        if collective and decl.nbytes >= opts.collective_min_bytes:
            for k in range(plan.rounds(decl.path)):
                try:
                    if error is None and k < len(mine):
                        h5io.write_box(dset, mine[k][0], mine[k][1], dxpl)
                    else:
                        h5io.write_none(dset, dxpl)
                except Exception as e:  # noqa: BLE001 - agreed by the caller
                    error = error or f"{decl.path}: {_describe(e)}"
        elif error is None:
            try:
                for box, arr in mine:
                    h5io.write_box(dset, box, arr)
            except Exception as e:  # noqa: BLE001 - agreed by the caller
                error = f"{decl.path}: {_describe(e)}"
        pending += sum(arr.nbytes for _, arr in mine)
        if written is not None and pending >= WRITEBACK_EVERY:
            written()
            pending = 0
    if written is not None and pending:
        written()
    return error


def _release_space(path: str) -> None:
    """Empty a file whose save failed (rank 0, before the close): closing an
    HDF5 file writes its metadata, and on a full file system that fails and
    leaves HDF5's file object in a state that crashes the process when it
    is released (HDF5 1.10, ``H5F__close_cb``). The truncation gives the
    close its room back; the file is deleted after."""
    try:
        os.truncate(path, 0)
    except OSError:
        pass


def _step(comm: Any, errors: List[Optional[str]], work: Callable[[], Optional[str]]) -> List[Optional[str]]:
    """Run ``work`` on every rank if no rank has failed yet, then agree on
    every rank's failure (one allgather), so all ranks take the same next
    step: the next collective of the save, or the way out."""
    if any(errors):
        return errors
    try:
        error = work()
    except Exception as e:  # noqa: BLE001 - agreed below
        error = _describe(e)
    return comm.allgather(error)


def _write_parallel(path: str, plan: Plan, owned: Owned, attrs: Mapping[str, Any], comm: Any,
                    opts: IOOptions) -> List[Optional[str]]:
    """Every rank's failure (all None: the file is complete and closed).

    Each phase's failures are agreed before the next collective phase, so a
    rank that fails (a full disk, an I/O error) never leaves the others in
    a collective it skipped: create the datasets; write the boxes; sum the
    checksums (one Allreduce) and add them as attributes before the flush
    (``MPI_File_sync``, the fsync); close. Checksums are summed after the
    data writes, while the kernel is already writing the dirty pages back
    (a helper thread summing during the writes competes with them for the
    rank's core: docs/benchmarks.md, "Figures behind code and test choices")."""
    f = h5io.open_file(path, "w", comm, opts.access())  # collective; a failure here is every rank's

    def reserve() -> Optional[str]:  # rank 0, for the whole file (see ``space``)
        short = space.reserve(path, space.needed_bytes(plan, opts.alignment)) if comm.Get_rank() == 0 else None
        return f"reserving room for the file failed ({short})" if short else None

    def create() -> None:
        h5io.create_all(f, plan.datasets)
        _write_meta(f, attrs)

    def write() -> Optional[str]:
        # the device writes while later datasets are copied and checksums summed
        return _write_owned(f, plan, owned, opts, collective=True,
                            written=(lambda: h5io.start_writeback(path)) if opts.fsync else None)

    def seal() -> None:
        h5io.write_checksums(f, plan.datasets, sums)
        if opts.fsync:
            f.flush()

    errors = _step(comm, [None], reserve)
    errors = _step(comm, errors, create)
    errors = _step(comm, errors, write)
    if not any(errors):
        sums = compute_checksums(plan, owned, comm)
        errors = _step(comm, errors, seal)
    if any(errors):
        if comm.Get_rank() == 0:
            _release_space(path)
        comm.Barrier()  # emptied before any rank's close writes metadata
    closing = _step(comm, [None], f.close)
    return errors if any(errors) else closing


def _write_serial(path: str, plan: Plan, owned: Owned, attrs: Mapping[str, Any], comm: Any,
                  opts: IOOptions) -> Optional[str]:
    """Rank 0 creates everything (checksums first, so it can write them), then
    the token passes rank to rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sums = compute_checksums(plan, owned, comm)
    error: Optional[str] = None
    if rank > 0:
        error = comm.recv(source=rank - 1, tag=_TOKEN_TAG)  # an earlier rank's failure: write nothing
    mine: Optional[str] = None
    if error is None and (rank == 0 or owned):
        f = None
        try:
            if rank == 0:
                f = h5io.open_file(path, "w", None, opts.access())
                short = space.reserve(path, space.needed_bytes(plan, opts.alignment))
                if short:
                    raise OSError(f"reserving room for the file failed ({short})")
                h5io.create_all(f, plan.datasets, sums)
                _write_meta(f, attrs)
            else:
                f = h5io.open_file(path, "r+", None, opts.access())
            mine = _write_owned(f, plan, owned, opts, collective=False)
        except Exception as e:  # noqa: BLE001 - passed on with the token
            mine = _describe(e)
        if mine is not None:
            _release_space(path)
        try:
            if f is not None:
                f.close()
            if mine is None and opts.fsync:
                h5io.fsync_path(path)
        except Exception as e:  # noqa: BLE001 - passed on with the token
            mine = mine or _describe(e)
    if rank + 1 < size:
        comm.send(error or (f"rank {rank}: {mine}" if mine else None), dest=rank + 1, tag=_TOKEN_TAG)
    return mine


def write_file(path: str, plan: Plan, owned: Owned, attrs: Mapping[str, Any], comm: Any, opts: IOOptions) -> int:
    """Write the checkpoint file ``path`` (collective over ``comm``); returns
    the bytes this rank wrote. Raises CheckpointError on every rank if any
    failed, naming each rank's failure (the caller removes the file)."""
    if opts.parallel:
        try:
            errors = _write_parallel(path, plan, owned, attrs, comm, opts)
        except Exception as e:  # noqa: BLE001 - opening the file: collective, so every rank is here
            errors = comm.allgather(_describe(e))
    else:
        errors = comm.allgather(_write_serial(path, plan, owned, attrs, comm, opts))
    if any(errors):
        raise_failures(path, "writing", errors)
    if comm.Get_rank() == 0:
        space.trim(path)  # the blocks reserved beyond the file's end
    return sum(arr.nbytes for pairs in owned.values() for _, arr in pairs)


def summarize_failures(errors: Sequence[Optional[str]]) -> str:
    """Every rank's failure in one line: the ranks that failed, and each distinct failure once."""
    by_error: Dict[str, List[int]] = {}
    for r, e in enumerate(errors):
        if e:
            by_error.setdefault(e.splitlines()[0], []).append(r)
    parts = [(f"rank {', '.join(map(str, ranks))}" if len(ranks) <= 4
              else f"{len(ranks)} ranks ({', '.join(map(str, ranks[:3]))}, ...)") + f": {e}"
             for e, ranks in list(by_error.items())[:2]]
    more = len(by_error) - 2
    return "; ".join(parts) + (f" (and {more} other failure(s))" if more > 0 else "")


def raise_failures(path: str, what: str, errors: Sequence[Optional[str]]) -> None:
    """One CheckpointError naming every rank's failure (``errors``: one entry per rank, allgathered)."""
    raise CheckpointError(f"checkpoint {path}: {what} failed: {summarize_failures(errors)}")
