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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from hpctrain.comm.differentiable import all_to_all
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


def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int,
                  group: Optional[Group]) -> DispatchPlan:
    """The plan for (N, k) ``experts`` and ``weights``, ``keep`` (N, k) the
    assignments within capacity (None: all). Collective over ``group`` (the
    ep group; None or size 1: no exchange)."""
    n, k = experts.shape
    tok = torch.arange(n, device=experts.device).repeat_interleave(k)
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    if keep is not None:
        kept = keep.reshape(-1)
        tok, flat_e, flat_w = tok[kept], flat_e[kept], flat_w[kept]
    order = torch.argsort(flat_e, stable=True)
    tok, flat_e, flat_w = tok[order], flat_e[order], flat_w[order]
    counts = torch.bincount(flat_e, minlength=num_experts)
    if group is None or group.size == 1:
        sent = [int(flat_e.numel())]
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


def dispatch(tokens: torch.Tensor, plan: DispatchPlan, group: Optional[Group]) -> torch.Tensor:
    """(N, d) tokens -> the rows this rank's experts compute (``plan.segments``)."""
    rows = tokens[plan.token]
    if not plan.exchange:
        return rows
    assert group is not None  # rows cross ranks of the ep group
    return all_to_all(rows, group, plan.recv_splits, plan.send_splits)


def combine(expert_rows: torch.Tensor, plan: DispatchPlan, group: Optional[Group], n_tokens: int) -> torch.Tensor:
    """The experts' outputs (in ``dispatch``'s order) -> (N, d): each token's
    sum of its experts' outputs times their router weights."""
    if plan.exchange:
        assert group is not None  # rows cross ranks of the ep group
        expert_rows = all_to_all(expert_rows, group, plan.send_splits, plan.recv_splits)
    weighted = expert_rows * plan.weight.unsqueeze(-1).to(expert_rows.dtype)
    out = torch.zeros((n_tokens, expert_rows.shape[-1]), dtype=expert_rows.dtype, device=expert_rows.device)
    return out.index_add(0, plan.token, weighted)
