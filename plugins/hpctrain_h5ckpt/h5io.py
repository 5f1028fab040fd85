"""Thin h5py helpers: open a file (MPI-IO or serial), create datasets, and
read or write one box of a dataset, collectively or independently.

Writes and reads go through h5py's low-level ``DatasetID.read/write`` with an
explicit data-transfer property list. ``MPIO_COLLECTIVE`` on that list is
exactly what ``with dset.collective:`` sets; we build it ourselves because a
collective call must be made by *every* rank, including ranks with nothing
to transfer, and h5py's ``dset[...] = x`` returns early on an empty
selection, which would leave the other ranks waiting inside MPI-IO. Here a
rank with nothing to do joins the call with an empty selection
(``write_none`` / ``read_none``).

Datasets are contiguous (no chunking or filters: parallel HDF5 writes those
fastest and every rank can address its hyperslab directly) and never filled
(``fill_time='never'``: every element is written, so filling first would
write the file twice). ``libver`` starts at v108 so object headers carry
HDF5's own metadata checksums: a flipped byte in the file's structure is
reported by HDF5 instead of being read as garbage.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import h5py
import numpy as np

from hpctrain_h5ckpt.layout import Box, DatasetDecl, box_shape

LIBVER = ("v108", "latest")


def h5py_has_mpi() -> bool:
    """Whether this h5py was built against parallel HDF5 (``driver='mpio'``)."""
    return bool(h5py.get_config().mpi)


@dataclass(frozen=True)
class FileAccess:
    """What goes on a file's access property list (``checkpoint.hdf5.*``, docs/checkpointing.md): 0 or
    empty leaves HDF5's and the MPI library's defaults."""

    alignment: int = 0
    """Bytes: objects of at least this size start at a multiple of it (H5Pset_alignment; files made here)."""
    meta_block_size: int = 0
    """Bytes of file space metadata is allocated in (H5Pset_meta_block_size)."""
    sieve_buf_size: int = 0
    """Bytes of the data-sieving buffer for small raw-data accesses (H5Pset_sieve_buf_size)."""
    mpiio_hints: Tuple[Tuple[str, str], ...] = ()
    """MPI_Info key/value pairs handed to MPI_File_open through H5Pset_fapl_mpio (MPI-IO files only)."""


_LIBVER = {"earliest": h5py.h5f.LIBVER_EARLIEST, "v108": h5py.h5f.LIBVER_V18, "latest": h5py.h5f.LIBVER_LATEST}


def file_access_plist(comm: Any, access: FileAccess, create: bool) -> h5py.h5p.PropFAID:
    """The file-access property list for ``access``: built here rather than by ``h5py.File``'s keywords,
    which cannot set the sieve buffer, and whose MPI-IO info would be the only hint path otherwise."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(_LIBVER[LIBVER[0] if create else "earliest"], _LIBVER[LIBVER[1]])
    if create and access.alignment > 0:
        fapl.set_alignment(access.alignment, access.alignment)
    if access.meta_block_size > 0:
        fapl.set_meta_block_size(access.meta_block_size)
    if access.sieve_buf_size > 0:
        fapl.set_sieve_buf_size(access.sieve_buf_size)
    if comm is not None:
        from mpi4py import MPI  # (with an MPI-IO file only)

        info = MPI.Info.Create()
        try:
            for key, value in access.mpiio_hints:
                info.Set(key, value)
            fapl.set_fapl_mpio(comm, info)  # HDF5 keeps its own copy of the info
        finally:
            info.Free()
    return fapl


def open_file(path: str, mode: str, comm: Any = None, access: FileAccess = FileAccess()) -> h5py.File:
    """Open ``path`` (mode r, r+, w, w- or x); with ``comm`` through MPI-IO (collective over ``comm``),
    with ``access``'s settings on its file-access property list."""
    create = mode in ("w", "w-", "x")
    fapl = file_access_plist(comm, access, create)
    name = os.fsencode(path)
    if mode == "r":
        fid = h5py.h5f.open(name, h5py.h5f.ACC_RDONLY, fapl=fapl)
    elif mode == "r+":
        fid = h5py.h5f.open(name, h5py.h5f.ACC_RDWR, fapl=fapl)
    elif create:
        fid = h5py.h5f.create(name, h5py.h5f.ACC_TRUNC if mode == "w" else h5py.h5f.ACC_EXCL, fapl=fapl)
    else:
        raise ValueError(f"open_file: mode {mode!r} is not one of r, r+, w, w-, x")
    return h5py.File(fid)


def _plists() -> Tuple[Any, Any]:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    return dcpl, lcpl


def _attr(obj: Any, key: str, value: np.ndarray) -> None:
    space = h5py.h5s.create_simple(value.shape) if value.shape else h5py.h5s.create(h5py.h5s.SCALAR)
    h5py.h5a.create(obj, key.encode(), h5py.h5t.py_create(value.dtype), space).write(value)


