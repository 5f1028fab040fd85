"""Data-parallel plugin.

Parameters stay replicated over ``dp`` (their ShardSpec says so already, and
the layout-independent init makes replicas identical without a broadcast).
After the last backward of a step, every gradient is averaged over the dp
group: gradients are packed into one flat buffer per dtype, all-reduced
with AVG, and copied back. This is the straightforward version; bucketing
and overlap with backward arrive with the backends issue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from hpctrain import hookimpl
from hpctrain.comm.protocol import ReduceOp
from hpctrain.mesh import Group

STATE_ATTR = "_hpctrain_dp"


@dataclass
class DataParallelState:
    group: Group
    params: List[torch.nn.Parameter]


@hookimpl
def hpctrain_capabilities():
    return {"parallel": ["dp"]}


@hookimpl
def hpctrain_parallelize(model, axis, mesh, cfg):
    if axis != "dp":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    setattr(model, STATE_ATTR, DataParallelState(group=mesh.group("dp"), params=params))
    return model


@torch.no_grad()
def average_gradients(params: List[torch.nn.Parameter], group: Group) -> None:
    """Average ``.grad`` of ``params`` over ``group`` with one all-reduce per dtype."""
    by_dtype = {}
    for p in params:
        if p.grad is None:  # keep all ranks' buffers the same shape
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    comm = group.communicator()
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, ReduceOp.AVG)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])


@hookimpl
def hpctrain_after_backward(model, mesh):
    state = getattr(model, STATE_ATTR, None)
    if state is not None and state.group.size > 1:
        average_gradients(state.params, state.group)
