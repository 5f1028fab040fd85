"""Two-level collectives: inside each node, then across nodes.

A group of ``N`` nodes with ``L`` of its ranks on each (see ``layout``) has
an intra-node communicator (the ``L`` ranks of my node) and an inter-node
one (the ``N`` ranks at my position ``l`` on every node). Data moves
between nodes once per byte, in ``L`` parallel streams:

- all_reduce: reduce-scatter inside the node (rank ``l`` gets the node's
  sum of chunk ``l``), all-reduce chunk ``l`` across nodes, all-gather
  inside the node. The tensor is padded to a multiple of ``L`` elements.
- reduce_scatter: rows are first reordered so that the ``N`` output chunks of
  the ranks at position ``l`` are adjacent; reduce-scatter inside the node
  (rank ``l`` gets the node's sum of those ``N`` chunks), then across nodes
  (rank ``k`` gets its own chunk, summed over nodes).
- all_gather: all-gather across nodes (each input crosses the network once),
  then inside the node; rows are then put back in group order.

16-bit floats are converted to float32 once before the first phase and
rounded once after the last, so the result is ``round16(sum32)`` like the
flat backends. AVG is SUM in every phase and one division at the end.

all_to_all, broadcast, send/recv, batch_isend_irecv and barrier go to a flat
communicator over the whole group (the inter backend; the intra one when the
group lies in one node): they move each byte once already.

Asynchronous calls start the first phase without blocking and run the other
phases inside ``wait()`` (``is_completed()`` tests the first phase, which
lets MPI progress it, and stays False until ``wait()``). Driving
the later phases from polling would start them at different moments on
different ranks, and collectives on a communicator must start in the same
order everywhere; ``wait()`` calls happen in program order, which is the
same on every rank.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from hpctrain.comm.protocol import (
    Communicator,
    CompletedWork,
    P2POp,
    ReduceOp,
    Work,
    accumulation_dtype,
    check_all_gather,
    check_reduce_dtype,
    check_reduce_scatter,
)
from hpctrain.errors import CommError
from hpctrain.mesh import Group

#: what the two-level reductions accept (the sub-backends see float32 for 16-bit floats)
REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)

# small integer codes, to compare dtypes and ops across ranks inside a tensor
_DTYPE_CODES = {d: i for i, d in enumerate(REDUCIBLE + (torch.int16, torch.int8, torch.uint8, torch.bool,
                                                      torch.complex64, torch.complex128))}
_OP_CODES = {op: i for i, op in enumerate(ReduceOp)}


class PhasedWork:
    """The first phase is in flight; ``wait()`` finishes it and runs the rest."""

    def __init__(self, first: Work, rest: Callable[[], None]):
        self._first = first
        self._rest: Optional[Callable[[], None]] = rest

    def wait(self) -> None:
        if self._rest is not None:
            self._first.wait()
            rest, self._rest = self._rest, None
            rest()

    def is_completed(self) -> bool:
        if self._rest is not None:
            self._first.is_completed()  # lets the first phase progress (a local test, starts nothing)
            return False
        return True


def _then(first: Work, rest: Callable[[], None], async_op: bool):
    if async_op:
        return PhasedWork(first, rest)
    first.wait()
    rest()
    return CompletedWork()


class HierCommunicator:
    """The protocol's collectives for one group, two-level where that pays."""

    backend = "hier"

    def __init__(self, group: Group, mode: str, flat: Communicator,
                 intra: Optional[Communicator] = None, inter: Optional[Communicator] = None,
                 slots: Sequence[int] = (), check_shapes: bool = False):
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.mode = mode
        self.flat = flat
        self.intra = intra
        self.inter = inter
        self.check_shapes = check_shapes
        # slot_of_rank[g]: where group rank g's chunk sits in the two-level layout
        self.slot_of_rank = torch.tensor(list(slots), dtype=torch.long)

    def __repr__(self) -> str:
        return f"HierCommunicator(group={self.group.name}, mode={self.mode}, size={self.size})"

    @property
    def two_level(self) -> bool:
        return self.intra is not None and self.inter is not None

    def _levels(self) -> Tuple[Communicator, Communicator]:
        """(intra, inter) of a two-level group."""
        assert self.intra is not None and self.inter is not None, "a two-level group has both"
        return self.intra, self.inter

    def _agree(self, what: str, tensor: torch.Tensor, op: ReduceOp) -> None:
        """``comm.hier.check_shapes``: all ranks of the group passed the same
        element count, dtype and op (one small all-gather on the flat
        communicator). Without it a size mismatch between nodes can pass
        unnoticed: the padded chunks may still agree."""
        if not self.check_shapes:
            return
        mine = torch.tensor([tensor.numel(), _DTYPE_CODES.get(tensor.dtype, -1), _OP_CODES[op]], dtype=torch.int64)
        everyone = torch.empty(self.size, 3, dtype=torch.int64)
        self.flat.all_gather(everyone, mine)
        rows = [tuple(r) for r in everyone.tolist()]
        if any(r != rows[0] for r in rows):
            seen = "; ".join(f"rank {g}: numel {r[0]}"
                             + (f", dtype #{r[1]}, op #{r[2]}" if r[1:] != rows[0][1:] else "")
                             for g, r in enumerate(rows))
            raise CommError(f"{what} on group {self.group.name}: ranks disagree on sizes, dtypes or ops: {seen}")

    # -- two-level reductions ---------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
        op = ReduceOp(op)
        if not self.two_level:
            return self.flat.all_reduce(tensor, op, async_op)
        check_reduce_dtype("all_reduce", tensor.dtype, op, REDUCIBLE)
        self._agree("all_reduce", tensor, op)
        total = tensor.numel()
        if total == 0:
            return CompletedWork()
        acc = accumulation_dtype(tensor.dtype)
        intra, inter = self._levels()
        local = intra.size
        chunk = math.ceil(total / local)
        if tensor.is_contiguous() and tensor.dtype == acc and total == chunk * local:
            work = tensor.detach().view(-1)  # in place: no staging copy
        else:
            work = torch.empty(chunk * local, dtype=acc, device=tensor.device)
            work[:total].copy_(tensor.detach().reshape(-1))
            work[total:].zero_()
        part = torch.empty(chunk, dtype=acc, device=tensor.device)
        phase_op = ReduceOp.SUM if op == ReduceOp.AVG else op
        first = intra.reduce_scatter(part, work, phase_op, async_op=async_op)

        def rest() -> None:
            inter.all_reduce(part, phase_op)
            intra.all_gather(work, part)
            if op == ReduceOp.AVG:
                work.div_(self.size)
            if work.data_ptr() != tensor.data_ptr():
                with torch.no_grad():
                    tensor.copy_(work[:total].view(tensor.shape))

        return _then(first, rest, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False):
        op = ReduceOp(op)
        if not self.two_level:
            return self.flat.reduce_scatter(output, input, op, async_op)
        check_reduce_scatter(output, input, self.size)
        check_reduce_dtype("reduce_scatter", input.dtype, op, REDUCIBLE)
        self._agree("reduce_scatter", input, op)
        each = output.numel()
        if each == 0:
            return CompletedWork()
        acc = accumulation_dtype(input.dtype)
        intra, inter = self._levels()
        slots = self.slot_of_rank.to(input.device)
        staged = torch.empty(self.size, each, dtype=acc, device=input.device)
        staged.index_copy_(0, slots, input.detach().reshape(self.size, each).to(acc))
        block = torch.empty(inter.size * each, dtype=acc, device=input.device)
        phase_op = ReduceOp.SUM if op == ReduceOp.AVG else op
        first = intra.reduce_scatter(block, staged.view(-1), phase_op, async_op=async_op)

        def rest() -> None:
            mine = torch.empty(each, dtype=acc, device=input.device)
            inter.reduce_scatter(mine, block, phase_op)
            if op == ReduceOp.AVG:
                mine.div_(self.size)
            with torch.no_grad():
                output.copy_(mine.view(output.shape))

        return _then(first, rest, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        if not self.two_level:
            return self.flat.all_gather(output, input, async_op)
        check_all_gather(output, input, self.size)
        self._agree("all_gather", input, ReduceOp.SUM)
        each = input.numel()
        if each == 0:
            return CompletedWork()
        intra, inter = self._levels()
        source = input.detach().reshape(-1).contiguous()
        across = torch.empty(inter.size * each, dtype=input.dtype, device=input.device)
        first = inter.all_gather(across, source, async_op=async_op)

        def rest() -> None:
            gathered = torch.empty(self.size, each, dtype=input.dtype, device=input.device)
            intra.all_gather(gathered.view(-1), across)
            ordered = gathered.index_select(0, self.slot_of_rank.to(input.device))
            with torch.no_grad():
                output.copy_(ordered.view(output.shape))

        return _then(first, rest, async_op)

    # -- delegated to the flat communicator ---------------------------------
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Optional[Sequence[int]] = None,
                   input_splits: Optional[Sequence[int]] = None, async_op: bool = False):
        return self.flat.all_to_all(output, input, output_splits, input_splits, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        return self.flat.broadcast(tensor, src, async_op)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.flat.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.flat.recv(tensor, src, tag)

    def batch_isend_irecv(self, ops: Sequence[P2POp]):
        return self.flat.batch_isend_irecv(ops)

    def barrier(self) -> None:
        self.flat.barrier()
