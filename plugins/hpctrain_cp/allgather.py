"""All-gather context parallelism (Llama 3's): every layer all-gathers the
keys and values over the cp ranks, and each rank attends with its own
queries; the key/value gradients are reduce-scattered back.

The gathered keys are in cp-rank order, each rank's chunks in its layout
(zigzag). Attention runs chunk pair by chunk pair (``blocks``: a query
chunk sees earlier key chunks fully, its own causally, later ones not at
all, so no masked work is done), merged by log-sum-exp; backward recomputes
each pair from the saved output and log-sum-exp, then reduce-scatters
dK/dV so each rank gets the sum of every rank's gradient for its own keys.

Document masking (``forward(q, k, v, segments)``): the segment ids are
all-gathered with the keys and values (one more all-gather of a few bytes
per token; rank order, like the keys) and saved for backward with them;
each pair is masked by causality AND segment equality, and a pair whose
chunks share no document is not computed (``blocks.plan_pairs``).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import nn

from hpctrain.comm.differentiable import all_gather_along, reduce_scatter_along
from hpctrain.data.sequence import SequenceLayout
from hpctrain.mesh import Group

from hpctrain_cp.blocks import (
    block_backward,
    block_forward,
    expand_kv,
    filled,
    merge,
    pack_kv,
    pair_kind,
    plan_pairs,
    reduce_kv,
    unpack_kv,
)


def _pairs(layout: SequenceLayout, rank: int):
    """(local query chunk index, gathered key chunk index, causal) for every pair with work."""
    mine = layout.chunks[rank]
    everyone = [c for r in range(len(layout.chunks)) for c in layout.chunks[r]]
    for i, a in enumerate(mine):
        for j, b in enumerate(everyone):
            kind = pair_kind(a, b)
            if kind is not None:
                yield i, j, kind == "causal"


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, layout: SequenceLayout, scale: float,
                segments: Optional[torch.Tensor] = None):
        rank, heads = group.rank, q.shape[1]
        c = q.shape[2] // len(layout.chunks[rank])
        # (b, kv_heads, T, dk + dv), rank order: joined on the head dim, as value heads may be narrower (MLA)
        kv = all_gather_along(pack_kv(k, v), group, dim=2)
        every = None if segments is None else all_gather_along(segments, group, dim=1)  # (b, T), rank order
        kx, vx = (expand_kv(t.float(), heads) for t in unpack_kv(kv, k.shape[-1]))
        q32 = q.float()
        outs: List[Optional[torch.Tensor]] = [None] * len(layout.chunks[rank])
        lses: List[Optional[torch.Tensor]] = [None] * len(layout.chunks[rank])
        for i, j, causal, mask in plan_pairs(_pairs(layout, rank), segments, every, c):
            o, o_lse = block_forward(q32[:, :, i * c:(i + 1) * c], kx[:, :, j * c:(j + 1) * c],
                                     vx[:, :, j * c:(j + 1) * c], scale, causal, mask)
            outs[i], lses[i] = merge(outs[i], lses[i], o, o_lse)
        out, lse = torch.cat(filled(outs), dim=2), torch.cat(filled(lses), dim=2)
        ctx.save_for_backward(q, kv, out, lse, segments, every)
        ctx.group, ctx.layout, ctx.scale, ctx.kv_heads, ctx.dk = group, layout, scale, k.shape[1], k.shape[-1]
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, segments, every = ctx.saved_tensors
        group, layout, scale = ctx.group, ctx.layout, ctx.scale
        rank, heads = group.rank, q.shape[1]
        c = q.shape[2] // len(layout.chunks[rank])
        kx, vx = (expand_kv(t.float(), heads) for t in unpack_kv(kv, ctx.dk))
        q32, dout32 = q.float(), dout.float()
        delta = (dout32 * out).sum(dim=-1)
        dq, dk, dv = torch.zeros_like(q32), torch.zeros_like(kx), torch.zeros_like(vx)
        for i, j, causal, mask in plan_pairs(_pairs(layout, rank), segments, every, c):
            qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
            g_q, g_k, g_v = block_backward(q32[:, :, qs], kx[:, :, ks], vx[:, :, ks], scale, causal, lse[:, :, qs],
                                           dout32[:, :, qs], delta[:, :, qs], out[:, :, qs], mask)
            dq[:, :, qs] += g_q
            dk[:, :, ks] += g_k
            dv[:, :, ks] += g_v
        dkv = pack_kv(reduce_kv(dk, ctx.kv_heads), reduce_kv(dv, ctx.kv_heads))
        mine = reduce_scatter_along(dkv, group, dim=2)  # every rank's gradient for this rank's keys, summed
        d_k, d_v = unpack_kv(mine, ctx.dk)
        return dq.to(q.dtype), d_k.to(kv.dtype), d_v.to(kv.dtype), None, None, None, None


class AllGatherAttention(nn.Module):
    """Core attention (``forward(q, k, v, segments=None)``, (batch, heads,
    tokens, head_dim), causal) over a sequence split across ``group`` as
    ``layout`` says, keys and values all-gathered per call; grouped-query
    attention when k/v have fewer heads; ``segments`` (batch, tokens), this
    rank's tokens' document ids: document masking."""

    def __init__(self, group: Group, layout: SequenceLayout):
        super().__init__()
        self.group, self.layout = group, layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _AllGatherAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.group, self.layout,
                                         1.0 / math.sqrt(q.shape[-1]),
                                         None if segments is None else segments.contiguous())
