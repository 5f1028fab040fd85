"""The gradient-sync engine: bucketed averaging of ``.grad`` over each
parameter's data group, overlapped with backward. One engine serves data
parallelism, ZeRO (reduce-scatter mode) and pipeline weight passes; plugins
configure it (``GradSync(comm_of, SyncConfig(...))``, ``attach``) and drive it
per step.

Groups. Each parameter is reduced over the communicator ``comm_of(param)``
returns (``None`` or a group of one: not reduced). ``reduction_comm``
derives it from the parameter's ShardSpec: the data axes it is not split on
(``Mesh.reduction_axes``), so dense weights go over ``cp x ep x dp`` and
expert weights (split on ``ep``) over ``cp x dp``. Parameters reduced over
different groups never share a bucket.

Gradients live *in* the buckets. Each bucket is one flat buffer and every
parameter's ``.grad`` is a view into it. A step starts with no gradients
(the trainer's ``zero_grad(set_to_none=True)`` drops the views): autograd
hands each parameter's first gradient over as a new tensor, and its hook
copies it into the view and makes the view the ``.grad``, so later
micro-batches accumulate into the bucket in place. The buffer is never
zeroed first: a zero fill and an add would be two passes over it where one
copy does (docs/benchmarks.md, "hpctrain-bench dp"); the views this rank
gives no gradient are zeroed when their bucket is launched. A bucket is
therefore ready to send the moment its last parameter's post-accumulate-grad
hook fires, and the averaged result is already where the optimizer reads it.
(A later gradient that autograd hands over as a new tensor instead of adding
it in place is copied into its view by the hook the same way, a sparse one
summed into zeros; gradients already present when a step starts are copied
into their views then.)

Per step:
- a step starts at ``begin_microbatch(0, n)``, or at the first gradient hook
  or ``mark_ready`` after ``finish`` (schedules that never announce
  micro-batches);
- syncing: a backward syncs when it is the last announced micro-batch
  (``begin_microbatch(n - 1, n)``), or, when micro-batches are not
  announced, when it runs outside ``no_sync()``. Non-syncing backwards only
  accumulate and note which parameters got a gradient;
- in a syncing backward each hook counts its bucket down; a bucket whose
  count reaches zero is launched (non-blocking) *if every bucket before it
  has been*, so buckets always start in index order on every rank; then the
  next ones that are ready follow. Each hook also pokes the oldest pending
  reduction, so backends that progress only inside their library calls move
  on. The last bucket is reduced with a blocking call even from a hook:
  nothing of backward is left to overlap with it;
- ``mark_ready(param)`` does what the hook does, for a gradient written by
  hand (a zero-bubble pipeline's weight pass accumulating ``.grad``
  itself);
- ``finish`` (after backward) reduces every bucket not launched yet, in
  index order, then waits for the ones in flight.

Buckets of different groups share one index order, the same on every rank
(a function of the parameter order, shapes and groups), so every
communicator sees its collectives in the same order on all its members and
blocking calls cannot deadlock across groups.

Parameters without a gradient. A parameter that no micro-batch of this rank
used never fires its hook, so its bucket (and, launching in order, every
later one) is not launched during backward; ``finish`` launches them. Every
rank therefore issues exactly one reduction per bucket, in the same order,
whatever its data did. The unused gradient contributes zeros. Each bucket
carries one extra element per parameter, 1 if this rank produced its
gradient and 0 if not, averaged with the gradients; a parameter that *no*
rank of its group used gets ``.grad = None``, exactly as in a one-process
run, so the optimizer skips it instead of decaying it with a zero gradient.

Reduce-scatter mode (``SyncConfig.reduce_scatter``, for ZeRO): each bucket
is padded to a multiple of its group size and reduce-scattered; after
``finish``, ``shards()`` gives each bucket's averaged part of the flat
bucket for this rank. Two more options serve ZeRO's stages:

- ``keep_grads=False`` (copy-in): a parameter's ``.grad`` is not a view;
  its hook adds the fresh gradient into the bucket's buffer (made when the
  bucket's first gradient arrives, in ``dtype``: fp32 reduction of bf16
  gradients) and drops ``.grad``; the buffer is released once its
  reduction is done (``release_buffers``). Only the buffers of buckets in
  flight exist, at most ``max_in_flight`` of them: a new one waits for the
  oldest reduction first;
- ``every_microbatch=True``: every backward syncs (ZeRO-2/3 keep no full
  gradient between micro-batches); the micro-batches' averages add up in
  ``shard``, and a micro-batch is completed when the next one begins or in
  ``finish``.

``buckets`` given to ``attach`` replace the planner: each list of
parameters is one bucket (a ZeRO flat group), launched in the order given.
``used_anywhere`` then tells, per bucket and parameter, whether any rank of
its group produced a gradient this step.

All communication goes through the ``Communicator`` protocol (see
``reduction``), so any backend works. On GPU the hooks run on autograd's
device threads; the backend must accept calls from them (NCCL does; an MPI
backend needs ``MPI_THREAD_MULTIPLE``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch

from hpctrain.comm.protocol import Communicator
from hpctrain.errors import CommError
from hpctrain.grad_sync.bucket import Bucket, Reduction
from hpctrain.grad_sync.buckets import given_buckets, plan_buckets
from hpctrain.grad_sync.config import SyncConfig
from hpctrain.grad_sync.reduction import CompressedAverage, PlainAverage, ScatterAverage
from hpctrain.log import get_logger
from hpctrain.mesh import Mesh
from hpctrain.model.build import materialized
from hpctrain.shard import get_spec

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
class ReducedShard:
    """One bucket's result in reduce-scatter mode (``GradSync.shards``)."""

    params: List[torch.nn.Parameter]
    """The bucket's parameters, in its layout's order."""
    shard: torch.Tensor
    """This rank's averaged part of the bucket's padded flat gradient (ZeRO: its owned chunk's)."""
    used_anywhere: List[bool]
    """Per parameter: whether any rank of the group produced its gradient this step (else no gradient at all)."""


