"""Hook implementations of the HDF5 checkpoint format.

The checkpointer gets its own duplicate of the world communicator, made
here: creating it is collective, and the trainer builds its checkpointer at
the same point on every rank.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from hpctrain import hookimpl
from hpctrain.bootstrap import get_runtime
from hpctrain.log import get_logger
from hpctrain.lustre import stripe_directory
from hpctrain.train.faults import FaultInjector

from hpctrain_h5ckpt import options, store

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.checkpoint import Checkpointer
    from hpctrain.mesh import Mesh

FORMAT = "hdf5"
log = get_logger(__name__)


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"checkpoint.format": [FORMAT]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"checkpoint.hdf5": options.H5Config}


def checkpoint_dir(cfg: Any, run_dir: Optional[str]) -> Optional[str]:
    """``checkpoint.dir``, else ``<run dir>/checkpoints``."""
    if cfg.checkpoint.dir:
        return str(cfg.checkpoint.dir)
    return os.path.join(run_dir, "checkpoints") if run_dir else None


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int, run_dir: Optional[str]) -> Optional[List[str]]:
    from hpctrain_h5ckpt.weights import init_from_problems  # h5py: when a run validates, not when the plugin loads

    ck = cfg.checkpoint
    given = init_from_problems(cfg)  # weights from one of our checkpoints, whatever this run saves
    # a run that may only save when stopped (save_on_stop) is checked too: found now, not at the stop
    if ck.format != FORMAT or not (ck.every or ck.resume or ck.get("save_on_stop", False)):
        return given or None
    out = given + options.problems(ck.hdf5)
    if ck.keep < 0:
        out.append(f"checkpoint.keep={ck.keep} must be >= 0 (0 keeps every checkpoint)")
    if ck.every < 0:
        out.append(f"checkpoint.every={ck.every} must be >= 0")
    if checkpoint_dir(cfg, run_dir) is None and (ck.every or ck.resume == "auto"):
        out.append("checkpoint.dir is not set and the run has no run directory; set checkpoint.dir=PATH")
    if not ck.resume:
        out += another_runs_checkpoints(checkpoint_dir(cfg, run_dir))
    return out or None


def another_runs_checkpoints(directory: Optional[str]) -> List[str]:
    """A run starting afresh that may save is refused a directory that already holds committed checkpoints:
    saved beside them, its files and the other run's would mix (``checkpoint.keep`` prunes by step, so one
    run's files go for the other's, and ``resume=auto`` continues whichever reached the higher step)."""
    found = store.committed(directory) if directory else []
    if not found:
        return []
    return [f"checkpoint.dir {os.path.abspath(str(directory))} already holds checkpoints of another run (newest "
            f"{os.path.basename(found[0])}) and this run starts afresh (checkpoint.resume is not set): its saves "
            "would mix with them, and checkpoint.resume=auto would then continue whichever run reached the higher "
            "step; continue that run with checkpoint.resume=auto, or give this one its own checkpoint.dir"]


@hookimpl
def hpctrain_make_checkpointer(name: str, mesh: Optional[Mesh], cfg: Any,
                               run_dir: Optional[str]) -> Optional[Checkpointer]:
    if name != FORMAT:
        return None
    # h5py: when a checkpointer is made, not when the plugin loads
    from hpctrain_h5ckpt.checkpointer import H5Checkpointer

    ck = cfg.checkpoint
    comm = get_runtime().mpi_comm.Dup()  # collective; keeps checkpoint traffic off the world communicator
    # a run that saves periodically or resumes locks its directory at once; one that
    # may only save when stopped, at that save; one that never saves reads without a lock
    read_only = not (ck.every or ck.get("save_on_stop", False))
    directory = checkpoint_dir(cfg, run_dir)
    lustre = ck.get("lustre")
    if directory and lustre is not None and not read_only and comm.Get_rank() == 0:
        said = stripe_directory(directory, lustre)  # before the first file is made in it
        if said:
            log.info("%s", said)
    made = H5Checkpointer(comm, options.resolve(ck.hdf5, comm.Get_rank()), directory, int(ck.keep),
                          bool(ck.async_save), str(ck.hdf5.staging), lock_now=bool(ck.every or ck.resume),
                          run_dir=run_dir, read_only=read_only)
    debug = cfg.get("debug")
    if debug is not None and debug.get("fault") == "save_error":  # (the core's fault injection, for tests)
        faults = FaultInjector(debug, comm.Get_rank())
        made.inject = lambda step: faults.save_error(step, "persistent")
    return made


@hookimpl
def hpctrain_weight_source(path: str, cfg: Any) -> Optional[Any]:
    """``checkpoint.init_from`` naming one of our checkpoints (a file or a checkpoint directory)."""
    from hpctrain_h5ckpt.weights import H5Weights, resolve  # h5py: when weights are read, not when the plugin loads

    found = resolve(path)
    return H5Weights(found) if found is not None else None
