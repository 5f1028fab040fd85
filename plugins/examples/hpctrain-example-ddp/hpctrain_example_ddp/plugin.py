"""The data axes with torch's ``DistributedDataParallel`` (``parallel.impl.dp=torch-ddp``).

Written only against hpctrain's public core API; see README.md for how it
fits the composition: the handle wraps the real model in DDP over the data
group, keeps DDP's sync off through the step's backwards, and reduces once,
after the last backward.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpctrain import hookimpl
from hpctrain.bootstrap import init_torch_distributed
from hpctrain.mesh import Mesh
from hpctrain.model.transformer import Transformer
from hpctrain.parallel.handles import DataHandle

NAME = "torch-ddp"


def _wrap_parts(model: nn.Module, wrap) -> nn.Module:
    """``model`` with every part of the core's model it runs wrapped (``wrap(part)``):
    the model itself when it is one ``Transformer``, else each ``Transformer``
    inside it, in place (an interleaved pipeline rank runs several)."""
    if isinstance(model, Transformer):
        return wrap(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Transformer):
                parent._modules[name] = wrap(child)
    return model


class TorchDDP(DataHandle):
    """The data axes' handle: DDP over the data group (README.md)."""

    def __init__(self, model: nn.Module, mesh: Mesh, bucket_mb: float):
        super().__init__(model)
        self.mesh, self.bucket_mb = mesh, bucket_mb
        self.wrappers: List[DistributedDataParallel] = []

    def after_materialize(self) -> None:
        device = next(self.model.parameters()).device
        init_torch_distributed("nccl" if device.type == "cuda" else "gloo")
        axes = self.mesh.reduction_axes(())  # the data axes of size > 1: every dense weight is averaged over them
        mine = None
        for ranks in self.mesh.partition(axes):  # every rank makes every group, in the same order
            group = dist.new_group(list(ranks))
            if self.mesh.world_rank in ranks:
                mine = group

        def wrap(part: nn.Module) -> DistributedDataParallel:
            ddp = DistributedDataParallel(part, process_group=mine, bucket_cap_mb=self.bucket_mb,
                                          broadcast_buffers=False)
            ddp.require_backward_grad_sync = False  # the step's backwards accumulate; reduce_gradients syncs
            self.wrappers.append(ddp)
            return ddp

        self.model = _wrap_parts(self.model, wrap)

    def reduce_gradients(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for ddp in self.wrappers:
            ddp.reducer.prepare_for_backward([])  # arm DDP's buckets, as a synced forward would
        # one backward of a zero through every parameter: each one's gradient hook fires, its
        # accumulated gradient goes into DDP's buckets, and DDP writes back the group's average
        torch.autograd.backward(torch.stack([(p * 0).sum() for p in params]).sum())


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["dp"]}


@hookimpl
def hpctrain_claim_axis(cfg: Any) -> Optional[bool]:
    return False  # only when chosen: parallel.impl.dp=torch-ddp


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> Optional[List[str]]:
    if OmegaConf.select(cfg, "parallel.impl.dp", default=None) == NAME and cfg.model.ffn != "swiglu":
        return [f"parallel.impl.dp={NAME} averages every gradient over the whole data group, but "
                f"model.ffn={cfg.model.ffn} may hold weights averaged over fewer ranks (experts): use the "
                "built-in data parallelism (leave parallel.impl.dp unset)"]
    return None


@hookimpl
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any) -> Optional[TorchDDP]:
    return TorchDDP(model, mesh, float(cfg.comm.bucket_mb))
