"""The gradient reducer: bucketed averaging of ``.grad`` over one group,
overlapped with backward.

Gradients live *in* the buckets. Each bucket is one flat buffer and every
parameter's ``.grad`` is a view into it, attached at the start of each step
(``begin_microbatch(0)``; the trainer's ``zero_grad(set_to_none=True)`` drops
the views, so they are re-attached and the buffer zeroed). Autograd then
accumulates into the existing ``.grad`` in place, so a bucket is ready to send
the moment its last parameter's post-accumulate-grad hook fires, and the
averaged result is already where the optimizer reads it: no copy in before the
all-reduce and none back out after. (The price: a gradient that autograd
replaces instead of accumulating, e.g. under ``create_graph=True``, is copied
into its view by the hook.)

Per step:
- micro-batches before the last: hooks only note which parameters got a
  gradient (no communication: "no-sync" accumulation);
- the last micro-batch: each hook counts its bucket down; a bucket whose count
  reaches zero is launched (non-blocking) *if every bucket before it has
  been*, so buckets always start in index order; then the next ones that are
  ready follow. Each hook also pokes the oldest pending reduction, so
  backends that progress only inside their library calls move on. The last
  bucket is reduced with a blocking call even from a hook: nothing of
  backward is left to overlap with it;
- ``finish`` (after backward) reduces every bucket not launched yet, in
  index order, with blocking calls (nothing is left to overlap), then waits
  for the ones in flight.

Parameters without a gradient. A parameter that no micro-batch of this rank
used never fires its hook, so its bucket (and, launching in order, every
later one) is not launched during backward; ``finish`` launches them. Every
rank therefore issues exactly one reduction per bucket, in the same order,
whatever its data did: no deadlock and no mismatched collectives. The
unused gradient contributes zeros. Each bucket carries one extra element per
parameter, 1 if this rank produced its gradient and 0 if not, averaged with
the gradients at no extra collective; a parameter that *no* rank used gets
``.grad = None``, exactly as in a one-process run, so the optimizer skips it
instead of decaying it with a zero gradient.

All communication goes through the ``Communicator`` protocol (see
``reduction``), so any backend works. On GPU the hooks run on autograd's
device threads; the backend must accept calls from them (NCCL does; an MPI
backend needs ``MPI_THREAD_MULTIPLE``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from hpctrain.comm.protocol import Communicator
from hpctrain.errors import CommError
from hpctrain.log import get_logger

from hpctrain_dp.buckets import BucketPlan, plan_buckets
from hpctrain_dp.reduction import CompressedAverage, PlainAverage

log = get_logger(__name__)


@dataclass(frozen=True)
class Launch:
    """One bucket's reduction being issued."""

    bucket: int
    microbatch: int
    """The micro-batch whose backward had just run (or was running)."""
    in_backward: bool
    """Issued from a gradient hook, i.e. while backward was still running."""
    hooks_before: int
    """Gradient hooks of the syncing micro-batch that had fired at that moment."""


@dataclass
class StepTrace:
    """What the reducer did in the last step (read by tests and benchmarks)."""

    num_microbatches: int = 0
    hooks_fired: int = 0
    """Gradient hooks that fired in the syncing (last) micro-batch."""
    launches: List[Launch] = field(default_factory=list)

    @property
    def launched_in_backward(self) -> int:
        return sum(1 for x in self.launches if x.in_backward)


Reduction = Union[PlainAverage, CompressedAverage]


class _Bucket:
    """One bucket's buffer, gradient views, reduction and per-step state."""

    def __init__(self, plan: BucketPlan, params: List[torch.nn.Parameter],
                 reduction_factory: Callable[[torch.Tensor], Reduction]):
        self.plan = plan
        self.params = params
        n = len(params)
        # gradients first, then one "used on this rank" flag per parameter
        self.buffer = torch.zeros(plan.numel + n, dtype=plan.dtype, device=plan.device)
        self.flags = self.buffer[plan.numel:]
        self.views = [self.buffer[o: o + p.numel()].view_as(p) for o, p in zip(plan.offsets, params)]
        self.reduction: Reduction = reduction_factory(self.buffer)
        self.used = [False] * n
        self.fired = [False] * n
        self.pending = n