def create_all(f: h5py.File, decls: Sequence[DatasetDecl], checksums: Optional[np.ndarray] = None) -> None:
    """Create every dataset with its attributes, in order (collective under MPI-IO).
    Without ``checksums`` the checksum attributes are added later (``write_checksums``).

    h5py's low-level calls: with hundreds of small tensors the high-level
    ``create_dataset`` / ``attrs[...]`` wrappers cost more than HDF5 itself.
    String attributes are fixed-length ASCII/UTF-8 (``h5dump`` shows them as text).
    """
    dcpl, lcpl = _plists()
    for i, decl in enumerate(decls):
        dtype = np.dtype(decl.dtype)
        space = h5py.h5s.create_simple(decl.shape) if decl.shape else h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(f.id, decl.path.encode(), h5py.h5t.py_create(dtype, logical=True), space,
                               dcpl=dcpl, lcpl=lcpl)
        for key, value in decl.attrs:
            _attr(dsid, key, np.array(value.encode(), dtype=f"S{max(1, len(value.encode()))}"))
        if checksums is not None:
            _attr(dsid, "checksum", np.asarray(checksums[i], dtype=np.uint32))


def write_checksums(f: h5py.File, decls: Sequence[DatasetDecl], checksums: np.ndarray) -> None:
    """Add the ``checksum`` attribute to every dataset (collective under MPI-IO)."""
    for decl, csum in zip(decls, checksums):
        dsid = h5py.h5d.open(f.id, decl.path.encode())
        _attr(dsid, "checksum", np.asarray(csum, dtype=np.uint32))


def collective_dxpl() -> h5py.h5p.PropDXID:
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    return dxpl


def _spaces(dset: h5py.Dataset, box: Box):
    fspace = dset.id.get_space()
    if not box:  # scalar dataset
        return h5py.h5s.create(h5py.h5s.SCALAR), fspace
    count = box_shape(box)
    fspace.select_hyperslab(tuple(a for a, _ in box), count)
    return h5py.h5s.create_simple(count), fspace


def _none_spaces(dset: h5py.Dataset):
    fspace = dset.id.get_space()
    fspace.select_none()
    mspace = h5py.h5s.create_simple((1,))
    mspace.select_none()
    return mspace, fspace


def write_box(dset: h5py.Dataset, box: Box, arr: np.ndarray, dxpl: Optional[Any] = None) -> None:
    """Write one box; with a collective ``dxpl`` the call is collective, and
    a failure before it still joins it (with nothing), so the other ranks
    are never left inside MPI-IO."""
    try:
        arr = np.require(arr, dtype=dset.dtype, requirements="C")
        if tuple(arr.shape) != box_shape(box):
            raise ValueError(f"{dset.name}: data of shape {arr.shape} for hyperslab {box}")
        mspace, fspace = _spaces(dset, box)
    except Exception:
        if dxpl is not None:
            write_none(dset, dxpl)
        raise
    dset.id.write(mspace, fspace, arr, dxpl=dxpl)


def write_none(dset: h5py.Dataset, dxpl: Any) -> None:
    """Join a collective write with nothing to write."""
    mspace, fspace = _none_spaces(dset)
    dset.id.write(mspace, fspace, np.empty((1,), dtype=dset.dtype), dxpl=dxpl)


def read_box(dset: h5py.Dataset, box: Box, dxpl: Optional[Any] = None, out: Optional[np.ndarray] = None
             ) -> np.ndarray:
    """One box, into ``out`` (C-contiguous, the box's shape) or a new array."""
    if out is None:
        out = np.empty(box_shape(box), dtype=dset.dtype)
    mspace, fspace = _spaces(dset, box)
    dset.id.read(mspace, fspace, out, dxpl=dxpl)
    return out


def read_none(dset: h5py.Dataset, dxpl: Any) -> None:
    """Join a collective read with nothing to read."""
    mspace, fspace = _none_spaces(dset)
    dset.id.read(mspace, fspace, np.empty((1,), dtype=dset.dtype), dxpl=dxpl)


def fsync_path(path: str) -> None:
    """Flush ``path`` (a file or a directory entry) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait


def _libc_sync_file_range() -> Optional[Any]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(path: str) -> None:
    """Ask the kernel to start writing ``path``'s dirty pages to storage now,
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``).

    Written data otherwise sits in the page cache until the final fsync (the
    background flusher starts only at ``vm.dirty_background_ratio``, 10% of
    memory), so the device would idle while the ranks compute checksums and
    then do all the work inside the fsync. Best effort: a no-op where the
    call does not exist (not Linux) or fails; the fsync still guarantees
    durability.
    """
    if _sync_file_range is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # offset 0, length 0: the whole file
    finally:
        os.close(fd)
