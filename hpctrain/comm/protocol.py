"""The Communicator protocol: every collective in hpctrain goes through one.

A Communicator serves exactly one ``Group`` (``hpctrain.mesh``). Ranks passed
to it (``src``, ``dst``, ``peer``) are *group* ranks. Every operation works in
place on caller-provided tensors (like NCCL and MPI), and returns a ``Work``
handle; with ``async_op=False`` the handle is already complete. Backends are
plugins (``hpctrain_make_backend``); the core defines only this contract plus
the argument checks every backend shares, so all of them fail the same way.

Shapes:
- ``all_gather(output, input)``: output is ``group.size`` copies of input's
  shape concatenated along dim 0 (rank order).
- ``reduce_scatter(output, input)``: input is ``group.size`` chunks along dim
  0; group rank r receives the reduction of chunk r.
- ``all_to_all(output, input, output_splits, input_splits)``: dim-0 splits;
  ``None`` means equal splits. Pass ``None`` on every rank of a call or on
  none: a backend may use a different algorithm for each (the mpi backend's
  ``MPI_Alltoall`` vs ``Alltoallv``), and ranks that disagree hang.

One optional method, which callers reach through the function of the same
name here (``all_to_all_rows``) so a backend without it still works:
- ``all_to_all_rows(output, input, rows, output_splits, input_splits)``:
  ``all_to_all(output, input[rows], ...)`` where the rows to send are
  ``input``'s dim-0 rows ``rows`` (a 1-D integer index in send order, one
  entry per row sent), without gathering them into a tensor first (the
  mpi backend describes them to MPI as an indexed datatype). A backend
  without the method gets ``index_select`` and its ``all_to_all``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Sequence, runtime_checkable

import torch

from hpctrain.errors import CommError


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"


@runtime_checkable
class Work(Protocol):
    """Handle of a (possibly) pending operation."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class CompletedWork:
    """A Work that is already done (blocking calls, size-1 groups)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


@dataclass
class P2POp:
    """One send or receive of a batched point-to-point exchange."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int  # group rank
    tag: int = 0

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise CommError(f"P2POp kind must be 'send' or 'recv', not {self.kind!r}")


@runtime_checkable
class Communicator(Protocol):
    """Collectives over one group. See the module docstring for shapes."""

    backend: str
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work: ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work: ...

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Optional[Sequence[int]] = None,
        input_splits: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None: ...

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> List[Work]: ...

    def barrier(self) -> None: ...


# -- shared argument checks (local shapes; cross-rank checks are the backend's) --

def _dim0(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def check_all_gather(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    if output.dtype != input.dtype:
        raise CommError(f"all_gather: output dtype {output.dtype} != input dtype {input.dtype}")
    if output.numel() != input.numel() * size:
        raise CommError(
            f"all_gather: output has {output.numel()} elements, expected group size {size} x "
            f"input {tuple(input.shape)} = {input.numel() * size}"
        )


def check_reduce_scatter(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    if output.dtype != input.dtype:
        raise CommError(f"reduce_scatter: output dtype {output.dtype} != input dtype {input.dtype}")
    if input.numel() != output.numel() * size:
        raise CommError(
            f"reduce_scatter: input has {input.numel()} elements, expected group size {size} x "
            f"output {tuple(output.shape)} = {output.numel() * size}"
        )


def _check_splits(op: str, name: str, what: str, count: int, splits: Sequence[int], size: int) -> None:
    """``splits``, the ``{name}_splits`` of ``op``, cut ``count`` rows (``what``) among ``size`` ranks."""
    if len(splits) != size or any(s < 0 for s in splits):
        raise CommError(f"{op}: {name}_splits={list(splits)} must be {size} non-negative counts")
    if sum(splits) != count:
        raise CommError(f"{op}: {name}_splits sum to {sum(splits)} but {what} is {count}")


def check_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Optional[Sequence[int]],
    input_splits: Optional[Sequence[int]],
    size: int,
) -> None:
    if output.dtype != input.dtype:
        raise CommError(f"all_to_all: output dtype {output.dtype} != input dtype {input.dtype}")
    for name, t, splits in (("input", input, input_splits), ("output", output, output_splits)):
        if splits is None:
            if _dim0(t) % size:
                raise CommError(f"all_to_all: {name} dim 0 ({_dim0(t)}) is not divisible by group size {size}; "
                                f"pass {name}_splits")
        else:
            _check_splits("all_to_all", name, f"{name} dim 0", _dim0(t), splits, size)


def check_rows(output: torch.Tensor, input: torch.Tensor, rows: torch.Tensor, output_splits: Sequence[int],
               input_splits: Sequence[int], size: int) -> None:
    """``all_to_all_rows``' checks: ``rows`` is a 1-D integer index of ``input``'s rows
    on its device, inside them (checked on CPU), one per row the input splits send; the
    output splits cut the output, whose dtype and row size are the input's."""
    op = "all_to_all_rows"
    if output.dtype != input.dtype:
        raise CommError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype}")
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32) or rows.device != input.device:
        raise CommError(f"{op}: rows must be a 1-D int64 or int32 index on {input.device}, not "
                        f"{rows.dtype} of shape {tuple(rows.shape)} on {rows.device}")
    _check_splits(op, "input", "the number of rows indexed", rows.numel(), input_splits, size)
    _check_splits(op, "output", "output dim 0", _dim0(output), output_splits, size)
    if input.dim() and output.dim() and input.shape[1:].numel() != output.shape[1:].numel():
        raise CommError(f"{op}: input rows of shape {tuple(input.shape[1:])} and output rows of shape "
                        f"{tuple(output.shape[1:])} differ in size")
    n = input.shape[0] if input.dim() else 0
    if rows.numel() and rows.device.type == "cpu":  # (elsewhere index_select asserts; no sync here)
        lo, hi = torch.aminmax(rows)
        if int(lo) < 0 or int(hi) >= n:
            raise CommError(f"{op}: rows index {int(lo)}..{int(hi)}, outside input's {n} rows")


