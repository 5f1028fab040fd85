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

from dataclasses import dataclass
from typing import Any, List

from hpctrain.log import get_logger

from hpctrain_h5ckpt.h5io import h5py_has_mpi

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
    alignment_kb: int = 0
    """Align datasets of at least this size to multiples of it (set to the Lustre/GPFS stripe size); 0 = off."""
    fsync: bool = True
    """fsync the file and directory before the checkpoint counts as committed."""
    verify: bool = True
    """Check every dataset's checksum while loading."""
    staging: str = "overlap"
    """With checkpoint.async_save: overlap (copy to host during the next forward/backward; the trainer waits
    before the optimizer step) or blocking (copy inside save()); see hpctrain_h5ckpt.staging."""


@dataclass(frozen=True)
class IOOptions:
    parallel: bool
    """True: one collective MPI-IO file; False: ranks take turns with the default driver."""
    collective_min_bytes: int
    alignment: int
    fsync: bool
    verify: bool


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
    if h5.alignment_kb < 0:
        out.append(f"checkpoint.hdf5.alignment_kb={h5.alignment_kb} must be >= 0")
    return out


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
        alignment=int(h5.alignment_kb) * 1024,
        fsync=bool(h5.fsync),
        verify=bool(h5.verify),
    )
