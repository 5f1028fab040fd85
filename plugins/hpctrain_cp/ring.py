"""Ring attention: each rank keeps its queries; the key/value chunks travel
around the cp ring.

Forward, step s = 0 .. cp-1: the rank holds the keys and values of rank
``r - s`` (its own at s = 0). It posts the non-blocking hand-over of that
block to rank ``r + 1`` (and the receive of the next one from ``r - 1``)
*before* computing with it, so the exchange overlaps the block's
attention; it then merges the block's partial outputs into its running
output with the online softmax (``blocks.merge``, fp32 log-sum-exp).

Backward sends the key/value gradients around the ring with their block:
at step s the rank computes its queries' contribution to block ``r - s``'s
dK/dV, adds it to the accumulator that arrived with the block, and passes
both on; after cp hand-overs every accumulator is back with its owner. Only
this rank's own q, k, v, its output and log-sum-exp are saved for
backward, so saved attention activations fall as 1/cp.

Which chunks of the sequence a rank holds is the core's
``hpctrain.data.sequence.SequenceLayout``: the zigzag (rank i holds chunks i
and 2cp-1-i, the training layout) or, for the benchmark's comparison,
contiguous (rank i holds chunks 2i and 2i+1).
Chunk pairs that causality masks out entirely are skipped, so the layout
decides each rank's work.

Document masking (``forward(q, k, v, segments)``): each key/value block's
segment ids travel with it, in the same batch of non-blocking sends and
receives (forward and backward: the backward's blocks travel again, so
only this rank's own segment ids are saved and saved activations still
fall as 1/cp). Each pair is masked by causality AND segment equality
(``blocks.plan_pairs``); a pair whose chunks share no document is not
computed, which changes no message, so the ranks stay in lock-step, and
only removes work, so no rank does more than the balanced zigzag share.

Compiled (``trainer.compile``: dynamo traces this Function), each hand-over
is the core's ``ring_shift`` (a custom operator, ``hpctrain.comm.ops``)
instead of the non-blocking sends and receives, so the block stays one
graph; the exchange then no longer overlaps the block's attention, and the
compute clock (the benchmark's) is not read.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hpctrain.comm.differentiable import ring_shift
from hpctrain.comm.protocol import P2POp
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

TAG_KV, TAG_DKV, TAG_SEG = 31, 32, 33


@dataclass
class ComputeTime:
    """CPU seconds this rank's thread spent in attention arithmetic (not in
    waits), summed over calls: each rank's share of the work, however the
    ranks share cores (the benchmark's balance table)."""

    forward: float = 0.0
    backward: float = 0.0


def _shift(group: Group, send: torch.Tensor, tag: int,
           segments: Optional[torch.Tensor] = None) -> Tuple[Any, List[Any]]:
    """Post sending ``send`` to the next rank and receiving the same shape from
    the previous one. With ``segments`` (the block's segment ids), they travel
    in the same batch and the received pair ``(block, segments)`` comes back.
    Compiled, the exchange is ``ring_shift`` (blocking; no works to wait for)."""
    if torch.compiler.is_compiling():
        moved = ring_shift(send, group)
        return (moved if segments is None else (moved, ring_shift(segments, group))), []
    comm, rank, size = group.communicator(), group.rank, group.size
    recv = torch.empty_like(send)
    ops = [P2POp("send", send, (rank + 1) % size, tag), P2POp("recv", recv, (rank - 1) % size, tag)]
    if segments is None:
        return recv, comm.batch_isend_irecv(ops)
    seg = torch.empty_like(segments)
    ops += [P2POp("send", segments, (rank + 1) % size, TAG_SEG), P2POp("recv", seg, (rank - 1) % size, TAG_SEG)]
    return (recv, seg), comm.batch_isend_irecv(ops)


def _pairs(mine: Sequence[int], theirs: Sequence[int]):
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            kind = pair_kind(a, b)
            if kind is not None:
                yield i, j, kind == "causal"


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, layout: SequenceLayout, scale: float, clock: Optional[ComputeTime],
                segments: Optional[torch.Tensor] = None):
        rank, n = group.rank, group.size
        heads, c = q.shape[1], q.shape[2] // len(layout.chunks[rank])
        q32 = q.float()
        mine = layout.chunks[rank]
        outs: List[Optional[torch.Tensor]] = [None] * len(mine)
        lses: List[Optional[torch.Tensor]] = [None] * len(mine)
        dk = k.shape[-1]
        block = pack_kv(k, v)  # (value heads may be narrower than key heads: latent attention)
        seg = segments  # the segment ids of the block held now
        for step in range(n):
            src = (rank - step) % n
            nxt, works = _shift(group, block, TAG_KV, seg) if step < n - 1 else (None, [])
            t0 = time.thread_time() if clock is not None else 0.0
            kx, vx = (expand_kv(t.float(), heads) for t in unpack_kv(block, dk))
            for i, j, causal, mask in plan_pairs(_pairs(mine, layout.chunks[src]), segments, seg, c):
                o, o_lse = block_forward(q32[:, :, i * c:(i + 1) * c], kx[:, :, j * c:(j + 1) * c],
                                         vx[:, :, j * c:(j + 1) * c], scale, causal, mask)
                outs[i], lses[i] = merge(outs[i], lses[i], o, o_lse)
            if clock is not None:
                clock.forward += time.thread_time() - t0
            for w in works:
                w.wait()
            if nxt is not None:
                block, seg = nxt if segments is not None else (nxt, None)
        out, lse = torch.cat(filled(outs), dim=2), torch.cat(filled(lses), dim=2)
        ctx.save_for_backward(q, k, v, out, lse, segments)
        ctx.group, ctx.layout, ctx.scale, ctx.clock = group, layout, scale, clock
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, segments = ctx.saved_tensors
        group, layout, scale = ctx.group, ctx.layout, ctx.scale
        rank, n = group.rank, group.size
        heads, kv_heads, c = q.shape[1], k.shape[1], q.shape[2] // len(layout.chunks[rank])
        mine = layout.chunks[rank]
        q32, dout32 = q.float(), dout.float()
        delta = (dout32 * out).sum(dim=-1)
        dq = torch.zeros_like(q32)
        d_key = k.shape[-1]
        block = pack_kv(k, v)
        seg = segments
        dblock = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
        for step in range(n):
            src = (rank - step) % n
            nxt, kv_works = _shift(group, block, TAG_KV, seg) if step < n - 1 else (None, [])
            t0 = time.thread_time() if ctx.clock is not None else 0.0
            kx, vx = (expand_kv(t.float(), heads) for t in unpack_kv(block, d_key))
            dk = torch.zeros_like(kx)
            dv = torch.zeros_like(vx)
            for i, j, causal, mask in plan_pairs(_pairs(mine, layout.chunks[src]), segments, seg, c):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                g_q, g_k, g_v = block_backward(q32[:, :, qs], kx[:, :, ks], vx[:, :, ks], scale, causal,
                                               lse[:, :, qs], dout32[:, :, qs], delta[:, :, qs], out[:, :, qs], mask)
                dq[:, :, qs] += g_q
                dk[:, :, ks] += g_k
                dv[:, :, ks] += g_v
            dblock += pack_kv(reduce_kv(dk, kv_heads), reduce_kv(dv, kv_heads))
            if ctx.clock is not None:
                ctx.clock.backward += time.thread_time() - t0
            dblock, works = _shift(group, dblock, TAG_DKV)  # the gradient travels with its block
            for w in works + kv_works:
                w.wait()
            if nxt is not None:
                block, seg = nxt if segments is not None else (nxt, None)
        d_k, d_v = unpack_kv(dblock, d_key)
        return dq.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None, None, None, None


class RingAttention(nn.Module):
    """Core attention (``forward(q, k, v, segments=None)``, shapes (batch,
    heads, tokens, head_dim), causal) over a sequence split across ``group``
    as ``layout`` says; grouped-query attention when k/v have fewer heads;
    ``segments`` (batch, tokens), this rank's tokens' document ids: document
    masking. ``clock`` (optional) accumulates this rank's compute time."""

    def __init__(self, group: Group, layout: SequenceLayout, clock: Optional[ComputeTime] = None):
        super().__init__()
        self.group, self.layout, self.clock = group, layout, clock

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.group, self.layout,
                                    1.0 / math.sqrt(q.shape[-1]), self.clock,
                                    None if segments is None else segments.contiguous())
