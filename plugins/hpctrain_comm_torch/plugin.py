"""Plugin registration for the torch.distributed backend."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from hpctrain import hookimpl
from hpctrain.bootstrap import get_runtime, init_torch_distributed

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.comm.protocol import Communicator
    from hpctrain.mesh import Group

NAMES = ("torch", "gloo", "nccl")


@hookimpl
def hpctrain_capabilities():
    return {"comm.backend": list(NAMES)}


@hookimpl
def hpctrain_make_backend(name: str, group: Group, cfg: Any) -> Optional[Communicator]:
    if name not in NAMES:
        return None
    from hpctrain_comm_torch.communicator import (
        TorchCommunicator,  # torch.distributed: when a group's communicator is made
    )

    rt = get_runtime()
    backend = name if name != "torch" else ("nccl" if rt.device.type == "cuda" else "gloo")
    init_torch_distributed(backend, cfg.comm.timeout_s)
    return TorchCommunicator(group, backend)


@hookimpl
def hpctrain_validate(cfg, world_size):
    uses_nccl = cfg.comm.backend == "nccl" or "nccl" in dict(cfg.comm.per_axis).values()
    if uses_nccl and not torch.cuda.is_available():
        return ["comm.backend=nccl needs CUDA GPUs; use comm.backend=torch (gloo on CPU)"]
    return None
