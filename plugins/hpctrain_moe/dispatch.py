"""Moving tokens to their experts and back: all-to-all with uneven splits.

Rank r of the ep group holds experts ``[r * E/ep, (r + 1) * E/ep)``. Per
micro-batch and MoE block:

1. ``plan_dispatch``: the kept (token, expert) assignments are sorted by
   expert (stable), so the rows for each destination rank are contiguous;
   one small all-to-all of the per-expert counts tells every rank how many
   rows it gets from each source for each of its experts (the splits of the
   next two exchanges, so no rank ever waits on a shape it does not know).
2. ``dispatch``: the rows for other ranks' experts go out in one uneven
   all-to-all with a zero count for this rank (counts may be 0: a rank that
   receives nothing works, with empty tensors); the rows arriving form the
   front of the experts' input, source-major (from each other source, its
   rows for each local expert), and the rows for this rank's own experts,
   which never leave it, are gathered straight in behind them.
3. the local experts run on those runs (``DispatchPlan.segments``) where
   they lie, so the rows are never regrouped by expert (two copies of
   every row saved), and hand their results over run by run.
4. ``combine``: the runs are joined into a buffer with room behind them;
   the results for other ranks (its front) go back through the reverse
   all-to-all, and the results other ranks computed for this one arrive in
   the room, right behind this rank's own, so one weighted
   ``embedding_bag`` over the back of the buffer, one bag per token, sums
   them into their tokens with the router weights where they lie.

At ep = e, a rank's own experts get about 1/e of its rows: that share
costs neither the exchange nor a copy in it. Backward of each step sends
the gradients the opposite way through the same two exchanges. With ep = 1
the same code runs without the exchanges: that is the one-process model.

Costs on the token path (docs/benchmarks.md, "hpctrain-bench moe"): one
stable sort of the assignments by expert gives the send order, each row's
token and the combine's bags (each row's place in (token, choice) order,
so no second sort); on CPU that is one C call (``native``: a counting
sort, two passes), elsewhere torch's operators. The counts go through kept
buffers while the rank gathers the kept weights and its splits. The rows to
send leave straight from the tokens (``comm.protocol.all_to_all_rows``: on
the mpi backend an indexed datatype that MPI packs as it sends, elsewhere
one ``index_select`` first), and this rank's own rows are gathered while
that exchange is open, so the rank that arrives first gathers instead of
waiting. Results handed over run by run go back to other ranks from a
buffer kept per shape (nothing saves it for backward, so it is reused from
call to call). The combine is one autograd Function (``_Combine``) whose
forward joins the runs (the copy the experts' concatenation made before)
and gathers, weights and sums in one pass, reading the router's weights in
their own (token, choice) order, and whose backward gathers each row's
token gradient once for both gradients.

Under ``trainer.compile`` the plan, the dispatch and the combine are eager
islands (``hpctrain.eager``): their shapes follow the routing and the send
buffer is reused across calls, nothing a graph should capture; the router
and the experts' matrix products stay in the block's compiled graphs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from hpctrain.comm.protocol import all_to_all_rows
from hpctrain.eager import eager
from hpctrain.mesh import Group
from hpctrain.model import amp

from hpctrain_moe import native


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
    """The experts' input rows as consecutive runs of (local expert, rows): the rows
    received from the other sources first, in rank order, each by expert, then this
    rank's own rows by expert (one run per expert when ep = 1). Runs may be empty."""
    kept_position: torch.Tensor
    """(A,) each row's place among the kept assignments in (token, choice) order."""
    bag_rows: torch.Tensor
    """(A,) the combine's rows (this rank's own results first, then those received back,
    in send order) in (token, choice) order: token t's rows are
    ``bag_rows[offsets[t]:offsets[t + 1]]`` (the bags of its ``embedding_bag``)."""
    offsets: torch.Tensor
    """(N + 1,) where each token's kept assignments start in that order (the last entry: A):
    token t's are ``kept_weight[offsets[t]:offsets[t + 1]]``."""
    exchange: bool = False
    """Whether rows cross ranks (ep > 1)."""
    rank: int = 0
    """This rank in the ep group."""
    rows_buffer: Optional[torch.Tensor] = None
    """Set by ``dispatch(experts_in_place=True)``: the experts' rows with room behind them
    for the results other ranks send back (see ``combine``)."""

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

    @property
    def own_runs(self) -> int:
        """The runs of ``segments`` that hold this rank's own rows (the last ones)."""
        return len(self.segments) // len(self.send_splits)

    @property
    def received_rows(self) -> int:
        """Rows this rank's experts compute for other ranks (in front of its own)."""
        return sum(self.remote_splits[1])

    @property
    def returned_rows(self) -> int:
        """Rows other ranks' experts compute for this rank (sent, and returned by the combine)."""
        return sum(self.remote_splits[0])

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
        """The combine's rows (own rows first, then the ones other ranks return) as
        places in (token, choice) order."""
        if not self.exchange:
            return self.kept_position
        a, b = self.own
        return torch.cat([self.kept_position[a:b], self.remote(self.kept_position)])

    @cached_property
    def combine_token(self) -> torch.Tensor:
        """The token of each of the combine's rows (own rows first, then the returned ones)."""
        return self.token if not self.exchange else torch.cat([self.own_token, self.remote_token])

    def remote(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (one entry per row of ``token``) without this rank's own rows."""
        a, b = self.own
        return t[b:] if a == 0 else t[:a] if b == t.shape[0] else torch.cat([t[:a], t[b:]])

    def holds(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` are the experts' rows in ``rows_buffer`` (the room behind them free)."""
        buf = self.rows_buffer
        return (buf is not None and rows.data_ptr() == buf.data_ptr() and rows.dtype == buf.dtype
                and rows.is_contiguous() and rows.shape[1:] == buf.shape[1:]
                and rows.shape[0] == self.received_rows + self.own_rows)


def _index_plan(experts: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int, own_experts: Tuple[int, int],
                counts: torch.Tensor, lib: Optional[ctypes.CDLL]
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(order, token, bag_rows, offsets, kept) of (N, k) ``experts``, ``keep`` the
    assignments within capacity (None: all): ``order`` sorts the kept assignments (in
    (token, choice) order) by expert, stably (the send order); ``token`` is each sent
    row's token; ``bag_rows`` places the combine's rows (those of this rank's experts
    ``own_experts`` first, then the others in send order) back in (token, choice) order;
    ``offsets`` where each token's kept assignments start in that order (N + 1 entries);
    ``kept`` their (token, choice) slots (None: all kept). ``counts`` (E) receives the
    assignments per expert. One C call with ``lib`` (``native.library()``, on CPU),
    torch's operators without."""
    if lib is not None:
        return native.plan(lib, experts, keep, num_experts, own_experts, counts)
    n, k = experts.shape
    ids = experts.reshape(-1)
    kept = None if keep is None else keep.reshape(-1).nonzero().squeeze(1)
    if kept is not None:
        ids = ids.index_select(0, kept)
    per_expert = torch.bincount(ids, minlength=num_experts)
    if per_expert.numel() != num_experts:  # an id >= E (bincount itself refuses negative ones)
        raise ValueError(f"plan_dispatch: expert ids outside [0, {num_experts})")
    counts.copy_(per_expert)
    # where the own rows start and end in send order, as tensors: no wait for the device here
    # (plan_dispatch reads the counts once, for the splits)
    a = per_expert[:own_experts[0]].sum()
    b = a + per_expert[own_experts[0]:own_experts[1]].sum()
    order = torch.argsort(ids, stable=True)
    slot = order if kept is None else kept.index_select(0, order)
    sent = torch.arange(order.numel(), device=order.device)
    position = torch.where(sent < a, sent + (b - a), torch.where(sent < b, sent - a, sent))  # among the combine's rows
    bag_rows = torch.empty_like(order).scatter_(0, order, position)
    if keep is None:
        offsets = torch.arange(0, n * k + 1, k, device=experts.device)
    else:
        offsets = torch.zeros(n + 1, dtype=torch.long, device=experts.device)
        torch.cumsum(keep.sum(dim=1), 0, out=offsets[1:])
    return order, torch.div(slot, k, rounding_mode="floor"), bag_rows, offsets, kept


@eager
def plan_dispatch(experts: torch.Tensor, weights: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int,
                  group: Optional[Group]) -> DispatchPlan:
    """The plan for (N, k) ``experts`` and ``weights``, ``keep`` (N, k) the
    assignments within capacity (None: all). Collective over ``group`` (the
    ep group; None or size 1: no exchange)."""
    exchange = group is not None and group.size > 1
    ep, me = (group.size, group.rank) if group is not None else (1, 0)
    local = num_experts // ep
    if experts.device.type == "meta":
        return _balanced_plan(experts, weights, keep, num_experts, group)
    if exchange:
        mine, received = _counts_buffers(num_experts, experts.device)
    else:
        mine = torch.empty(num_experts, dtype=torch.long, device=experts.device)
    lib = native.library() if experts.device.type == "cpu" else None
    order, tok, bag_rows, offsets, kept = _index_plan(experts, keep, num_experts, (me * local, (me + 1) * local),
                                                      mine, lib)
    if exchange:  # the counts travel while this rank gathers its weights and splits
        assert group is not None
        work = group.communicator().all_to_all(received, mine, async_op=True)
    flat_w = weights.reshape(-1)
    if kept is not None:
        flat_w = flat_w.index_select(0, kept)
    counts = mine.tolist()
    if not exchange:
        sent = [order.numel()]
        return DispatchPlan(tok, flat_w, sent, sent, list(enumerate(counts)), order, bag_rows, offsets)
    send_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
    work.wait()
    from_src = received.view(ep, local).tolist()  # [source][local expert]
    recv_splits = [sum(row) for row in from_src]
    sources = [s for s in range(ep) if s != me] + [me]  # received rows first, then own, as dispatch lays them out
    segments = [(e, from_src[s][e]) for s in sources for e in range(local)]
    return DispatchPlan(tok, flat_w, send_splits, recv_splits, segments, order, bag_rows, offsets, exchange=True,
                        rank=me)


def _balanced_plan(experts: torch.Tensor, weights: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int,
                   group: Optional[Group]) -> DispatchPlan:
    """``plan_dispatch`` on the meta device (``hpctrain-train --dry-run``), where no routing exists: the
    assignments spread evenly over the experts (the first ``A mod E`` experts one more), every
    source routing alike; with a capacity (``capacity_factor`` >= 1 holds an even share) nothing
    is dropped. The plan has the shapes and splits of that routing, and the counts' all-to-all is
    issued as in a real step."""
    n, k = experts.shape
    exchange = group is not None and group.size > 1
    ep, me = (group.size, group.rank) if group is not None else (1, 0)
    local = num_experts // ep
    share, extra = divmod(n * k, num_experts)
    counts = [share + (1 if e < extra else 0) for e in range(num_experts)]
    rows = n * k
    index = torch.empty(rows, dtype=torch.long, device=experts.device)
    flat_w = weights.reshape(-1) if keep is None else weights.reshape(-1).index_select(0, index)
    offsets = torch.empty(n + 1, dtype=torch.long, device=experts.device)
    if not exchange:
        return DispatchPlan(index, flat_w, [rows], [rows], list(enumerate(counts)), index.clone(), index.clone(),
                            offsets)
    assert group is not None  # (exchange)
    mine, received = _counts_buffers(num_experts, experts.device)
    group.communicator().all_to_all(received, mine)
    send_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
    from_src = [counts[me * local:(me + 1) * local] for _ in range(ep)]  # every source routes as this one
    recv_splits = [sum(row) for row in from_src]
    sources = [s for s in range(ep) if s != me] + [me]
    segments = [(e, from_src[s][e]) for s in sources for e in range(local)]
    return DispatchPlan(index, flat_w, send_splits, recv_splits, segments, index.clone(), index.clone(), offsets,
                        exchange=True, rank=me)


_counts: Dict[Tuple[int, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}


def _counts_buffers(num_experts: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sent, received) per-expert counts, kept per size: the plan writes its counts in and
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
    """fwd the experts' input rows: the rows of other ranks received at the front,
    ``tokens[own tokens]`` gathered in place behind them; bwd the tokens' gradients
    (the other ranks' part sent back through the reverse exchange)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, plan: DispatchPlan, group: Group, in_place: bool) -> torch.Tensor:
        send, recv = plan.remote_splits
        ctx.plan, ctx.group, ctx.n = plan, group, tokens.shape[0]
        row = tuple(tokens.shape[1:])
        first, rows = plan.received_rows, plan.received_rows + plan.own_rows
        if in_place:  # room behind the rows for what the combine gets back
            plan.rows_buffer = torch.empty((rows + plan.returned_rows,) + row, dtype=tokens.dtype,
                                           device=tokens.device)
            out = plan.rows_buffer[:rows]
        else:
            out = torch.empty((rows,) + row, dtype=tokens.dtype, device=tokens.device)
        # The rows for other ranks go out first (they wait on them), sent from the tokens where they lie (no
        # gathered copy on the mpi backend); this rank's own rows are gathered while the exchange is open,
        # so a rank that arrives first gathers instead of waiting.
        work = all_to_all_rows(group.communicator(), out[:first], tokens.contiguous(), plan.remote_token, recv, send,
                               async_op=True)
        torch.index_select(tokens, 0, plan.own_token, out=out[first:])
        work.wait()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan = ctx.plan
        send, recv = plan.remote_splits
        grad = grad.contiguous()
        first = plan.received_rows
        back = torch.empty((plan.returned_rows,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        ctx.group.communicator().all_to_all(back, grad[:first], send, recv)
        out = torch.zeros((ctx.n,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        out.index_add_(0, plan.own_token, grad[first:])
        return out.index_add_(0, plan.remote_token, back), None, None, None


class _Combine(torch.autograd.Function):
    """fwd ``out[t] = sum of weight[i] * rows[i] over the rows i of token t``, where
    ``rows`` are this rank's own experts' results and those other ranks' experts
    computed (received through the reverse exchange; none when ep = 1); bwd the
    expert outputs' gradients (the other ranks' sent back) and the weights'.

    The experts' results come as one tensor or as the runs they computed one by
    one (``parts``, in ``plan.segments`` order: received rows, then own rows).
    Runs are joined where they go: the results for other ranks into the kept
    send buffer, this rank's own in front of room where the returned results
    come in, so both are summed where they lie and the backward keeps only
    those. One tensor is used where it is when it is ``dispatch``'s in-place
    buffer (``plan.holds``), otherwise its own rows are copied in front of the
    returned ones.

    The sum is one weighted ``embedding_bag`` over the rows (own rows first,
    returned rows behind them), one bag per token in (token, choice) order, so
    the router's weights are its per-row weights as they are: gather, multiply
    and sum in one pass that writes each token once. The backward gathers each
    row's token gradient once and derives both gradients from it."""

    @staticmethod
    def forward(ctx, kept_weight: torch.Tensor, plan: DispatchPlan, group: Optional[Group],
                *parts: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [p.shape[0] for p in parts]
        like = parts[0]
        width = like.shape[-1]
        if plan.exchange:
            assert group is not None  # rows cross ranks of the ep group
            send, recv = plan.remote_splits
            first, own = plan.received_rows, plan.own_rows
            if len(parts) == 1 and plan.holds(like):
                assert plan.rows_buffer is not None
                buf, outgoing = plan.rows_buffer, like[:first]
                rows = buf[first:]
            elif len(parts) == 1:  # a tensor of its own: its own rows move in front of the returned ones
                rows = torch.empty((own + plan.returned_rows, width), dtype=like.dtype, device=like.device)
                rows[:own].copy_(like[first:])
                outgoing = like[:first]
            else:  # the runs: those for other ranks joined into the kept send buffer, own ones in front
                mine = plan.own_runs  # of the returned rows (nothing of the sent results outlives the call)
                if len(parts) != len(plan.segments):
                    raise ValueError(f"combine: {len(parts)} runs of results, the plan has {len(plan.segments)}")
                rows = torch.empty((own + plan.returned_rows, width), dtype=like.dtype, device=like.device)
                outgoing = torch.cat(parts[:-mine], out=_send_buffer((first, width), like))
                torch.cat(parts[-mine:], out=rows[:own])
            group.communicator().all_to_all(rows[own:], outgoing, send, recv)
        else:
            rows = like if len(parts) == 1 else torch.cat(parts)  # every row is this rank's own, in combine order
        with amp.autocast(rows.device.type, enabled=False):  # the rows' dtype is the output's
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
        if ctx.needs_input_grad[0]:
            grad_weight = _rowdot(rows, g).index_select(0, plan.bag_rows)
        if not any(ctx.needs_input_grad[3:]):
            return (grad_weight, None, None) + (None,) * len(ctx.sizes)
        row_weight = kept_weight.index_select(0, plan.combine_position).unsqueeze(-1)
        if plan.exchange:
            send, recv = plan.remote_splits
            first, own = plan.received_rows, plan.own_rows
            grad_rows = torch.empty((first + own, grad.shape[-1]), dtype=grad.dtype, device=grad.device)
            torch.mul(g[:own], row_weight[:own], out=grad_rows[first:])  # own rows straight into place
            ctx.group.communicator().all_to_all(grad_rows[:first], g[own:].mul_(row_weight[own:]), recv, send)
        else:
            grad_rows = g.mul_(row_weight)
        return (grad_weight, None, None) + tuple(grad_rows.split(ctx.sizes))


@eager
def dispatch(tokens: torch.Tensor, plan: DispatchPlan, group: Optional[Group],
             experts_in_place: bool = False) -> torch.Tensor:
    """(N, d) tokens -> the rows this rank's experts compute (``plan.segments``).

    ``experts_in_place``: the experts' results are these rows themselves (an
    identity, as in ``hpctrain-bench moe``, or an in-place update under
    ``torch.no_grad``: autograd forbids modifying a custom Function's output
    view): they are laid out with room behind them for the results the
    combine gets back, so it copies none of them. Experts that compute new
    rows pass their runs to ``combine`` instead, which joins them where it
    needs them."""
    if not plan.exchange:
        return tokens[plan.token]  # the experts keep these rows for backward: new memory
    assert group is not None  # rows cross ranks of the ep group
    return _Dispatch.apply(tokens, plan, group, experts_in_place)


@eager
def combine(expert_rows: Union[torch.Tensor, Sequence[torch.Tensor]], plan: DispatchPlan, group: Optional[Group],
            n_tokens: int) -> torch.Tensor:
    """The experts' outputs (one tensor in ``dispatch``'s order, or its runs, those
    of ``plan.segments``, one tensor each) -> (N, d): each token's sum of its
    experts' outputs times their router weights."""
    if plan.offsets.numel() != n_tokens + 1:
        raise ValueError(f"combine: the plan routes {plan.offsets.numel() - 1} tokens, not {n_tokens}")
    parts = (expert_rows,) if isinstance(expert_rows, torch.Tensor) else tuple(expert_rows)
    return _Combine.apply(plan.kept_weight.to(parts[0].dtype), plan, group, *parts)
