"""Our collectives as torch operators, so that torch.compile traces through them.

``trainer.compile`` compiles each block's forward (``hpctrain.model.compile``).
A collective that calls MPI or torch.distributed from Python is opaque to
dynamo: it would break the graph. Registered as custom operators
(``torch.library.custom_op``) they are single nodes of the graph instead:
dynamo and AOTAutograd see only their output's shape (the fake
implementation, ``register_fake``) and their gradient (``register_autograd``:
the conjugate collective), and at run time the node calls the group's
Communicator, so every backend (torch, mpi, hier, record) works unchanged, its
bytes counted and its collectives numbered for the hang watchdog as in eager.

A Communicator cannot be an operator's argument, so each operator takes the
group's *key*, a short string (``group_key``: the group's name and a number
unique in the process), and looks the group up in a registry of weak
references. ``Mesh.attach_backends`` registers every mesh group before
anything is compiled, so tracing only reads the key (a constant of the graph).

Two kinds of operators (``hpctrain::<name>``):

- plain collectives, not differentiable, for plugins' own autograd Functions
  (whose forward and backward dynamo traces): ``all_reduce(x, group, op)``,
  ``all_gather(x, group, dim, again)``, ``reduce_scatter(x, group, dim)``,
  ``all_to_all(x, group, output_splits, input_splits)``;
- region changes with their autograd formula, one per public function of
  ``hpctrain.comm.differentiable`` whose forward moves data:
  ``reduce_from_region`` (fwd all-reduce, bwd identity),
  ``scatter_to_region`` (fwd own chunk, bwd all-gather),
  ``gather_from_region`` (fwd all-gather, bwd own chunk),
  ``gather_from_sequence_region`` (fwd all-gather, bwd reduce-scatter),
  ``reduce_scatter_to_sequence_region`` (fwd reduce-scatter, bwd all-gather),
  ``all_to_all_region`` (fwd all-to-all, bwd the reverse all-to-all) and
  ``ring_shift_region`` (fwd ring shift, bwd the opposite shift).
  ``copy_to_region`` (fwd identity) stays an autograd Function whose backward
  is the ``all_reduce`` operator: an operator may not return its input, and
  a copy of the activations per sub-layer would cost what the Function does not.

Only compiled code uses the operators (``differentiable`` picks them when
``torch.compiler.is_compiling()``); eager code keeps the Functions, so an
eager run, the dry run on the meta device and its dispatch modes see
exactly what they saw before. Both paths share the same bodies
(``gather_tensor`` and the rest, here), so they move the same bytes.
Every operator returns a new contiguous tensor.

The compiler merges two calls of an operator with the same arguments
(AOTAutograd's common-subexpression elimination), as it would two equal
``x + y``. ``all_gather``'s ``again`` (ignored by the body) keeps a second
gather of the same tensor apart: sequence parallelism's column projections
gather their input again in backward instead of keeping the gathered one
(``hpctrain_tp.columns``), and merged with the forward's gather that would
keep the whole sequence on every rank, the memory sequence parallelism saves.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from hpctrain.comm.protocol import Communicator, P2POp, ReduceOp
from hpctrain.errors import CommError


class Group(Protocol):
    """What the operators use of a ``hpctrain.mesh.Group`` (named here: the mesh imports this module to
    register its groups)."""

    name: str
    rank: int

    @property
    def size(self) -> int: ...

    def communicator(self) -> Communicator: ...


_GROUPS: "weakref.WeakValueDictionary[str, Group]" = weakref.WeakValueDictionary()
"""Every registered group by its key."""
_NUMBERS = itertools.count()
_KEY = "_hpctrain_op_key"
"""The attribute of a Group holding its key."""


def group_key(group: Group) -> str:
    """``group``'s key for the operators, registering it on first use (while tracing, a registered group's
    key is only read: ``Mesh.attach_backends`` registered it)."""
    key = getattr(group, _KEY, None)
    if key is not None and torch.compiler.is_compiling():
        return key
    if key is None or _GROUPS.get(key) is not group:
        key = f"{group.name}#{next(_NUMBERS)}"
        _GROUPS[key] = group
        object.__setattr__(group, _KEY, key)
    return key


def group_of(key: str) -> Group:
    """The group registered under ``key``."""
    group = _GROUPS.get(key)
    if group is None:
        raise CommError(f"collective operator: no group registered as {key!r} (hpctrain.comm.ops.group_key)")
    return group


# -- the collectives on one dim, out of place: the bodies of the operators and of
# -- hpctrain.comm.differentiable's Functions
def _front(x: Tensor, dim: int) -> Tensor:
    """``x`` with ``dim`` first, contiguous (a view when ``dim`` is already 0)."""
    return x.movedim(dim, 0).contiguous()


def reduce_tensor(x: Tensor, group: Group, op: ReduceOp = ReduceOp.SUM) -> Tensor:
    out = x.contiguous().clone()
    group.communicator().all_reduce(out, op)
    return out


def gather_tensor(x: Tensor, group: Group, dim: int) -> Tensor:
    src = _front(x, dim)
    out = torch.empty((group.size * src.shape[0],) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
    group.communicator().all_gather(out, src)
    return out.movedim(0, dim)


def reduce_scatter_tensor(x: Tensor, group: Group, dim: int) -> Tensor:
    src = _front(x, dim)
    if src.shape[0] % group.size:
        raise CommError(f"reduce-scatter over group {group.name}: dim {dim} of size {src.shape[0]} is not divisible "
                        f"by the group size {group.size}")
    out = torch.empty((src.shape[0] // group.size,) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
    group.communicator().reduce_scatter(out, src, ReduceOp.SUM)
    return out.movedim(0, dim)


def own_chunk(x: Tensor, group: Group, dim: int) -> Tensor:
    n = x.shape[dim]
    if n % group.size:
        raise CommError(f"scatter over group {group.name}: dim {dim} of size {n} is not divisible by the group "
                        f"size {group.size}")
    step = n // group.size
    return x.narrow(dim, group.rank * step, step).contiguous()


def all_to_all_tensor(x: Tensor, group: Group, output_splits: Optional[Sequence[int]],
                      input_splits: Optional[Sequence[int]]) -> Tensor:
    src = x.contiguous()
    rows = sum(output_splits) if output_splits is not None else src.shape[0]
    out = torch.empty((rows,) + tuple(src.shape[1:]), dtype=x.dtype, device=x.device)
    group.communicator().all_to_all(out, src, output_splits, input_splits)
    return out


def shift_tensor(x: Tensor, group: Group, shift: int) -> Tensor:
    n, r = group.size, group.rank
    src = x.contiguous()
    out = torch.empty_like(src)
    works = group.communicator().batch_isend_irecv([P2POp("send", src, (r + shift) % n),
                                                    P2POp("recv", out, (r - shift) % n)])
    for w in works:
        w.wait()
    return out



def _gathered_shape(x: Tensor, size: int, dim: int) -> Tuple[int, ...]:
    shape = list(x.shape)
    shape[dim] *= size
    return tuple(shape)


def _scattered_shape(x: Tensor, size: int, dim: int, what: str, name: str) -> Tuple[int, ...]:
    shape = list(x.shape)
    if shape[dim] % size:
        raise CommError(f"{what} over group {name}: dim {dim} of size {shape[dim]} is not divisible by the group "
                        f"size {size}")
    shape[dim] //= size
    return tuple(shape)


def _define(name: str, schema: str, body: Callable[..., Tensor], fake: Callable[..., Tensor]) -> Any:
    op = torch.library.custom_op(f"hpctrain::{name}", body, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


# -- plain collectives ------------------------------------------------------------------------------------
def _all_reduce_body(x: Tensor, group: str, op: str) -> Tensor:
    return reduce_tensor(x, group_of(group), ReduceOp(op))


def _all_gather_body(x: Tensor, group: str, dim: int, again: bool = False) -> Tensor:
    return gather_tensor(x, group_of(group), dim).contiguous()


def _reduce_scatter_body(x: Tensor, group: str, dim: int) -> Tensor:
    return reduce_scatter_tensor(x, group_of(group), dim).contiguous()


def _all_to_all_body(x: Tensor, group: str, output_splits: Optional[List[int]],
                     input_splits: Optional[List[int]]) -> Tensor:
    return all_to_all_tensor(x, group_of(group), output_splits, input_splits)


def _own_chunk_body(x: Tensor, group: str, dim: int) -> Tensor:
    return own_chunk(x, group_of(group), dim)


def _shift_body(x: Tensor, group: str, shift: int) -> Tensor:
    return shift_tensor(x, group_of(group), shift)


def _same_fake(x: Tensor, group: str, *_: Any) -> Tensor:
    return x.new_empty(x.shape)


def _gather_fake(x: Tensor, group: str, dim: int, again: bool = False) -> Tensor:
    return x.new_empty(_gathered_shape(x, group_of(group).size, dim))


def _scatter_fake(x: Tensor, group: str, dim: int) -> Tensor:
    g = group_of(group)
    return x.new_empty(_scattered_shape(x, g.size, dim, "reduce-scatter", g.name))


def _own_chunk_fake(x: Tensor, group: str, dim: int) -> Tensor:
    g = group_of(group)
    return x.new_empty(_scattered_shape(x, g.size, dim, "scatter", g.name))


def _all_to_all_fake(x: Tensor, group: str, output_splits: Optional[List[int]],
                     input_splits: Optional[List[int]]) -> Tensor:
    rows = sum(output_splits) if output_splits is not None else x.shape[0]
    return x.new_empty((rows,) + tuple(x.shape[1:]))


all_reduce = _define("all_reduce", "(Tensor x, str group, str op) -> Tensor", _all_reduce_body, _same_fake)
all_gather = _define("all_gather", "(Tensor x, str group, int dim, bool again=False) -> Tensor", _all_gather_body,
                     _gather_fake)
reduce_scatter = _define("reduce_scatter", "(Tensor x, str group, int dim) -> Tensor", _reduce_scatter_body,
                         _scatter_fake)
all_to_all = _define("all_to_all", "(Tensor x, str group, int[]? output_splits, int[]? input_splits) -> Tensor",
                     _all_to_all_body, _all_to_all_fake)


# -- region changes, with their gradients --------------------------------------------------------------------
def _setup(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
    ctx.args = inputs[1:]


def _region(name: str, body: Callable[..., Tensor], fake: Callable[..., Tensor],
            backward: Callable[..., Tensor], schema: str = "(Tensor x, str group, int dim) -> Tensor") -> Any:
    """The operator ``hpctrain::name`` over (x, group, *args): ``body`` forward, ``backward(grad, group,
    *args)`` backward."""
    op = _define(name, schema, body, fake)

    def grad_fn(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        return (backward(grad.contiguous(), *ctx.args),) + (None,) * len(ctx.args)

    op.register_autograd(grad_fn, setup_context=_setup)
    return op


reduce_from_region = _region("reduce_from_region", lambda x, group: _all_reduce_body(x, group, "sum"), _same_fake,
                             lambda grad, group: grad, schema="(Tensor x, str group) -> Tensor")
scatter_to_region = _region("scatter_to_region", _own_chunk_body, _own_chunk_fake,
                            lambda grad, group, dim: all_gather(grad, group, dim))
gather_from_region = _region("gather_from_region", _all_gather_body, _gather_fake,
                             lambda grad, group, dim: _own_chunk_body(grad, group, dim))
gather_from_sequence_region = _region("gather_from_sequence_region", _all_gather_body, _gather_fake,
                                      lambda grad, group, dim: reduce_scatter(grad, group, dim))
reduce_scatter_to_sequence_region = _region("reduce_scatter_to_sequence_region", _reduce_scatter_body, _scatter_fake,
                                            lambda grad, group, dim: all_gather(grad, group, dim))
all_to_all_region = _region(
    "all_to_all_region", _all_to_all_body, _all_to_all_fake,
    lambda grad, group, output_splits, input_splits: all_to_all(grad, group, input_splits, output_splits),
    schema="(Tensor x, str group, int[]? output_splits, int[]? input_splits) -> Tensor")
def _unshift(grad: Tensor, group: str, shift: int) -> Tensor:
    return ring_shift_region(grad, group, -shift)


ring_shift_region: Any = _region("ring_shift_region", _shift_body, _same_fake, _unshift,
                                 schema="(Tensor x, str group, int shift) -> Tensor")


class CopyToRegion(torch.autograd.Function):
    """fwd identity, bwd the ``all_reduce`` operator (sum) over the group with key ``group``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return all_reduce(grad, ctx.group, "sum"), None