def all_to_all_rows(comm: Communicator, output: torch.Tensor, input: torch.Tensor, rows: torch.Tensor,
                    output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False) -> Work:
    """``comm.all_to_all(output, input[rows], output_splits, input_splits)``: the
    backend's ``all_to_all_rows`` where it has one (sending from ``input`` without a
    gathered copy), else the rows gathered with ``index_select`` and sent."""
    own = getattr(comm, "all_to_all_rows", None)
    if own is not None:
        return own(output, input, rows, output_splits, input_splits, async_op)
    check_rows(output, input, rows, output_splits, input_splits, comm.size)
    return comm.all_to_all(output, input.index_select(0, rows), output_splits, input_splits, async_op)


# -- reduction dtypes (shared so every backend accepts and rounds the same way) --

#: 16-bit floats are reduced in float32 and rounded once at the end: summing
#: in 16 bits loses ~1 bit per addition (bf16 keeps 8 significant bits), and
#: MPI has no bf16 type at all. Backends that stage through this dtype give
#: ``round16(sum32(inputs))`` whatever the reduction order.
_ACCUMULATE_IN_FP32 = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` data runs in (float32 for 16-bit floats)."""
    return torch.float32 if dtype in _ACCUMULATE_IN_FP32 else dtype


def check_reduce_dtype(what: str, dtype: torch.dtype, op: "ReduceOp", supported: Sequence[torch.dtype]) -> None:
    """Raise CommError, before any communication, for a reduction a backend
    cannot do (the same on every rank, so no rank is left waiting)."""
    if dtype not in supported:
        names = ", ".join(str(d).replace("torch.", "") for d in supported)
        raise CommError(f"{what}: cannot reduce dtype {str(dtype).replace('torch.', '')}; supported: {names}")
    if ReduceOp(op) == ReduceOp.AVG and not dtype.is_floating_point:
        raise CommError(f"{what}: op=avg needs a floating dtype, not {str(dtype).replace('torch.', '')} "
                        "(use op=sum and divide)")


class WrappedCommunicator:
    """The base of a communicator that does something before delegating to
    another (counting bus bytes, an injected delay): ``inner`` is the wrapped
    one, its ``backend``, ``rank`` and ``size`` are copied, and any attribute
    the wrapper does not define (``group``, backend-specific ones) is read
    from it."""

    def __init__(self, inner: Communicator):
        self.inner = inner
        self.backend = inner.backend
        self.rank = inner.rank
        self.size = inner.size

    def __getattr__(self, name: str) -> Any:  # only for names not found on the wrapper
        return getattr(self.inner, name)


class LocalCommunicator:
    """The communicator of a size-1 group: every collective is a local copy.

    Used for axes of size 1 so a one-process run never initialises a
    distributed backend.
    """

    backend = "local"
    rank = 0
    size = 1

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        return CompletedWork()

    def all_gather(self, output, input, async_op=False):
        check_all_gather(output, input, 1)
        output.view(-1).copy_(input.reshape(-1))
        return CompletedWork()

    def reduce_scatter(self, output, input, op=ReduceOp.SUM, async_op=False):
        check_reduce_scatter(output, input, 1)
        output.view(-1).copy_(input.reshape(-1))
        return CompletedWork()

    def all_to_all(self, output, input, output_splits=None, input_splits=None, async_op=False):
        check_all_to_all(output, input, output_splits, input_splits, 1)
        output.copy_(input)
        return CompletedWork()

    def broadcast(self, tensor, src, async_op=False):
        return CompletedWork()

    def send(self, tensor, dst, tag=0):
        raise CommError("send on a group of size 1: there is no peer")

    def recv(self, tensor, src, tag=0):
        raise CommError("recv on a group of size 1: there is no peer")

    def batch_isend_irecv(self, ops):
        if ops:
            raise CommError("batch_isend_irecv on a group of size 1: there is no peer")
        return []

    def barrier(self):
        return None
