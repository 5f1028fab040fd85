"""Column-parallel projections of a sequence-parallel input.

Under sequence parallelism the input of a sub-layer's column-parallel
projections (Q/K/V, gate/up, the output head) is all-gathered from the tp
ranks' sequence shards. Letting autograd save that gathered input would
keep the whole sequence per rank and undo half of what sequence
parallelism saves. ``sequence_parallel_columns`` saves only this rank's
shard and gathers it again in backward (as Megatron-LM does), trading one
more all-gather per sub-layer in backward for 1/tp of the memory.

Forward: all-gather the sequence, one matmul per weight. Backward:
all-gather the sequence again, weight gradients from it, and the input
gradient (summed over the projections in fp32) reduce-scattered back to the
shards. Under autocast the matmuls run in the autocast dtype both ways, as
``F.linear``'s do, and the shard is cast to that dtype before it is gathered
(both ways): the matmuls would cast the gathered input anyway, and a cast
commutes with a gather, so the results are the same bits while the gather
moves 16-bit elements instead of the fp32 residual stream's (Megatron-LM
gathers its bf16 activations too). The saved shard stays the input itself.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.nn.functional as F

from hpctrain.comm.differentiable import all_gather_along, reduce_scatter_along
from hpctrain.mesh import Group
from hpctrain.model import amp

SEQUENCE_DIM = 1


def _wire(x: torch.Tensor, device: str, enabled: bool, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the matmuls will read it: cast to the autocast dtype when autocast is on."""
    return x.to(dtype) if enabled and x.is_floating_point() and x.dtype != dtype else x


class _SequenceParallelColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, *weights: torch.Tensor):
        device = x.device.type
        ctx.group = group
        ctx.autocast = (device, *amp.autocast_state(device))
        ctx.save_for_backward(x, *weights)
        full = all_gather_along(_wire(x, *ctx.autocast), group, SEQUENCE_DIM)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        full = all_gather_along(_wire(x, *ctx.autocast), ctx.group, SEQUENCE_DIM, again=True)  # (not merged with
        # the forward's gather when compiled: that would keep the whole sequence for backward)
        device, enabled, dtype = ctx.autocast
        grad_full = None
        weight_grads: List[Any] = []
        with amp.autocast(device, dtype, enabled):
            for g, w, need in zip(grads, weights, ctx.needs_input_grad[2:]):
                if g is None:
                    weight_grads.append(None)
                    continue
                gx = torch.matmul(g, w).to(x.dtype)
                grad_full = gx if grad_full is None else grad_full + gx
                weight_grads.append(torch.matmul(g.flatten(0, -2).t(), full.flatten(0, -2)).to(w.dtype)
                                    if need else None)
        grad_x = None
        if ctx.needs_input_grad[0] and grad_full is not None:
            grad_x = reduce_scatter_along(grad_full, ctx.group, SEQUENCE_DIM)
        return (grad_x, None, *weight_grads)


def sequence_parallel_columns(x: torch.Tensor, group: Group, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``[F.linear(all_gather(x), w) for w in weights]``, keeping only ``x`` (the shard) for backward."""
    if group.size == 1:
        return [F.linear(x, w) for w in weights]
    return list(_SequenceParallelColumns.apply(x, group, *weights))
