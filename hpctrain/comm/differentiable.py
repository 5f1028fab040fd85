"""Differentiable collectives: autograd knows how each region change goes
backward, so parallel layers are written as plain forward code.

One private ``autograd.Function`` per region change and a one-line public
wrapper whose docstring states forward and backward (the idiom of
Megatron's ``mappings.py``). Every function takes a mesh ``Group`` and runs
through its Communicator, so it works on every backend (torch/gloo, nccl,
mpi, hier) and its bytes are counted. A group of one rank is the identity
both ways (no communication).

Shapes. ``dim`` is the tensor dim the region change splits or joins; pieces
are in group-rank order and equal in size (``scatter_*`` and
``reduce_scatter_*`` need the dim divisible by the group size).
``all_to_all`` moves dim-0 rows with per-rank counts (uneven splits).
Reductions are sums (a mean is the caller's division: the gradient of a
mean over ranks is not a collective's business).

Under ``trainer.compile`` (code dynamo traces: ``torch.compiler.is_compiling()``)
the same functions call the custom operators of ``hpctrain.comm.ops`` instead
of the Functions: one node of the graph each, the body the same as here, so
a block compiles to one graph across its collectives. ``exchange_counts``
returns Python integers (the host must know them), so it stays an eager
island (``hpctrain.eager``): a graph break.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Type

import torch

from hpctrain.comm import ops
from hpctrain.comm.ops import all_to_all_tensor as _all_to_all
from hpctrain.comm.ops import gather_tensor as _all_gather
from hpctrain.comm.ops import own_chunk as _own_chunk
from hpctrain.comm.ops import reduce_scatter_tensor as _reduce_scatter
from hpctrain.comm.ops import reduce_tensor as _all_reduce
from hpctrain.comm.ops import shift_tensor as _shift
from hpctrain.comm.protocol import ReduceOp
from hpctrain.eager import eager
from hpctrain.errors import CommError
from hpctrain.mesh import Group


# -- autograd functions ---------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _along_dim(name: str, forward, backward) -> Type[torch.autograd.Function]:
    """An autograd Function over (x, group, dim): ``forward`` going forward,
    ``backward`` on the gradient (both ``f(tensor, group, dim)``)."""

    def fwd(ctx, x, group: Group, dim: int):
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def bwd(ctx, grad):
        return backward(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_ScatterToRegion = _along_dim("_ScatterToRegion", _own_chunk, _all_gather)
_GatherFromRegion = _along_dim("_GatherFromRegion", _all_gather, _own_chunk)
_GatherFromSequenceRegion = _along_dim("_GatherFromSequenceRegion", _all_gather, _reduce_scatter)
_ReduceScatterToSequenceRegion = _along_dim("_ReduceScatterToSequenceRegion", _reduce_scatter, _all_gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, shift: int):
        ctx.group, ctx.shift = group, shift
        return _shift(x, group, shift)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -ctx.shift), None, None


# -- plain collectives for plugins' own autograd Functions ---------------------------
def _tracing() -> bool:
    """Whether dynamo is tracing this call (then the operators of ``hpctrain.comm.ops``)."""
    return torch.compiler.is_compiling()


def all_reduce_copy(x: torch.Tensor, group: Group, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """The ranks' ``x`` reduced with ``op``, in a new tensor (not differentiable)."""
    if group.size == 1:
        return x.detach().clone()
    if _tracing():
        return ops.all_reduce(x.detach(), ops.group_key(group), ReduceOp(op).value)
    return _all_reduce(x.detach(), group, op)


def all_gather_along(x: torch.Tensor, group: Group, dim: int, again: bool = False) -> torch.Tensor:
    """The ranks' ``x`` joined along ``dim`` (not differentiable; contiguous). ``again``: a second gather of
    a tensor gathered before (a backward's re-gather), which compiled code must not merge with the first
    (``hpctrain.comm.ops``)."""
    if group.size == 1:
        return x.contiguous()
    if _tracing():
        return ops.all_gather(x.detach(), ops.group_key(group), dim % x.dim(), again)
    return _all_gather(x, group, dim).contiguous()