@dataclass
class StepTrace:
    """What the engine did in the last step (read by tests and benchmarks)."""

    num_microbatches: int = 0
    hooks_fired: int = 0
    """Gradient hooks that fired in the syncing (last) micro-batch."""
    launches: List[Launch] = field(default_factory=list)

    @property
    def launched_in_backward(self) -> int:
        return sum(1 for x in self.launches if x.in_backward)


def _same_for_all(comm: Communicator) -> Callable[[torch.nn.Parameter], Optional[Communicator]]:
    return lambda p: comm


def reduction_comm(mesh: Mesh) -> Callable[[torch.nn.Parameter], Optional[Communicator]]:
    """``comm_of`` for ``GradSync``: each parameter's data group, from its ShardSpec."""
    def comm_of(p: torch.nn.Parameter) -> Optional[Communicator]:
        group = mesh.group(mesh.reduction_axes(get_spec(p).split_axes))
        return group.communicator() if group.size > 1 else None
    return comm_of


class GradSync:
    """Averages the gradients of the parameters given to ``attach`` (see module doc).

    ``comm``: one Communicator for every parameter, or a function giving
    each parameter's (None: not reduced); ``config``: how (``SyncConfig``).
    """

    def __init__(self, comm: Union[Communicator, Callable[[torch.nn.Parameter], Optional[Communicator]]],
                 config: SyncConfig = SyncConfig()):
        self.comm_of: Callable[[torch.nn.Parameter], Optional[Communicator]] = (
            # (cast: a Communicator here, which the test tells from a function; mypy cannot narrow on hasattr)
            comm if callable(comm) and not hasattr(comm, "all_reduce") else _same_for_all(cast(Communicator, comm)))
        self.config = config
        self.cap_bytes, self.wire_dtype, self.overlap = config.cap_bytes, config.wire_dtype, config.overlap
        self.reduce_scatter = config.reduce_scatter
        self.keep_grads, self.every_microbatch, self.dtype = config.keep_grads, config.every_microbatch, config.dtype
        self.release_buffers = config.release_buffers
        self.max_in_flight = config.max_in_flight
        self.device = config.device
        self.buffer_bytes = 0
        """Bytes of bucket buffers that exist now."""
        self.peak_buffer_bytes = 0
        """The most that existed at once since ``attach`` (copy-in mode: only buckets in flight)."""
        self.buckets: List[Bucket] = []
        self.trace = StepTrace()
        self._ids: Tuple[int, ...] = ()
        self._handles: List[Any] = []  # torch RemovableHandles of the gradient hooks
        self._where: Dict[int, Tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        self._armed = False     # inside a step: hooks active
        self._announced = False  # micro-batches are announced this step (begin_microbatch)
        self._sync = False      # the current backward syncs
        self._no_sync = 0       # depth of no_sync() blocks
        self._next = 0          # first bucket not launched yet
        self._oldest = 0        # first bucket whose reduction may still be pending
        self._microbatch = 0

    # -- set-up ------------------------------------------------------------
    def _reduction(self, bucket: Bucket, buffer: torch.Tensor) -> Reduction:
        if self.reduce_scatter:
            assert bucket.flags is not None and bucket.shard is not None  # reduce-scatter buckets have both
            return ScatterAverage(bucket.comm, buffer, bucket.flags, bucket.shard, accumulate=bucket.synced > 0)
        if self.wire_dtype is None:
            return PlainAverage(bucket.comm, buffer)
        return CompressedAverage(bucket.comm, buffer, self.wire_dtype)

    def attach(self, params: Sequence[torch.nn.Parameter],
               buckets: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None,
               numel_of: Optional[Callable[[torch.Tensor], int]] = None) -> "GradSync":
        """Plan buckets for ``params`` (registration order) and hook them.
        Parameters whose group has one rank are left alone. ``buckets``:
        the buckets themselves, in launch order (each one group's parameters);
        ``numel_of``: gradient sizes that differ from the parameters' (ZeRO-3)."""
        self.detach()
        params = list(params)
        for p in params:
            if not materialized(p):
                raise CommError("gradient sync was asked to reduce meta-device parameters; "
                                "attach it after the model is materialised (the handle's after_materialize)")
        comms = [self.comm_of(p) for p in params]
        keep = [i for i, c in enumerate(comms) if c is not None and c.size > 1]
        synced = [params[i] for i in keep]
        by_key: Dict[Hashable, Communicator] = {id(c): c for c in (comms[i] for i in keep) if c is not None}
        self._ids = tuple(id(p) for p in params)  # we hold the params, so ids stay unique
        self._params = params
        if buckets is None:
            plans = plan_buckets(synced, self.cap_bytes, [id(comms[i]) for i in keep])
        else:
            plans = given_buckets(synced, buckets, [id(comms[i]) for i in keep], numel_of)
        for b, plan in enumerate(plans):
            members = [synced[i] for i in plan.indices]
            if self.device is not None:
                plan = dataclasses.replace(plan, device=self.device)
            self.buckets.append(Bucket(plan, members, by_key[plan.group], self._reduction, self.reduce_scatter,
                                        self.keep_grads, self.dtype or plan.dtype, self._account,
                                        self.release_buffers))
            for s, p in enumerate(members):
                self._where[id(p)] = (b, s)
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, s)))
        log.debug("gradient sync: %d of %d parameters in %d buckets over %d groups (cap %d bytes, wire %s, %s)",
                  len(synced), len(params), len(self.buckets), len(by_key), self.cap_bytes,
                  self.wire_dtype or "native", "reduce-scatter" if self.reduce_scatter else "all-reduce")
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self.buckets, self._ids, self._armed, self._where = [], [], (), False, {}

    def _account(self, nbytes: int) -> None:
        self.buffer_bytes += nbytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)

    # -- per step ------------------------------------------------------------
    def begin_microbatch(self, microbatch: int, num_microbatches: int) -> None:
        """Before micro-batch ``microbatch``'s backward (of ``num_microbatches``)."""
        if microbatch == 0 or not self._armed:
            self._start_step(num_microbatches)
        elif self.every_microbatch:
            self._complete_microbatch()
        self._announced = True
        self._microbatch = microbatch
        self._sync = microbatch == num_microbatches - 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate (for schedules that do not announce micro-batches)."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def _syncing(self) -> bool:
        if self.every_microbatch:
            return True
        return self._sync if self._announced else self._no_sync == 0

    def _start_step(self, num_microbatches: int) -> None:
        """Reset per-step state. Views mode: with no gradient yet (the usual
        ``zero_grad(set_to_none=True)``), nothing: each first gradient is copied
        into its view by its hook (the bucket is not zeroed and then added to);
        with gradients already there, attach every view, holding them or zeros."""
        for bucket in self.buckets:
            grads = [p.grad for p in bucket.params]
            if bucket.keep_grads:
                if any(g is not None for g in grads):
                    for view, g in zip(bucket.views, grads):
                        if g is None:
                            view.zero_()
                        elif g.data_ptr() != view.data_ptr():
                            view.copy_(g)
                    for p, view in zip(bucket.params, bucket.views):
                        p.grad = view
            elif bucket.buffer is not None:  # copy-in, kept between steps
                bucket.buffer.zero_()
            bucket.used = [g is not None for g in grads]
            bucket.synced = 0
            bucket._anywhere = [0.0] * len(bucket.params)
            self._reset_microbatch(bucket)
        self._armed, self._announced, self._sync, self._next, self._oldest, self._microbatch = \
            True, False, False, 0, 0, 0
        self.trace = StepTrace(num_microbatches=num_microbatches)

    @staticmethod
    def _reset_microbatch(bucket: Bucket) -> None:
        bucket.fired = [False] * len(bucket.params)
        bucket.pending = len(bucket.params)
        bucket.done = False

    def _on_grad_ready(self, b: int, s: int, param: torch.nn.Parameter) -> None:
        if not self._armed:
            self._start_step(1)  # a step whose micro-batches are not announced
        bucket = self.buckets[b]
        if bucket.keep_grads:
            view, grad = bucket.views[s], param.grad
            if grad is None:  # marked ready by hand with no gradient written: zeros, sent as such
                param.grad = view.zero_()
            elif grad.is_sparse:  # (a sparse embedding's; no storage to compare) summed into zeros
                param.grad = view.zero_().add_(grad)
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)  # the step's first gradient, or one autograd replaced
                param.grad = view
        elif param.grad is not None:  # copy-in: the buffer holds it from now on
            if bucket.buffer is None:
                self._make_room()
            bucket.slot(s).add_(param.grad.reshape(-1))
            param.grad = None
        bucket.used[s] = True
        if not self._syncing():
            return
        if bucket.fired[s]:
            raise CommError(
                f"gradient sync: a parameter of shape {tuple(param.shape)} got a second gradient in the syncing "
                "backward after its bucket's reduction may have started; call backward once per micro-batch "
                "(announce each with begin_microbatch, or run the others under no_sync())")
        bucket.fired[s] = True
        bucket.pending -= 1
        self.trace.hooks_fired += 1
        if bucket.pending == 0 and self.overlap:
            self._launch_ready()
        self._progress()

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient for this step is complete (written by hand, not by autograd)."""
        where = self._where.get(id(param))
        if where is not None:
            self._on_grad_ready(where[0], where[1], param)

    def _progress(self) -> None:
        """Let the oldest pending reduction move on (see ``reduction``);
        copy-in: a finished one gives its buffer back at once."""
        while self._oldest < self._next:
            bucket = self.buckets[self._oldest]
            if not bucket.done:
                assert bucket.reduction is not None  # launched, so allocated
                if not bucket.reduction.progress():
                    break
            if not bucket.keep_grads:
                bucket.complete()
            self._oldest += 1

    def _make_room(self) -> None:
        """Wait for the oldest reductions in flight while ``max_in_flight`` buffers exist."""
        if self.max_in_flight is None or not self.release_buffers:
            return
        alive = sum(1 for b in self.buckets if b.buffer is not None)
        while alive >= self.max_in_flight and self._oldest < self._next:
            bucket = self.buckets[self._oldest]
            if bucket.buffer is not None:
                bucket.complete()
                alive -= 1
            self._oldest += 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(in_backward=True)

    def _launch(self, in_backward: bool) -> None:
        bucket = self.buckets[self._next]
        bucket.allocate()  # copy-in: a bucket this rank has no gradient for sends zeros
        if bucket.keep_grads:  # views no gradient was written into this step hold the last step's
            for s, used in enumerate(bucket.used):
                if not used:
                    bucket.views[s].zero_()
        assert bucket.flags is not None and bucket.reduction is not None  # made by allocate()
        bucket.flags.copy_(torch.tensor(bucket.used, dtype=bucket.flags.dtype))
        # Non-blocking only while there is backward work left to hide it behind:
        # the last bucket (normally ready when backward is done) and everything
        # reduced after backward use the blocking call, often the faster one.
        last = self._next == len(self.buckets) - 1
        bucket.reduction.start(blocking=last or not in_backward)
        self.trace.launches.append(Launch(self._next, self._microbatch, in_backward, self.trace.hooks_fired))
        self._next += 1

    def _complete_microbatch(self) -> None:
        """Launch what is left, wait for every reduction, release copy-in buffers."""
        while self._next < len(self.buckets):
            self._launch(in_backward=False)
        for bucket in self.buckets:  # second stages, in bucket order on every rank
            if not bucket.done:
                assert bucket.reduction is not None  # launched above
                bucket.reduction.advance()
        for bucket in self.buckets:
            bucket.complete()
            if bucket.used != [True] * len(bucket.params) or not bucket.keep_grads:
                assert bucket.flags is not None  # set by the launch
                bucket._anywhere = [max(a, f) for a, f in zip(bucket._anywhere, bucket.flags.tolist())]
            self._reset_microbatch(bucket)
            if not bucket.keep_grads:
                bucket.used = [False] * len(bucket.params)
        self._next = self._oldest = 0

    def shards(self) -> List[ReducedShard]:
        """Reduce-scatter mode, after ``finish``: each bucket's averaged shard,
        in the order the buckets were given to ``attach`` (or planned)."""
        if not self.reduce_scatter:
            raise CommError("shards() is for reduce-scatter mode; in all-reduce mode the averages are in .grad")
        out = []
        for b in self.buckets:
            assert b.shard is not None  # reduce-scatter buckets have one
            out.append(ReducedShard(b.params, b.shard, b.used_anywhere))
        return out

    def finish(self) -> None:
        """After the last backward: launch what is left, wait for everything."""
        if not self._armed:  # no backward reached a synced parameter this step: take the grads as they are
            self._start_step(1)
        self._sync, self._announced = True, True
        keep = [list(b.used) for b in self.buckets]
        self._complete_microbatch()
        for bucket, used in zip(self.buckets, keep):
            bucket.used_anywhere = [u or a > 0 for u, a in zip(used, bucket._anywhere)]
            if not bucket.keep_grads:
                continue
            for s, p in enumerate(bucket.params):
                # no rank produced it: None, as in one process; another rank did: the average
                p.grad = bucket.views[s] if bucket.used_anywhere[s] else None
        self._armed = self._sync = self._announced = False


