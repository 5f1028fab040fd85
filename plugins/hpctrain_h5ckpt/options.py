"""The plugin's config section (``checkpoint.hdf5.*``) and the resolved I/O options.

The user-facing switches common to any format live in the core's
``checkpoint`` section (``every``, ``keep``, ``resume``, ``dir`` and
``async_save``: the issue's ``checkpoint.async``, renamed because ``async``
is a Python keyword and cannot be a dataclass field). What only this format
needs lives here.

``collective_min_mb`` defaults to 64 MiB: every collective ``H5Dwrite``
pays a synchronisation of the ranks, which smaller datasets do not repay
(measured on local disk: docs/checkpointing.md, "Collective I/O"); on a
parallel file system with many writers per file, where aggregation pays,
lower it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from hpctrain.log import get_logger

from hpctrain_h5ckpt.h5io import FileAccess, h5py_has_mpi

DRIVERS = ("auto", "mpio", "serial")
STAGING_MODES = ("overlap", "blocking")

log = get_logger(__name__)
_warned = {"serial": False}


@dataclass
class H5Config:
    """HDF5 checkpoint format (``checkpoint.format=hdf5``)."""

    driver: str = "auto"
    """auto (MPI-IO when h5py has MPI support, else serial with a warning), mpio, or serial (ranks write one
    file in turn)."""
    collective_min_mb: float = 64.0
    """Datasets of at least this size use collective MPI-IO; smaller ones are written independently by their
    owner (0: all collective)."""
    alignment: int = 0
    """Bytes: datasets of at least this size start at a multiple of it (H5Pset_alignment, threshold = alignment;
    set the Lustre stripe size or the GPFS block size, e.g. 1048576); 0: off (HDF5 packs objects end to end)."""
    fsync: bool = True
    """fsync the file and directory before the checkpoint counts as committed."""
    verify: bool = True
    """Check every dataset's checksum while loading."""
    staging: str = "overlap"
    """With checkpoint.async_save: overlap (copy to host during the next forward/backward; the trainer waits
    before the optimizer step) or blocking (copy inside save()); see hpctrain_h5ckpt.staging."""
    meta_block_size: int = 0
    """Bytes of file space HDF5 allocates metadata in (H5Pset_meta_block_size): a checkpoint's hundreds of
    object headers and attributes then share a few blocks instead of scattering small writes between the
    tensors; 0: HDF5's default (2 KiB). On Lustre/GPFS: 1 MiB or the stripe size (docs/checkpointing.md)."""
    sieve_buf_size: int = 0
    """Bytes of HDF5's data-sieving buffer for small raw-data reads and writes (H5Pset_sieve_buf_size); 0:
    HDF5's default (64 KiB). Larger turns the small independent writes below collective_min_mb into fewer,
    larger file-system requests."""
    mpiio_hints: Dict[str, Any] = field(default_factory=dict)
    """MPI-IO hints passed to MPI_File_open through the file-access property list (MPI-IO files only): any of
    cb_nodes, cb_buffer_size, cb_config_list, romio_cb_write, romio_cb_read, romio_ds_write, romio_ds_read
    (collective buffering and data sieving), striping_factor, striping_unit (Lustre: the new file's stripe
    count and size in bytes); e.g. +checkpoint.hdf5.mpiio_hints.cb_nodes=8 on the command line. {}: the
    MPI library's defaults. A library ignores hints it does not know (Open MPI's own OMPIO reads fewer than
    ROMIO): docs/checkpointing.md."""


@dataclass(frozen=True)
class IOOptions:
    parallel: bool
    """True: one collective MPI-IO file; False: ranks take turns with the default driver."""
    collective_min_bytes: int
    alignment: int
    fsync: bool
    verify: bool
    meta_block_size: int = 0
    sieve_buf_size: int = 0
    mpiio_hints: Tuple[Tuple[str, str], ...] = ()

    def access(self) -> FileAccess:
        """What the files' access property lists get (``h5io.open_file``)."""
        return FileAccess(self.alignment, self.meta_block_size, self.sieve_buf_size, self.mpiio_hints)


SIZE_HINTS = ("cb_nodes", "cb_buffer_size", "striping_factor", "striping_unit")
"""MPI-IO hints whose value is a positive integer."""
SWITCH_HINTS = ("romio_cb_write", "romio_cb_read", "romio_ds_write", "romio_ds_read")
"""ROMIO's switches: enable, disable or automatic."""
MPIIO_HINTS = SIZE_HINTS + ("cb_config_list",) + SWITCH_HINTS
"""The hints ``checkpoint.hdf5.mpiio_hints`` takes (the MPI standard's reserved ones and ROMIO's, as
ROMIO's users guide names them)."""


def hint_problems(hints: Any) -> List[str]:
    out = []
    for key, value in dict(hints or {}).items():
        where = f"checkpoint.hdf5.mpiio_hints.{key}={value!r}"
        if key not in MPIIO_HINTS:
            out.append(f"{where}: not an MPI-IO hint hpctrain passes; use one of {', '.join(MPIIO_HINTS)}")
        elif key in SIZE_HINTS and not (str(value).isdigit() and int(value) > 0):
            unit = "bytes" if key in ("cb_buffer_size", "striping_unit") else "a count"
            out.append(f"{where}: must be a positive integer ({unit})")
        elif key in SWITCH_HINTS and str(value) not in ("enable", "disable", "automatic"):
            out.append(f"{where}: must be enable, disable or automatic")
    return out


def problems(h5: Any) -> List[str]:
    out = []
    if h5.driver not in DRIVERS:
        out.append(f"checkpoint.hdf5.driver={h5.driver!r} is not one of {', '.join(DRIVERS)}")
    elif h5.driver == "mpio" and not h5py_has_mpi():
        out.append("checkpoint.hdf5.driver=mpio but this h5py has no MPI support; rebuild h5py against "
                   "parallel HDF5 (scripts/setup.sh) or use checkpoint.hdf5.driver=auto")
    if h5.staging not in STAGING_MODES:
        out.append(f"checkpoint.hdf5.staging={h5.staging!r} is not one of {', '.join(STAGING_MODES)}")
    if h5.collective_min_mb < 0:
        out.append(f"checkpoint.hdf5.collective_min_mb={h5.collective_min_mb} must be >= 0")
    for key in ("alignment", "meta_block_size", "sieve_buf_size"):
        if getattr(h5, key) < 0:
            out.append(f"checkpoint.hdf5.{key}={getattr(h5, key)} must be >= 0 (bytes; 0: HDF5's default)")
    return out + hint_problems(h5.mpiio_hints)


def resolve(h5: Any, rank: int = 0) -> IOOptions:
    """IOOptions from the config section; rank 0 warns once when falling back to serial."""
    parallel = h5.driver == "mpio" or (h5.driver == "auto" and h5py_has_mpi())
    if h5.driver == "auto" and not parallel and not _warned["serial"] and rank == 0:
        _warned["serial"] = True
        log.warning("h5py has no MPI support: checkpoints are written by one rank at a time into one file "
                    "(correct, but serial); install an MPI-enabled h5py for parallel I/O")
    return IOOptions(
        parallel=parallel,
        collective_min_bytes=int(h5.collective_min_mb * (1 << 20)),
        alignment=int(h5.alignment),
        fsync=bool(h5.fsync),
        verify=bool(h5.verify),
        meta_block_size=int(h5.meta_block_size),
        sieve_buf_size=int(h5.sieve_buf_size),
        mpiio_hints=tuple(sorted((str(k), str(v)) for k, v in dict(h5.mpiio_hints or {}).items())),
    )
