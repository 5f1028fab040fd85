"""Global gradient norm and clipping over a sharded model.

A parameter's local gradient covers its own hyperslab (ShardSpec). The sum
of squares is therefore added up over the axes the parameter is split on,
and not over axes where it is replicated (those copies are identical after
the gradient reductions). Parameters are grouped by their split axes so
there is one small all-reduce per distinct set.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.mesh import Mesh
from hpctrain.shard import get_spec


def global_grad_norm(params: Iterable[torch.nn.Parameter], mesh: Mesh) -> torch.Tensor:
    sums: Dict[Tuple[str, ...], torch.Tensor] = {}
    device = None
    for p in params:
        if p.grad is None:
            continue
        device = p.grad.device
        axes = tuple(a for a in get_spec(p).split_axes if mesh.size(a) > 1)
        sq = p.grad.detach().float().pow(2).sum()
        sums[axes] = sums[axes] + sq if axes in sums else sq
    if device is None:
        return torch.zeros(())
    total = torch.zeros((), device=device)
    for axes, s in sorted(sums.items()):
        if axes:
            mesh.group(axes).communicator().all_reduce(s, ReduceOp.SUM)
        total = total + s
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params, mesh: Mesh, max_norm: float) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm`` (0: measure only)."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, mesh)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([p.grad for p in params], scale.to(params[0].grad.device) if params else scale)
    return norm