class GradReducer:
    """Averages the gradients of ``params`` over ``comm``'s group (see module doc)."""

    def __init__(self, comm: Communicator, cap_bytes: int, wire_dtype: Optional[torch.dtype] = None,
                 overlap: bool = True):
        self.comm, self.cap_bytes, self.wire_dtype, self.overlap = comm, cap_bytes, wire_dtype, overlap
        self.buckets: List[_Bucket] = []
        self.trace = StepTrace()
        self._ids: Tuple[int, ...] = ()
        self._handles: List[Any] = []  # torch RemovableHandles of the gradient hooks
        self._armed = False     # inside a step: views attached, hooks active
        self._sync = False      # the current micro-batch is the last one
        self._next = 0          # first bucket not launched yet
        self._oldest = 0        # first bucket whose reduction may still be pending
        self._microbatch = 0

    # -- set-up ------------------------------------------------------------
    def _reduction(self, buffer: torch.Tensor) -> Reduction:
        if self.wire_dtype is None:
            return PlainAverage(self.comm, buffer)
        return CompressedAverage(self.comm, buffer, self.wire_dtype)

    def attach(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Plan buckets for ``params`` (registration order) and hook them."""
        self.detach()
        params = list(params)
        for p in params:
            if p.device.type == "meta":
                raise CommError("data parallelism was asked to reduce meta-device parameters; "
                                "the reducer must be attached after the model is materialised")
        self._ids = tuple(id(p) for p in params)  # we hold the params, so ids stay unique
        for b, plan in enumerate(plan_buckets(params, self.cap_bytes)):
            members = [params[i] for i in plan.indices]
            self.buckets.append(_Bucket(plan, members, self._reduction))
            for s, p in enumerate(members):
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, s)))
        log.debug("data parallel: %d parameters in %d buckets (cap %d bytes, wire %s)", len(params),
                  len(self.buckets), self.cap_bytes, self.wire_dtype or "native")

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self.buckets, self._ids, self._armed = [], [], (), False

    def matches(self, params: Sequence[torch.nn.Parameter]) -> bool:
        return tuple(id(p) for p in params) == self._ids

    # -- per step ------------------------------------------------------------
    def begin_microbatch(self, microbatch: int, num_microbatches: int) -> None:
        """Before micro-batch ``microbatch``'s backward (of ``num_microbatches``)."""
        if microbatch == 0 or not self._armed:
            self._start_step(num_microbatches)
        self._microbatch = microbatch
        self._sync = microbatch == num_microbatches - 1

    def _start_step(self, num_microbatches: int) -> None:
        """Attach the gradient views; zero them unless a gradient is already there."""
        for bucket in self.buckets:
            grads = [p.grad for p in bucket.params]
            if all(g is None for g in grads):
                bucket.buffer.zero_()
            else:
                for view, g in zip(bucket.views, grads):
                    if g is None:
                        view.zero_()
                    elif g.data_ptr() != view.data_ptr():
                        view.copy_(g)
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
            bucket.used = [g is not None for g in grads]
            bucket.fired = [False] * len(bucket.params)
            bucket.pending = len(bucket.params)
        self._armed, self._sync, self._next, self._oldest, self._microbatch = True, False, 0, 0, 0
        self.trace = StepTrace(num_microbatches=num_microbatches)

    def _on_grad_ready(self, b: int, s: int, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self.buckets[b]
        view = bucket.views[s]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # autograd replaced the grad instead of accumulating
            param.grad = view
        bucket.used[s] = True
        if not self._sync:
            return
        if bucket.fired[s]:
            raise CommError(
                f"data parallel: a parameter of shape {tuple(param.shape)} got a second gradient in the last "
                "micro-batch after its bucket's reduction may have started; call backward once per micro-batch "
                "(hpctrain_before_backward must announce each one)")
        bucket.fired[s] = True
        bucket.pending -= 1
        self.trace.hooks_fired += 1
        if bucket.pending == 0 and self.overlap:
            self._launch_ready()
        self._progress()

    def _progress(self) -> None:
        """Let the oldest pending reduction move on (see ``reduction``)."""
        while self._oldest < self._next and self.buckets[self._oldest].reduction.progress():
            self._oldest += 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(in_backward=True)

    def _launch(self, in_backward: bool) -> None:
        bucket = self.buckets[self._next]
        bucket.flags.copy_(torch.tensor(bucket.used, dtype=bucket.flags.dtype))
        # Non-blocking only while there is backward work left to hide it behind:
        # the last bucket (normally ready when backward is done) and everything
        # reduced after backward use the blocking call, often the faster one.
        last = self._next == len(self.buckets) - 1
        bucket.reduction.start(blocking=last or not in_backward)
        self.trace.launches.append(Launch(self._next, self._microbatch, in_backward, self.trace.hooks_fired))
        self._next += 1

    def finish(self) -> None:
        """After the last backward: launch what is left, wait for everything."""
        if not self._armed:  # no hpctrain_before_backward this step: take the grads as they are
            self._start_step(1)
        self._sync = True
        while self._next < len(self.buckets):
            self._launch(in_backward=False)
        for bucket in self.buckets:  # second stages, in bucket order on every rank
            bucket.reduction.advance()
        for bucket in self.buckets:
            bucket.reduction.finish()
        for bucket in self.buckets:
            if all(bucket.used):
                continue
            anywhere = bucket.flags.tolist()
            for s, p in enumerate(bucket.params):
                if not bucket.used[s] and anywhere[s] == 0:
                    p.grad = None  # no rank produced it: as in one process
        self._armed = self._sync = False
