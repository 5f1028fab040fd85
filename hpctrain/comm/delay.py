"""A Communicator that sleeps before every operation: a slow link on one axis.

``debug.comm_delay_axis`` / ``debug.comm_delay_ms`` wrap the communicator of
every group that spans that axis (``hpctrain.run.backend_factory``), so each
collective, send and receive on it starts ``comm_delay_ms`` later, as on a
congested or high-latency network. It is how the tuner's tests prove that a
measured slow axis changes the ranking (``hpctrain.tune``); nothing else
changes, so a delayed run trains exactly the same model.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch

from hpctrain.comm.protocol import Communicator, P2POp, ReduceOp, Work, WrappedCommunicator, all_to_all_rows


class DelayedCommunicator(WrappedCommunicator):
    """Sleeps ``seconds`` then delegates to ``inner``; other attributes are the inner one's."""

    def __init__(self, inner: Communicator, seconds: float):
        super().__init__(inner)
        self.seconds = float(seconds)

    def __repr__(self) -> str:
        return f"Delayed({self.seconds * 1e3:g} ms, {self.inner!r})"

    def _wait(self) -> None:
        time.sleep(self.seconds)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work:
        self._wait()
        return self.inner.all_reduce(tensor, op, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        self._wait()
        return self.inner.all_gather(output, input, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False) -> Work:
        self._wait()
        return self.inner.reduce_scatter(output, input, op, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Optional[Sequence[int]] = None,
                   input_splits: Optional[Sequence[int]] = None, async_op: bool = False) -> Work:
        self._wait()
        return self.inner.all_to_all(output, input, output_splits, input_splits, async_op)

    def all_to_all_rows(self, output: torch.Tensor, input: torch.Tensor, rows: torch.Tensor,
                        output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False) -> Work:
        self._wait()
        return all_to_all_rows(self.inner, output, input, rows, output_splits, input_splits, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work:
        self._wait()
        return self.inner.broadcast(tensor, src, async_op)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._wait()
        self.inner.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._wait()
        self.inner.recv(tensor, src, tag)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> List[Work]:
        self._wait()
        return self.inner.batch_isend_irecv(ops)

    def barrier(self) -> None:
        self._wait()
        self.inner.barrier()


def delayed(comm: Communicator, axes: Sequence[str], axis: str, ms: float) -> Communicator:
    """``comm`` wrapped when its group spans ``axis`` (size > 1 axes only) and ``ms`` > 0, else ``comm``."""
    if ms <= 0 or axis not in axes:
        return comm
    return DelayedCommunicator(comm, ms / 1e3)
