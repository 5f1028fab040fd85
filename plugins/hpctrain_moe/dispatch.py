"""Moving tokens to their experts and back: all-to-all with uneven splits.

Rank r of the ep group holds experts ``[r * E/ep, (r + 1) * E/ep)``. Per
micro-batch and MoE block:

1. ``plan_dispatch``: the kept (token, expert) assignments are sorted by
   expert (stable), so the rows for each destination rank are contiguous;
   one small all-to-all of the per-expert counts tells every rank how many
   rows it gets from each source for each of its experts (the splits of the
   next two exchanges, so no rank ever waits on a shape it does not know).
2. ``dispatch``: the rows go out in one uneven all-to-all (counts may be 0:
   a rank that receives nothing works, with empty tensors). They arrive
   source-major: from each source, its rows for each local expert.
3. the local experts run on those runs (``DispatchPlan.segments``) where
   they lie, so the rows are never regrouped by expert (two copies of
   every row saved).
4. ``combine``: the results go back through the reverse all-to-all in the
   same order, and are summed into their tokens with the router weights.

Both exchanges are ``all_to_all`` from the core's differentiable
collectives: backward sends the gradients the opposite way. With ep = 1
the same code runs without the exchanges: that is the one-process model.

Costs on the token path (docs/benchmarks.md, "hpctrain-bench moe"): one
stable sort of the assignments gives both the send order and each row's
token; the rows to send are gathered with one ``index_select`` into a
buffer kept per shape (the exchange copies it out before returning, and
nothing saves it for backward, so it is reused from call to call instead
of being new, cold memory every time); the combine is one autograd
Function (``_Combine``) summing in place, whose backward gathers each
row's token gradient once for both gradients.

Under ``trainer.compile`` the plan, the dispatch and the combine are eager
islands (``hpctrain.eager``): their shapes follow the routing and the send
buffer is reused across calls, nothing a graph should capture; the router
and the experts' matrix products stay in the block's compiled graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from hpctrain.comm.differentiable import all_to_all
from hpctrain.eager import eager
from hpctrain.mesh import Group


@dataclass
class DispatchPlan:
    token: torch.Tensor
    """(A,) the source token of each row sent, rows grouped by expert in ascending order."""
    weight: torch.Tensor
    """(A,) each row's router weight (fp32, differentiable)."""
    send_splits: List[int]
    """Rows sent to each ep rank."""
    recv_splits: List[int]
    """Rows received from each ep rank."""
    segments: List[Tuple[int, int]]
    """The received rows as consecutive runs of (local expert, rows): source-major,
    then by expert (one run per expert when ep = 1). Runs may be empty."""
    exchange: bool = False
    """Whether rows cross ranks (ep > 1)."""


@eager
def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int,
                  group: Optional[Group]) -> DispatchPlan:
    """The plan for (N, k) ``experts`` and ``weights``, ``keep`` (N, k) the
    assignments within capacity (None: all). Collective over ``group`` (the
    ep group; None or size 1: no exchange)."""
    n, k = experts.shape
    slot = torch.arange(n * k, device=experts.device)  # flat (token, choice) index
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    if keep is not None:
        slot = slot[keep.reshape(-1)]
        flat_e = flat_e[slot]
    order = torch.argsort(flat_e, stable=True)  # the one sort: rows by expert, then by token
    slot = slot[order]
    tok, flat_w = torch.div(slot, k, rounding_mode="floor"), flat_w[slot]
    counts = torch.bincount(flat_e, minlength=num_experts)
    if group is None or group.size == 1:
        sent = [int(slot.numel())]
        return DispatchPlan(tok, flat_w, sent, sent, list(enumerate(counts.tolist())))
    ep = group.size
    local = num_experts // ep
    received = torch.empty_like(counts)
    group.communicator().all_to_all(received, counts)  # equal parts: E/ep counts to each rank
    from_src = received.view(ep, local).tolist()  # [source][local expert]
    send_splits = counts.view(ep, local).sum(dim=1).tolist()
    recv_splits = [sum(row) for row in from_src]
    segments = [(e, from_src[s][e]) for s in range(ep) for e in range(local)]
    return DispatchPlan(tok, flat_w, send_splits, recv_splits, segments, exchange=True)


_send_buffers: Dict[Tuple[Tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}
_MAX_SEND_BUFFERS = 8  # shapes differ per micro-batch with the routing; a few are enough to hit


def _send_buffer(shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    key = (shape, like.dtype, like.device)
    buf = _send_buffers.pop(key, None)
    if buf is None:
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        while len(_send_buffers) >= _MAX_SEND_BUFFERS:
            _send_buffers.pop(next(iter(_send_buffers)))  # the least recently used
    _send_buffers[key] = buf
    return buf


class _GatherToSend(torch.autograd.Function):
    """fwd ``tokens[index]`` into a reused buffer; bwd each token's summed row gradients.

    Only for rows that go straight into an exchange: the exchange copies the
    buffer before returning and keeps nothing of it, so the next call may
    overwrite it."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.n = tokens.shape[0]
        buf = _send_buffer((index.numel(),) + tuple(tokens.shape[1:]), tokens)
        return torch.index_select(tokens, 0, index, out=buf)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        out = torch.zeros((ctx.n,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        return out.index_add_(0, index, grad), None


class _Combine(torch.autograd.Function):
    """fwd ``out[t] = sum of weight[i] * rows[i] over the rows i of token t``; bwd the
    rows' and the weights' gradients.

    One Function instead of autograd's multiply, zero fill and out-of-place
    index_add: forward sums in place into the output; backward gathers each
    row's token gradient once and derives both gradients from it. (torch's
    sparse CSR product, tried for the forward, was slower on one core.)"""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
        ctx.save_for_backward(rows, weight, token)
        out = torch.zeros((n, rows.shape[-1]), dtype=rows.dtype, device=rows.device)
        return out.index_add_(0, token, rows * weight.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, token = ctx.saved_tensors
        g = grad.index_select(0, token)  # each row's token's gradient
        grad_weight = torch.bmm(rows.unsqueeze(1), g.unsqueeze(2)).view(-1) if ctx.needs_input_grad[1] else None
        grad_rows = g.mul_(weight.unsqueeze(-1)) if ctx.needs_input_grad[0] else None
        return grad_rows, grad_weight, None, None


@eager
def dispatch(tokens: torch.Tensor, plan: DispatchPlan, group: Optional[Group]) -> torch.Tensor:
    """(N, d) tokens -> the rows this rank's experts compute (``plan.segments``)."""
    if not plan.exchange:
        return tokens[plan.token]  # the experts keep these rows for backward: new memory
    assert group is not None  # rows cross ranks of the ep group
    return all_to_all(_GatherToSend.apply(tokens, plan.token), group, plan.recv_splits, plan.send_splits)


@eager
def combine(expert_rows: torch.Tensor, plan: DispatchPlan, group: Optional[Group], n_tokens: int) -> torch.Tensor:
    """The experts' outputs (in ``dispatch``'s order) -> (N, d): each token's
    sum of its experts' outputs times their router weights."""
    if plan.exchange:
        assert group is not None  # rows cross ranks of the ep group
        expert_rows = all_to_all(expert_rows, group, plan.send_splits, plan.recv_splits)
    return _Combine.apply(expert_rows, plan.weight.to(expert_rows.dtype), plan.token, n_tokens)
