"""Moving tokens to their experts and back: all-to-all with uneven splits.

Rank r of the ep group holds experts ``[r * E/ep, (r + 1) * E/ep)``. Per
micro-batch and MoE block:

1. ``plan_dispatch``: the kept (token, expert) assignments are sorted by
   expert (stable), so the rows for each destination rank are contiguous;
   one small all-to-all of the per-expert counts tells every rank how many
   rows it gets from each source for each of its experts (the splits of the
   next two exchanges, so no rank ever waits on a shape it does not know).
2. ``dispatch``: the rows for this rank's own experts never leave it:
   they are gathered straight into the front of the experts' input; the
   others go out in one uneven all-to-all with a zero count for this rank
   (counts may be 0: a rank that receives nothing works, with empty
   tensors), and arrive behind them, source-major: from each other source,
   its rows for each local expert.
3. the local experts run on those runs (``DispatchPlan.segments``) where
   they lie, so the rows are never regrouped by expert (two copies of
   every row saved).
4. ``combine``: the results for other ranks go back through the reverse
   all-to-all in the same order, behind a copy of this rank's own results;
   one weighted ``embedding_bag`` over those rows, one bag per token, sums
   them into their tokens with the router weights.

At ep = e, a rank's own experts get about 1/e of its rows: that share
costs neither the exchange nor a copy in it. Backward of each step sends
the gradients the opposite way through the same two exchanges. With ep = 1
the same code runs without the exchanges: that is the one-process model.

Costs on the token path (docs/benchmarks.md, "hpctrain-bench moe"): one
stable sort of the assignments gives the send order, each row's token and
its place in (token, choice) order (from which the combine's bags follow
without a second sort), and runs while the counts are exchanged (through
kept buffers); the rows to send are gathered with one ``index_select``
into a buffer kept per shape (the exchange copies it out before returning,
and nothing saves it for backward, so it is reused from call to call); the
combine is one autograd Function (``_Combine``) whose forward gathers,
weights and sums in one pass, reading the router's weights in their own
(token, choice) order, and whose backward gathers each row's token
gradient once for both gradients.

Under ``trainer.compile`` the plan, the dispatch and the combine are eager
islands (``hpctrain.eager``): their shapes follow the routing and the send
buffer is reused across calls, nothing a graph should capture; the router
and the experts' matrix products stay in the block's compiled graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from hpctrain.eager import eager
from hpctrain.mesh import Group


@dataclass
class DispatchPlan:
    token: torch.Tensor
    """(A,) the source token of each row sent, rows grouped by expert in ascending order."""
    kept_weight: torch.Tensor
    """(A,) the router weight of each kept assignment in (token, choice) order (fp32,
    differentiable; with nothing dropped, the router's weights themselves, flattened)."""
    send_splits: List[int]
    """Rows sent to each ep rank."""
    recv_splits: List[int]
    """Rows received from each ep rank."""
    segments: List[Tuple[int, int]]
    """The experts' input rows as consecutive runs of (local expert, rows): this rank's own
    rows first, then the other sources' in rank order, each by expert (one run per expert
    when ep = 1). Runs may be empty."""
    kept_position: torch.Tensor
    """(A,) each row's place among the kept assignments in (token, choice) order."""
    offsets: torch.Tensor
    """(N + 1,) where each token's kept assignments start in that order (the last entry: A):
    token t's are ``kept_weight[offsets[t]:offsets[t + 1]]``."""
    exchange: bool = False
    """Whether rows cross ranks (ep > 1)."""
    rank: int = 0
    """This rank in the ep group."""

    @cached_property
    def own(self) -> Tuple[int, int]:
        """The rows of ``token`` that go to this rank's own experts: ``token[own[0]:own[1]]``
        (all of them when ep = 1)."""
        a = sum(self.send_splits[:self.rank])
        return a, a + self.send_splits[self.rank]

    @property
    def own_rows(self) -> int:
        """Rows this rank's own experts compute of its own tokens."""
        return self.send_splits[self.rank]

    @cached_property
    def remote_splits(self) -> Tuple[List[int], List[int]]:
        """(send, receive) splits of the exchange, with zero rows for this rank itself."""
        send, recv = list(self.send_splits), list(self.recv_splits)
        send[self.rank] = recv[self.rank] = 0
        return send, recv

    @cached_property
    def own_token(self) -> torch.Tensor:
        """The tokens of the rows this rank's own experts compute."""
        return self.token[self.own[0]:self.own[1]]

    @cached_property
    def remote_token(self) -> torch.Tensor:
        """The tokens of the rows other ranks' experts compute, in send order."""
        return self.remote(self.token)

    @cached_property
    def weight(self) -> torch.Tensor:
        """(A,) each row's router weight, in send order (differentiable)."""
        return self.kept_weight.index_select(0, self.kept_position)

    @cached_property
    def combine_position(self) -> torch.Tensor:
        """The combine's rows (own rows first, then the received ones) as places in
        (token, choice) order."""
        if not self.exchange:
            return self.kept_position
        a, b = self.own
        return torch.cat([self.kept_position[a:b], self.remote(self.kept_position)])

    @cached_property
    def combine_token(self) -> torch.Tensor:
        """The token of each of the combine's rows."""
        return self.token if not self.exchange else torch.cat([self.own_token, self.remote_token])

    @cached_property
    def bag_rows(self) -> torch.Tensor:
        """The combine's rows in (token, choice) order: token t's rows are
        ``bag_rows[offsets[t]:offsets[t + 1]]`` (the bags of its ``embedding_bag``)."""
        rows = torch.empty_like(self.combine_position)
        rows[self.combine_position] = torch.arange(rows.numel(), device=rows.device)
        return rows

    def remote(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (one entry per row of ``token``) without this rank's own rows."""
        a, b = self.own
        return t[b:] if a == 0 else t[:a] if b == t.shape[0] else torch.cat([t[:a], t[b:]])


@eager
def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int,
                  group: Optional[Group]) -> DispatchPlan:
    """The plan for (N, k) ``experts`` and ``weights``, ``keep`` (N, k) the
    assignments within capacity (None: all). Collective over ``group`` (the
    ep group; None or size 1: no exchange)."""
    n, k = experts.shape
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    kept: Optional[torch.Tensor] = None  # the kept (token, choice) slots, ascending
    if keep is None:
        offsets = torch.arange(0, n * k + 1, k, device=experts.device)
    else:
        kept = keep.reshape(-1).nonzero().squeeze(1)
        flat_e, flat_w = flat_e.index_select(0, kept), flat_w.index_select(0, kept)
        offsets = torch.zeros(n + 1, dtype=torch.long, device=experts.device)
        torch.cumsum(keep.sum(dim=1), 0, out=offsets[1:])
    counts = torch.bincount(flat_e, minlength=num_experts)
    exchange = group is not None and group.size > 1
    if exchange:  # the counts travel while this rank sorts
        assert group is not None
        mine, received = _counts_buffers(num_experts, counts.device)
        mine.copy_(counts)  # (kept tensors: the communicator's remembered-pair path)
        work = group.communicator().all_to_all(received, mine, async_op=True)  # E/ep counts to each rank
    order = torch.argsort(flat_e, stable=True)  # the one sort: rows by expert, then by token
    slot = order if kept is None else kept.index_select(0, order)
    tok = torch.div(slot, k, rounding_mode="floor")
    if not exchange:
        sent = [int(order.numel())]
        return DispatchPlan(tok, flat_w, sent, sent, list(enumerate(counts.tolist())), order, offsets)
    assert group is not None
    work.wait()
    ep, me = group.size, group.rank
    local = num_experts // ep
    from_src = received.view(ep, local).tolist()  # [source][local expert]
    send_splits = counts.view(ep, local).sum(dim=1).tolist()
    recv_splits = [sum(row) for row in from_src]
    sources = [me] + [s for s in range(ep) if s != me]  # own rows first, as dispatch lays them out
    segments = [(e, from_src[s][e]) for s in sources for e in range(local)]
    return DispatchPlan(tok, flat_w, send_splits, recv_splits, segments, order, offsets, exchange=True, rank=me)


_counts: Dict[Tuple[int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}


def _counts_buffers(num_experts: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sent, received) per-expert counts, kept per size: the plan copies its counts in and
    reads the others' out before it returns, so one pair serves every plan."""
    key = (num_experts, device)
    if key not in _counts:
        _counts[key] = (torch.empty(num_experts, dtype=torch.long, device=device),
                        torch.empty(num_experts, dtype=torch.long, device=device))
    return _counts[key]


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


def _rowdot(rows: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Each row's dot product with the same row of ``g``."""
    return torch.bmm(rows.unsqueeze(1), g.unsqueeze(2)).view(-1)


class _Dispatch(torch.autograd.Function):
    """fwd the experts' input rows: ``tokens[own tokens]`` gathered in place at the
    front, the rows of other ranks received behind them; bwd the tokens' gradients
    (the other ranks' part sent back through the reverse exchange)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, plan: DispatchPlan, group: Group) -> torch.Tensor:
        send, recv = plan.remote_splits
        ctx.plan, ctx.group, ctx.n = plan, group, tokens.shape[0]
        row = tuple(tokens.shape[1:])
        out = torch.empty((plan.own_rows + sum(recv),) + row, dtype=tokens.dtype, device=tokens.device)
        torch.index_select(tokens, 0, plan.own_token, out=out[:plan.own_rows])
        outgoing = torch.index_select(tokens, 0, plan.remote_token,
                                      out=_send_buffer((plan.remote_token.numel(),) + row, tokens))
        group.communicator().all_to_all(out[plan.own_rows:], outgoing, recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        send, recv = plan.remote_splits
        grad = grad.contiguous()
        back = torch.empty((plan.remote_token.numel(),) + tuple(grad.shape[1:]), dtype=grad.dtype,
                           device=grad.device)
        ctx.group.communicator().all_to_all(back, grad[plan.own_rows:], send, recv)
        out = torch.zeros((ctx.n,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        out.index_add_(0, plan.own_token, grad[:plan.own_rows])
        return out.index_add_(0, plan.remote_token, back), None, None


class _Combine(torch.autograd.Function):
    """fwd ``out[t] = sum of weight[i] * rows[i] over the rows i of token t``, where
    ``rows`` are this rank's own rows (read where its experts wrote them) and the
    rows other ranks' experts computed (received through the reverse exchange; none
    when ep = 1); bwd the expert outputs' gradients (the other ranks' sent back) and
    the weights'.

    The forward is one weighted ``embedding_bag`` over the rows (own rows first,
    received rows behind them), one bag per token in (token, choice) order, so the
    router's weights are its per-row weights as they are: gather, multiply and sum
    in one pass that writes each token once, instead of a product per row, a zero
    fill and a scattered add. The backward gathers each row's token gradient once
    and derives both gradients from it."""

    @staticmethod
    def forward(ctx, expert_rows: torch.Tensor, kept_weight: torch.Tensor, plan: DispatchPlan,
                group: Optional[Group]) -> torch.Tensor:
        send, recv = plan.remote_splits
        if plan.exchange:
            assert group is not None  # rows cross ranks of the ep group
            rows = torch.empty((plan.own_rows + sum(send), expert_rows.shape[-1]), dtype=expert_rows.dtype,
                               device=expert_rows.device)
            rows[:plan.own_rows].copy_(expert_rows[:plan.own_rows])
            group.communicator().all_to_all(rows[plan.own_rows:], expert_rows[plan.own_rows:], send, recv)
        else:
            rows = expert_rows  # every row is this rank's own, already in combine order
        with torch.autocast(rows.device.type, enabled=False):  # the rows' dtype is the output's
            out = F.embedding_bag(plan.bag_rows, rows, plan.offsets, mode="sum", per_sample_weights=kept_weight,
                                  include_last_offset=True)
        ctx.save_for_backward(rows, kept_weight)
        ctx.plan, ctx.group = plan, group
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        rows, kept_weight = ctx.saved_tensors
        g = grad.index_select(0, plan.combine_token)  # each row's token gradient, once
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = _rowdot(rows, g).index_select(0, plan.bag_rows)
        grad_rows = None
        if ctx.needs_input_grad[0]:
            row_weight = kept_weight.index_select(0, plan.combine_position).unsqueeze(-1)
            if plan.exchange:
                send, recv = plan.remote_splits
                own = plan.own_rows
                grad_rows = torch.empty((own + sum(recv), grad.shape[-1]), dtype=grad.dtype, device=grad.device)
                torch.mul(g[:own], row_weight[:own], out=grad_rows[:own])  # own rows straight into place
                ctx.group.communicator().all_to_all(grad_rows[own:], g[own:].mul_(row_weight[own:]), recv, send)
            else:
                grad_rows = g.mul_(row_weight)
        return grad_rows, grad_weight, None, None


@eager
def dispatch(tokens: torch.Tensor, plan: DispatchPlan, group: Optional[Group]) -> torch.Tensor:
    """(N, d) tokens -> the rows this rank's experts compute (``plan.segments``)."""
    if not plan.exchange:
        return tokens[plan.token]  # the experts keep these rows for backward: new memory
    assert group is not None  # rows cross ranks of the ep group
    return _Dispatch.apply(tokens, plan, group)


@eager
def combine(expert_rows: torch.Tensor, plan: DispatchPlan, group: Optional[Group], n_tokens: int) -> torch.Tensor:
    """The experts' outputs (in ``dispatch``'s order) -> (N, d): each token's
    sum of its experts' outputs times their router weights."""
    if plan.offsets.numel() != n_tokens + 1:
        raise ValueError(f"combine: the plan routes {plan.offsets.numel() - 1} tokens, not {n_tokens}")
    return _Combine.apply(expert_rows, plan.kept_weight.to(expert_rows.dtype), plan, group)
