"""Plugin registration for the MPI backend (``comm.backend=mpi``).

Adds the ``comm.mpi`` config section and the ``comm=mpi`` preset. The
communicator module (and mpi4py's MPI) is imported only when a group asks
for this backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

from hpctrain import hookimpl
from hpctrain.bootstrap import get_runtime

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.comm.protocol import Communicator
    from hpctrain.mesh import Group

NAME = "mpi"
CUDA_AWARE_CHOICES = ("auto", "on", "off")


@dataclass
class MpiConfig:
    """Settings of the MPI backend."""

    check_shapes: bool = False
    """Before each collective, allgather every rank's dtype, sizes and splits and raise a CommError naming the
    ranks that disagree (debugging: one extra small message per call)."""
    cuda_aware: str = "auto"
    """CUDA tensors straight to MPI: auto (ask the MPI library), on, or off (stage through pinned host memory)."""


def options(cfg: Any) -> MpiConfig:
    """``cfg.comm.mpi``, or the defaults when the config was built without this plugin."""
    section = getattr(cfg.comm, "mpi", None) if cfg is not None else None
    if section is None:
        return MpiConfig()
    return MpiConfig(check_shapes=bool(section.check_shapes), cuda_aware=str(section.cuda_aware))


@hookimpl
def hpctrain_capabilities():
    return {"comm.backend": [NAME]}


@hookimpl
def hpctrain_config_sections():
    return {"comm.mpi": MpiConfig}


@hookimpl
def hpctrain_register_configs(config_store):
    config_store.store(group="comm", name=NAME, node={"backend": NAME})


@hookimpl
def hpctrain_make_backend(name: str, group: Group, cfg: Any) -> Optional[Communicator]:
    if name != NAME:
        return None

    from hpctrain_comm_mpi.buffers import detect_cuda_aware  # MPI starts at import: after bootstrap only
    from hpctrain_comm_mpi.communicator import MpiCommunicator  # MPI starts at import: after bootstrap only

    opts = options(cfg)
    return MpiCommunicator(group, get_runtime().mpi_comm, check_shapes=opts.check_shapes,
                           cuda_aware=detect_cuda_aware(opts.cuda_aware))


@hookimpl
def hpctrain_validate(cfg, world_size) -> Optional[List[str]]:
    opts = options(cfg)
    if opts.cuda_aware not in CUDA_AWARE_CHOICES:
        return [f"comm.mpi.cuda_aware={opts.cuda_aware!r} must be one of {', '.join(CUDA_AWARE_CHOICES)}"]
    return None
