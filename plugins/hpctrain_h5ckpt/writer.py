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

Failures are agreed: every rank's error is gathered after the write, and if
any rank failed all raise the same ``CheckpointError``. (A failure *inside*
a collective MPI-IO call on one rank only cannot be recovered from this
way; HDF5 errors there are normally seen by all ranks alike.)
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from hpctrain_h5ckpt import checksum, h5io
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


def _write_owned(f: Any, plan: Plan, owned: Owned, opts: IOOptions, collective: bool,
                 written: Optional[Callable[[], None]] = None) -> None:
    """Write this rank's boxes. ``written``: called after every
    ``WRITEBACK_EVERY`` bytes this rank wrote, and at the end."""
    dxpl = h5io.collective_dxpl() if collective else None
    pending = 0
    for decl in plan.datasets:
        mine = owned.get(decl.path, [])
        dset = f[decl.path]
        if collective and decl.nbytes >= opts.collective_min_bytes:
            for k in range(plan.rounds(decl.path)):
                if k < len(mine):
                    h5io.write_box(dset, mine[k][0], mine[k][1], dxpl)
                else:
                    h5io.write_none(dset, dxpl)
        else:
            for box, arr in mine:
                h5io.write_box(dset, box, arr)
        pending += sum(arr.nbytes for _, arr in mine)
        if written is not None and pending >= WRITEBACK_EVERY:
            written()
            pending = 0
    if written is not None and pending:
        written()


def _write_parallel(path: str, plan: Plan, owned: Owned, attrs: Mapping[str, Any], comm: Any, opts: IOOptions) -> None:
    """Checksums are summed after the data writes, while the kernel is
    already writing the dirty pages back (a helper thread summing during the
    writes measured slower here: the ranks have one core each), and added as
    attributes before the flush (``MPI_File_sync``, the fsync)."""
    with h5io.open_file(path, "w", comm, opts.alignment) as f:
        h5io.create_all(f, plan.datasets)
        _write_meta(f, attrs)
        # The device writes while later datasets are copied and checksums summed
        _write_owned(f, plan, owned, opts, collective=True,
                     written=(lambda: h5io.start_writeback(path)) if opts.fsync else None)
        h5io.write_checksums(f, plan.datasets, compute_checksums(plan, owned, comm))
        if opts.fsync:
            f.flush()


def _write_serial(path: str, plan: Plan, owned: Owned, attrs: Mapping[str, Any], comm: Any,
                  opts: IOOptions) -> Optional[str]:
    """Rank 0 creates everything (checksums first, so it can write them), then
    the token passes rank to rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sums = compute_checksums(plan, owned, comm)
    error: Optional[str] = None
    if rank > 0:
        comm.recv(source=rank - 1, tag=_TOKEN_TAG)
    try:
        if rank == 0:
            with h5io.open_file(path, "w", None, opts.alignment) as f:
                h5io.create_all(f, plan.datasets, sums)
                _write_meta(f, attrs)
                _write_owned(f, plan, owned, opts, collective=False)
        elif owned:
            with h5io.open_file(path, "r+") as f:
                _write_owned(f, plan, owned, opts, collective=False)
        if opts.fsync and (rank == 0 or owned):
            h5io.fsync_path(path)
    except Exception as e:  # reported after the token has moved on, so no rank waits forever
        error = f"{type(e).__name__}: {e}"
    finally:
        if rank + 1 < size:
            comm.send(None, dest=rank + 1, tag=_TOKEN_TAG)
    return error


def write_file(path: str, plan: Plan, owned: Owned, attrs: Mapping[str, Any], comm: Any, opts: IOOptions) -> int:
    """Write the checkpoint file ``path`` (collective over ``comm``); returns
    the bytes this rank wrote. Raises CheckpointError on every rank if any failed."""
    error: Optional[str] = None
    try:
        if opts.parallel:
            _write_parallel(path, plan, owned, attrs, comm, opts)
        else:
            error = _write_serial(path, plan, owned, attrs, comm, opts)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    errors = comm.allgather(error)
    if any(errors):
        raise_failures(path, "writing", errors)
    return sum(arr.nbytes for pairs in owned.values() for _, arr in pairs)


def raise_failures(path: str, what: str, errors: Sequence[Optional[str]]) -> None:
    """One CheckpointError naming every rank's failure (``errors``: one entry per rank, allgathered)."""
    lines = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    raise CheckpointError(f"checkpoint {path}: {what} failed\n  " + "\n  ".join(lines))
