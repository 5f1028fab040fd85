"""How one bucket is averaged over its group: plain, compressed on the
wire, or reduce-scattered (each rank keeps its shard: ZeRO).

Each reduction is split into ``start`` (issued from a backward hook, or
after backward for buckets that were not ready), ``advance`` and ``finish``
(both issued after backward, bucket by bucket in the same order on every
rank), so collectives always match across ranks. ``progress`` lets a
pending operation move on (``Work.is_completed``): backends without a
progress thread (Open MPI's non-blocking collectives) only advance when the
library is entered, so the reducer pokes from each gradient hook.

``PlainAverage``: one ``all_reduce(AVG)`` on the bucket buffer, in the
gradients' dtype; non-blocking when started during backward, blocking when
started after it (nothing is left to overlap with, and a backend's blocking
collective may be the faster algorithm: Open MPI's tuned ``Allreduce`` runs
about twice as fast here as its ``Iallreduce``).

``CompressedAverage``: bf16 or fp16 on the wire, fp32 sums. A backend's
all-reduce on a 16-bit tensor would also *add* in 16 bits (and a ring adds
n-1 times, rounding each time), so instead the reduce-scatter half of a ring
all-reduce is done by hand: the buffer is cast to the wire dtype and cut into
``n`` chunks; ``all_to_all`` gives rank r every rank's chunk r; rank r adds
them in fp32, divides by n, casts back to the wire dtype; ``all_gather``
assembles the result, which is cast back into the fp32 buffer. Bytes on the
wire per rank: 2 x (n-1)/n x 2 bytes per element, half of an fp32 ring
all-reduce; two roundings per element (the gradient, then the mean), each a
relative 2^-8 (bf16) or 2^-11 (fp16), instead of n-1. The second stage can
only start once the first is complete, so it runs after backward; only the
first half overlaps with backward. fp16 overflows above 65504 (the step's
gradient norm then becomes inf); bf16 has fp32's range and is the safer pick.
Every rank receives the same gathered bytes, so replicas stay bit-identical.

``ScatterAverage``: one ``reduce_scatter(AVG)`` of the bucket (padded to a
multiple of the group size) into this rank's shard, plus an all-reduce of
the bucket's few "used on this rank" flags (they must reach every rank, not
one shard's owner). The full buffer keeps this rank's own, unreduced
gradients.
"""
from __future__ import annotations

from typing import Optional

import torch

from hpctrain.comm.protocol import Communicator, ReduceOp, Work


class PlainAverage:
    """Average ``buffer`` over the group with one all-reduce (in place)."""

    def __init__(self, comm: Communicator, buffer: torch.Tensor):
        self.comm, self.buffer = comm, buffer
        self._work: Optional[Work] = None

    def start(self, blocking: bool = False) -> None:
        self._work = self.comm.all_reduce(self.buffer, ReduceOp.AVG, async_op=not blocking)

    def progress(self) -> bool:
        """Poke the pending operation; True when it is complete."""
        return self._work is None or self._work.is_completed()

    def advance(self) -> None:
        return None

    def finish(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class CompressedAverage:
    """Average ``buffer`` over the group with ``wire_dtype`` on the wire and fp32 sums."""

    def __init__(self, comm: Communicator, buffer: torch.Tensor, wire_dtype: torch.dtype):
        self.comm, self.buffer, self.wire_dtype = comm, buffer, wire_dtype
        n = comm.size
        self.chunk = -(-buffer.numel() // n)
        # ``send`` is padded to n equal chunks (zeros in the tail), and once the
        # all_to_all is done it is reused as the all_gather's output.
        self.send = torch.zeros(n * self.chunk, dtype=wire_dtype, device=buffer.device)
        self.recv = torch.empty_like(self.send)
        self.mine = torch.empty(self.chunk, dtype=wire_dtype, device=buffer.device)
        self._work: Optional[Work] = None
        self._stage = 0  # 0 idle, 1 all_to_all issued, 2 all_gather issued

    def start(self, blocking: bool = False) -> None:
        # always non-blocking: the second stage waits for it after backward anyway
        self.send[: self.buffer.numel()].copy_(self.buffer)
        self._work = self.comm.all_to_all(self.recv, self.send, async_op=True)
        self._stage = 1

    def progress(self) -> bool:
        return self._work is None or self._work.is_completed()

    def advance(self) -> None:
        if self._stage != 1:
            return
        assert self._work is not None  # stage 1: the all_to_all was issued
        self._work.wait()
        n = self.comm.size
        total = self.recv.view(n, self.chunk).to(torch.float32).sum(dim=0)
        self.mine.copy_(total.div_(n))
        self._work = self.comm.all_gather(self.send, self.mine, async_op=True)
        self._stage = 2

    def finish(self) -> None:
        self.advance()
        if self._stage == 2:
            assert self._work is not None  # stage 2: the all_gather was issued
            self._work.wait()
            self._work, self._stage = None, 0
            self.buffer.copy_(self.send[: self.buffer.numel()])


class ScatterAverage:
    """Average ``grads`` (numel a multiple of the group size) into this rank's
    part of the flat bucket, and ``flags`` (small) onto every rank.

    ``shard`` (made here when not given) receives the average; with
    ``accumulate`` (a later micro-batch of the same step, ZeRO-2/3) the
    average lands in a scratch tensor and is added to ``shard`` in ``finish``.
    """

    def __init__(self, comm: Communicator, grads: torch.Tensor, flags: torch.Tensor,
                 shard: Optional[torch.Tensor] = None, accumulate: bool = False):
        self.comm, self.grads, self.flags = comm, grads, flags
        size = grads.numel() // comm.size
        self.shard = shard if shard is not None else torch.empty(size, dtype=grads.dtype, device=grads.device)
        self.accumulate = accumulate
        self._out = torch.empty_like(self.shard) if accumulate else self.shard
        self._works: list = []

    def start(self, blocking: bool = False) -> None:
        self._works = [self.comm.reduce_scatter(self._out, self.grads, ReduceOp.AVG, async_op=not blocking),
                       self.comm.all_reduce(self.flags, ReduceOp.AVG, async_op=not blocking)]

    def progress(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def advance(self) -> None:
        return None

    def finish(self) -> None:
        for w in self._works:
            w.wait()
        if self._works and self.accumulate:
            self.shard.add_(self._out)
        self._works = []
