"""A Communicator that records each operation and moves nothing.

Each call appends one ``hpctrain.comm.records.CollectiveRecord`` (a point-
to-point batch one per send or receive) with its bus bytes, computed here
from the nccl-tests convention (n the group size, S the op's size):
all-reduce 2 (n-1)/n S of the tensor, all-gather (n-1)/n S of the
gathered output, reduce-scatter (n-1)/n S of the input, all-to-all what
this rank sends to the others, broadcast S, send S; a receive and a barrier
0. The dry run's test compares them with what the counting wrapper
(``hpctrain.comm.counting``) counts on a real backend.

Tensors keep their shapes (every operation works in place on the caller's
tensors). On the meta device, where the dry run runs, there are no values
to move. A tensor with memory gets what it would if every rank of the group
held this rank's values (an all-gather repeats the input, a reduce-scatter
keeps this rank's chunk, an all-to-all with equal splits returns the input,
a receive leaves the buffer as it is), so code that reads a result finds
numbers, never uninitialised memory; an all-reduce leaves the tensor as it is.
Peers are the group's tuple of world ranks, shared by every record: no
per-call work grows with the group.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hpctrain.comm.protocol import (
    CompletedWork,
    P2POp,
    ReduceOp,
    check_all_gather,
    check_all_to_all,
    check_reduce_scatter,
    check_rows,
)
from hpctrain.comm.records import CollectiveRecord
from hpctrain.errors import CommError
from hpctrain.mesh import Group


def _real(t: torch.Tensor) -> bool:
    return t.device.type != "meta"


class RecordingCommunicator:
    """Records the collectives of one group (see the module docstring)."""

    backend = "record"

    def __init__(self, group: Group):
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.records: List[CollectiveRecord] = []
        """Every operation this rank issued on the group, in order."""
        n = group.size
        self._ring = (n - 1) / n if n else 0.0
        self._name, self._axes, self._ranks = group.name, tuple(group.axes), group.ranks

    def _add(self, op: str, dtype: torch.dtype, nbytes: float, peers: Optional[Sequence[int]] = None) -> None:
        self.records.append(CollectiveRecord(op, self._name, self._axes, dtype, float(nbytes),
                                             self._ranks if peers is None else tuple(peers)))

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < self.size:
            raise CommError(f"peer {peer} is outside group {self._name} of size {self.size}")
        return self._ranks[peer]

    # -- collectives -------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
        ReduceOp(op)
        self._add("all_reduce", tensor.dtype, 2 * self._ring * tensor.nbytes)
        return CompletedWork()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        check_all_gather(output, input, self.size)
        self._add("all_gather", output.dtype, self._ring * output.nbytes)
        if _real(output) and _real(input):
            with torch.no_grad():
                output.view(self.size, -1).copy_(input.reshape(1, -1))
        return CompletedWork()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False):
        check_reduce_scatter(output, input, self.size)
        ReduceOp(op)
        self._add("reduce_scatter", input.dtype, self._ring * input.nbytes)
        if _real(output) and _real(input):
            with torch.no_grad():
                output.view(-1).copy_(input.reshape(self.size, -1)[self.rank])
        return CompletedWork()

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Optional[Sequence[int]] = None,
                   input_splits: Optional[Sequence[int]] = None, async_op: bool = False):
        check_all_to_all(output, input, output_splits, input_splits, self.size)
        if input_splits is None:
            sent = self._ring * input.nbytes
        else:
            rows = input.shape[0] if input.dim() else 1
            sent = input.nbytes - (input_splits[self.rank] * (input.nbytes // rows) if rows else 0)
        self._add("all_to_all", input.dtype, sent)
        if _real(output) and _real(input) and output.shape == input.shape:
            with torch.no_grad():
                output.copy_(input)
        return CompletedWork()

    def all_to_all_rows(self, output: torch.Tensor, input: torch.Tensor, rows: torch.Tensor,
                        output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False):
        """``all_to_all(output, input[rows], ...)`` without gathering the rows (nothing moves here)."""
        check_rows(output, input, rows, output_splits, input_splits, self.size)
        row_bytes = input.nbytes // input.shape[0] if input.dim() and input.shape[0] else 0
        self._add("all_to_all", input.dtype, (rows.numel() - input_splits[self.rank]) * row_bytes)
        return CompletedWork()

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        self._peer(src)
        self._add("broadcast", tensor.dtype, tensor.nbytes)
        return CompletedWork()

    # -- point to point ----------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._add("send", tensor.dtype, tensor.nbytes, (self._peer(dst),))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._add("recv", tensor.dtype, 0.0, (self._peer(src),))

    def batch_isend_irecv(self, ops: Sequence[P2POp]):
        for op in ops:
            if op.kind == "send":
                self.send(op.tensor, op.peer, op.tag)
            else:
                self.recv(op.tensor, op.peer, op.tag)
        return [CompletedWork() for _ in ops]

    def barrier(self) -> None:
        self._add("barrier", torch.uint8, 0.0)
