"""One bucket of the gradient-sync engine: its flat buffer, the gradient
views into it, its reduction and its per-step state (``engine``)."""
from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch

from hpctrain.comm.protocol import Communicator
from hpctrain.grad_sync.buckets import BucketPlan
from hpctrain.grad_sync.reduction import CompressedAverage, PlainAverage, ScatterAverage

Reduction = Union[PlainAverage, CompressedAverage, ScatterAverage]


class Bucket:
    """One bucket's buffer, gradient views, reduction and per-step state."""

    def __init__(self, plan: BucketPlan, params: List[torch.nn.Parameter], comm: Communicator,
                 reduction_factory: Callable[["Bucket", torch.Tensor], Reduction], scatter: bool,
                 keep_grads: bool, dtype: torch.dtype, account: Callable[[int], None], release: bool):
        self.plan = plan
        self.params = params
        self.comm = comm
        self.keep_grads = keep_grads
        self.dtype = dtype
        self._factory = reduction_factory
        self._account = account
        self._release = release and not keep_grads
        n = len(params)
        # reduce-scatter mode: gradients padded to a multiple of the group
        # size, flags apart (they are all-reduced); otherwise gradients then
        # one "used on this rank" flag per parameter, in one all-reduce
        self.grads_numel = -(-plan.numel // comm.size) * comm.size if scatter else plan.numel
        self.scatter = scatter
        self.shard: Optional[torch.Tensor] = (
            torch.zeros(self.grads_numel // comm.size, dtype=dtype, device=plan.device) if scatter else None)
        """Reduce-scatter mode: this rank's averaged part of the padded flat bucket."""
        self.flags = torch.zeros(n, dtype=dtype, device=plan.device) if scatter else None
        self.buffer: Optional[torch.Tensor] = None
        self.views: List[torch.Tensor] = []
        self.reduction: Optional[Reduction] = None
        self.synced = 0
        """Reductions completed this step (copy-in and every-micro-batch modes accumulate after the first)."""
        self.done = False
        """This micro-batch's reduction is finished (and, copy-in, its buffer released)."""
        if keep_grads:
            self.allocate()
        self.used = [False] * n
        self.fired = [False] * n
        self.pending = n
        self.used_anywhere = [True] * n
        """After ``finish``: whether any rank of the group produced each parameter's gradient."""
        self._anywhere = [0.0] * n

    def allocate(self) -> torch.Tensor:
        """The buffer (zeros), made now if it does not exist."""
        if self.buffer is None:
            extra = 0 if self.scatter else len(self.params)
            self.buffer = torch.zeros(self.grads_numel + extra, dtype=self.dtype, device=self.plan.device)
            self._account(self.buffer.numel() * self.buffer.element_size())
            if not self.scatter:
                self.flags = self.buffer[self.grads_numel:]
            if self.keep_grads:
                self.views = [self.buffer[o: o + p.numel()].view_as(p)
                              for o, p in zip(self.plan.offsets, self.params)]
        if self.reduction is None:
            self.reduction = self._factory(self, self.buffer)
        return self.buffer

    def slot(self, s: int) -> torch.Tensor:
        """Parameter ``s``'s place in the buffer (flat)."""
        o = self.plan.offsets[s]
        end = self.plan.offsets[s + 1] if s + 1 < len(self.params) else self.plan.numel
        return self.allocate()[o:end]

    def complete(self) -> None:
        """Finish the reduction; copy-in: drop the buffer (unless it is kept between steps)."""
        if self.done:
            return
        assert self.reduction is not None and self.buffer is not None  # made by allocate()
        self.reduction.advance()
        self.reduction.finish()
        self.done = True
        self.synced += 1
        if not self.keep_grads:
            self.reduction = None  # the next one (accumulating) is made with the next buffer use
        if self._release:
            self._account(-self.buffer.numel() * self.buffer.element_size())
            self.buffer = None