def reduce_scatter_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` of the ranks' summed ``x`` (not differentiable)."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.reduce_scatter(x.detach(), ops.group_key(group), dim % x.dim())
    return _reduce_scatter(x, group, dim)


# -- the public wrappers -----------------------------------------------------------
def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a region where every rank computes with the same ``x``: fwd identity, bwd all-reduce (sum)."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.CopyToRegion.apply(x, ops.group_key(group))
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a region of partial sums: fwd all-reduce (sum), bwd identity."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.reduce_from_region(x, ops.group_key(group))
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim``: fwd split (own chunk), bwd all-gather along ``dim``."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.scatter_to_region(x, ops.group_key(group), dim % x.dim())
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Join the ranks' chunks of ``dim``: fwd all-gather along ``dim``, bwd split (own chunk)."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.gather_from_region(x, ops.group_key(group), dim % x.dim())
    return _GatherFromRegion.apply(x, group, dim)


def scatter_to_sequence_region(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Enter sequence parallelism: fwd split the sequence ``dim`` (own chunk), bwd all-gather along it."""
    return scatter_to_region(x, group, dim)


def gather_from_sequence_region(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Before a column-parallel layer: fwd all-gather the sequence ``dim``, bwd reduce-scatter (sum) along it."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.gather_from_sequence_region(x, ops.group_key(group), dim % x.dim())
    return _GatherFromSequenceRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """After a row-parallel layer: fwd reduce-scatter (sum) along the sequence ``dim``, bwd all-gather along it."""
    if group.size == 1:
        return x
    if _tracing():
        return ops.reduce_scatter_to_sequence_region(x, ops.group_key(group), dim % x.dim())
    return _ReduceScatterToSequenceRegion.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group: Group, output_splits: Optional[Sequence[int]] = None,
               input_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Exchange dim-0 rows (``input_splits[j]`` rows to rank j, ``output_splits[j]`` from it): fwd all-to-all,
    bwd all-to-all with the splits swapped. ``input_splits`` None: equal parts of ``x``; ``output_splits``
    None: equal parts too, so it needs ``input_splits`` None on every rank (else use ``exchange_counts``)."""
    if group.size == 1:
        return x
    if input_splits is not None and output_splits is None:
        raise CommError(f"all_to_all over group {group.name}: input_splits without output_splits; "
                        "find what each rank receives with exchange_counts(input_splits, group)")
    out = [int(s) for s in output_splits] if output_splits is not None else None
    inp = [int(s) for s in input_splits] if input_splits is not None else None
    if out is not None and inp is None:  # the backward needs this rank's own counts explicitly
        if x.shape[0] % group.size:
            raise CommError(f"all_to_all over group {group.name}: dim 0 of size {x.shape[0]} is not divisible by "
                            f"the group size {group.size}; pass input_splits")
        inp = [x.shape[0] // group.size] * group.size
    if _tracing():
        return ops.all_to_all_region(x, ops.group_key(group), out, inp)
    return _AllToAll.apply(x, group, out, inp)


def ring_shift(x: torch.Tensor, group: Group, shift: int = 1) -> torch.Tensor:
    """Pass ``x`` around the ring: fwd send to rank r+shift and receive from r-shift, bwd the reverse."""
    if group.size == 1 or shift % group.size == 0:
        return x
    if _tracing():
        return ops.ring_shift_region(x, ops.group_key(group), shift)
    return _RingShift.apply(x, group, shift)


@eager
def exchange_counts(counts: Sequence[int], group: Group, device: Optional[torch.device] = None) -> List[int]:
    """What every rank will send this one, from what this one sends each
    (``counts[j]`` to rank j): the ``output_splits`` of an uneven
    ``all_to_all``, found with one small all-to-all of the counts."""
    if len(counts) != group.size:
        raise CommError(f"exchange_counts: {len(counts)} counts for group {group.name} of size {group.size}")
    if group.size == 1:
        return list(counts)
    send = torch.tensor(list(counts), dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    group.communicator().all_to_all(recv, send)
    return [int(c) for c in recv.tolist()]
