"""Bytes on the wire: every group's communicator is wrapped in a
``CountingCommunicator`` (``Mesh.attach_backends`` does it), so each
backend, a third party's included, is counted the same way.

Counts follow the nccl-tests *bus bytes* convention: what one rank sends on
a ring algorithm, so the figure is comparable across group sizes and with
the planner's alpha-beta model. With ``S`` the op's size in bytes and ``n``
the group size:

- ``all_reduce``: ``S`` = the tensor; ``2 (n-1)/n x S``;
- ``all_gather``: ``S`` = the gathered output; ``(n-1)/n x S``;
- ``reduce_scatter``: ``S`` = the input; ``(n-1)/n x S``;
- ``all_to_all``: what this rank sends to the others (``(n-1)/n x S`` for
  equal splits of an ``S``-byte input);
- ``broadcast``: ``S``;
- ``send`` and the sends of ``batch_isend_irecv``: the bytes sent (a
  point-to-point byte is counted once, by its sender).

Counting happens when an operation is issued (asynchronous ones included);
a call that raises before anything moves is not counted.

The wrapper also numbers each collective and records on the mesh's
``OpBoard`` when this rank blocks in one (``hpctrain.comm.watch``), which
is what the hang watchdog reads.

Every operation is an eager island under ``trainer.compile``
(``hpctrain.eager``): a graph break, never traced.
"""
from __future__ import annotations

from time import monotonic
from typing import Any, Dict, List, Optional, Sequence

import torch

from hpctrain.comm.protocol import Communicator, P2POp, ReduceOp, Work, WrappedCommunicator, all_to_all_rows
from hpctrain.comm.watch import OpBoard, Waiting, WatchedWork
from hpctrain.eager import eager

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")


class CommCounter:
    """Bus bytes and calls of one communicator, in total and per op."""

    __slots__ = ("bytes", "calls", "per_op")

    def __init__(self) -> None:
        self.bytes = 0.0
        self.calls = 0
        self.per_op = [0.0] * len(OPS)
        """Bytes by op, in the order of ``OPS``."""

    def add(self, op: int, nbytes: float) -> None:
        self.bytes += nbytes
        self.calls += 1
        self.per_op[op] += nbytes

    @property
    def by_op(self) -> Dict[str, float]:
        return {name: b for name, b in zip(OPS, self.per_op) if b}


_AR, _AG, _RS, _A2A, _BC, _SEND = range(len(OPS))


class CountingCommunicator(WrappedCommunicator):
    """A Communicator that counts bus bytes, then delegates to ``inner``.

    Attributes it does not define (``group``, backend-specific ones) are the
    inner communicator's; ``inner`` is the wrapped object itself. The hot
    paths are written flat (bound methods kept, ``nbytes`` read once): the
    wrapper sits in front of every collective of training.
    """

    def __init__(self, inner: Communicator, board: Optional[OpBoard] = None, group: str = "?",
                 members: Sequence[int] = ()):
        super().__init__(inner)
        self.board = board if board is not None else OpBoard()
        self.group_name = group
        self.members = tuple(members)
        """World ranks of the group, in group-rank order."""
        self.counter = CommCounter()
        n = inner.size
        self._ring = (n - 1) / n if n else 0.0
        self._ring2 = 2 * self._ring
        self._all_reduce = inner.all_reduce
        self._all_gather = inner.all_gather
        self._reduce_scatter = inner.reduce_scatter

    def __repr__(self) -> str:
        return f"Counting({self.inner!r})"

    def _run(self, name: str, call, async_op: bool) -> Work:
        """Issue collective ``name`` (numbered); a blocking one is recorded as a wait."""
        board, group = self.board, self.group_name
        seq = board.issued.get(group, 0) + 1  # OpBoard.issue, inlined: this runs on every collective
        board.issued[group] = seq
        board.last_op = (name, group, seq)
        if async_op:
            return WatchedWork(call(), board, name, group, seq, self.members)
        outer = board.waiting
        board.waiting = Waiting(name, group, seq, self.members, monotonic())
        try:
            return call()
        finally:
            board.waiting = outer

    def _p2p(self, name: str, peer: int, call):
        board = self.board
        board.last_op = (name, self.group_name, None)
        with board.blocked(name, self.group_name, None, (self.members[peer],) if self.members else ()):
            return call()

    @eager
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work:
        work = self._run("all_reduce", lambda: self._all_reduce(tensor, op, async_op), async_op)
        self.counter.add(_AR, self._ring2 * tensor.nbytes)
        return work

    @eager
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        work = self._run("all_gather", lambda: self._all_gather(output, input, async_op), async_op)
        self.counter.add(_AG, self._ring * output.nbytes)
        return work

    @eager
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False) -> Work:
        work = self._run("reduce_scatter", lambda: self._reduce_scatter(output, input, op, async_op), async_op)
        self.counter.add(_RS, self._ring * input.nbytes)
        return work

    @eager
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Optional[Sequence[int]] = None,
                   input_splits: Optional[Sequence[int]] = None, async_op: bool = False) -> Work:
        work = self._run("all_to_all", lambda: self.inner.all_to_all(output, input, output_splits, input_splits,
                                                                      async_op), async_op)
        total = input.nbytes
        if input_splits is None:
            sent = self._ring * total
        else:
            rows = input.shape[0] if input.dim() else 1
            own = input_splits[self.rank] * (total // rows) if rows else 0
            sent = total - own
        self.counter.add(_A2A, sent)
        return work

    @eager
    def all_to_all_rows(self, output: torch.Tensor, input: torch.Tensor, rows: torch.Tensor,
                        output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False) -> Work:
        work = self._run("all_to_all", lambda: all_to_all_rows(self.inner, output, input, rows, output_splits,
                                                                input_splits, async_op), async_op)
        row_bytes = input.nbytes // input.shape[0] if input.dim() and input.shape[0] else 0
        self.counter.add(_A2A, (rows.numel() - input_splits[self.rank]) * row_bytes)
        return work

    @eager
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work:
        work = self._run("broadcast", lambda: self.inner.broadcast(tensor, src, async_op), async_op)
        self.counter.add(_BC, tensor.nbytes)
        return work

    @eager
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._p2p("send", dst, lambda: self.inner.send(tensor, dst, tag))
        self.counter.add(_SEND, tensor.nbytes)

    @eager
    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._p2p("recv", src, lambda: self.inner.recv(tensor, src, tag))

    @eager
    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> List[Work]:
        works = self.inner.batch_isend_irecv(ops)
        sent = sum(op.tensor.nbytes for op in ops if op.kind == "send")
        if sent:
            self.counter.add(_SEND, sent)
        if len(works) != len(ops) or not self.members:
            return works
        self.board.last_op = ("p2p", self.group_name, None)
        return [WatchedWork(w, self.board, op.kind, self.group_name, None, (self.members[op.peer],))
                for w, op in zip(works, ops)]

    @eager
    def barrier(self) -> None:
        self._run("barrier", self.inner.barrier, False)


def unwrap(comm: Any) -> Any:
    """The backend's own communicator under a counting wrapper (or ``comm``)."""
    return comm.inner if isinstance(comm, CountingCommunicator) else comm
