"""Stage 3: each unit's parameters are gathered just before they are used
and freed right after.

Between uses a parameter *is* its shard: ``p.data`` is a 1-D view of its
unit's fp32 master chunk (the elements ``FlatGroup.held`` names), which is
what the optimizer updates and the checkpoint saves. To use a unit:

1. ``start`` gives the unit's flat buffer its memory back, copies the
   master chunk (cast to ``param_dtype``) into its slot and starts a
   non-blocking all-gather into it (``FlatGroup`` layout);
2. ``ready`` waits for that gather and points every parameter's data at
   its full-shaped view of the buffer;
3. ``release`` points them back at their shards and frees the buffer's
   memory by resizing its *storage* to nothing.

Each unit keeps the same buffer object (and so the same storage) for the
whole run. That is what makes freeing real: autograd saves, for backward,
views of the weights a forward used (a linear layer keeps ``weight.t()``),
and those views share the buffer's storage. Dropping the buffer would leave
them holding its memory until backward; shrinking the storage frees it, and
the next gather fills the same storage again, so the saved views read the
gathered values when backward needs them (FSDP's technique).

Forward: a pre-forward hook on the unit's first module makes it ready and
starts the next unit's gather (prefetch), so the next all-gather overlaps
this unit's compute; a post-forward hook releases it
(``reshard_after_forward``; the last unit, and units whose parameters later
units share, are kept) and hooks the unit's output so that backward makes
the unit ready again just before its backward runs, prefetching the
previous unit. Once every parameter of the unit has its gradient (hooks
registered after the gradient-sync engine's, which has already taken the
gradient into its bucket), the unit is released. A unit with frozen
parameters (no gradient: LoRA's base weights) may get its trainable ones'
gradients before backward is done with the frozen ones (the input gradient
still needs them), so it is released when backward reaches the previous
unit's output, i.e. has passed it. ``release_all`` frees
whatever is left after backward (parameters no micro-batch used).

Autograd keeps referring to the parameter objects, so swapping ``data``
between shard and full views is what lets a freed unit be used again in
backward (FSDP's flat-parameter technique).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from hpctrain.comm.protocol import Work

from hpctrain_zero.flat import FlatGroup
from hpctrain_zero.units import Unit


@dataclass
class UnitFlats:
    """One unit's flat groups, master chunks and (while gathered) buffers."""

    unit: Unit
    flats: List[FlatGroup]
    masters: List[torch.Tensor]
    """fp32 chunk per flat group (this rank's part)."""
    shapes: List[List[torch.Size]]
    """Full (pre-flat) shape of each parameter, per flat group."""
    keep_after_forward: bool = False
    buffers: List[torch.Tensor] = field(default_factory=list)
    """One per flat group, made once; their storage is empty while the unit is released."""
    gathered: bool = False
    works: List[Work] = field(default_factory=list)
    ready: bool = False
    pending_grads: int = 0
    frozen: bool = False
    """Some parameters are frozen (LoRA's base): released once backward has passed the unit, not by gradients."""


class UnitGatherer:
    """Gathers and frees the units of one model (see the module docstring)."""

    def __init__(self, units: Sequence[UnitFlats], param_dtype: torch.dtype, reshard_after_forward: bool,
                 device: Optional[torch.device] = None):
        self.units = list(units)
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.device = device
        """Where gathered parameters live (the masters may be in host memory: offload=cpu)."""
        self.index = {u.unit.name: i for i, u in enumerate(self.units)}
        self.gathers = 0
        """All-gathers started (tests count them)."""
        self.bytes = 0
        """Bytes of gathered buffers that exist now."""
        self.peak_bytes = 0
        self._handles: List[Any] = []

    # -- the three steps ----------------------------------------------------
    def start(self, u: UnitFlats) -> None:
        """Begin gathering ``u`` (non-blocking); nothing if gathered or in flight."""
        if u.gathered:
            return
        if not u.buffers:
            u.buffers = [torch.empty(fg.total, dtype=self.param_dtype, device=self.device or master.device)
                         for fg, master in zip(u.flats, u.masters)]
        u.works = []
        for fg, master, buf in zip(u.flats, u.masters, u.buffers):
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().nbytes() < nbytes:
                buf.untyped_storage().resize_(nbytes)
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            mine = buf[fg.lo:fg.hi]
            mine.copy_(master, non_blocking=True)  # from pinned host memory with offload=cpu
            u.works.append(fg.group.communicator().all_gather(buf, mine, async_op=True))
        u.gathered = True
        self.gathers += 1

    def ready(self, u: UnitFlats) -> None:
        """``u``'s parameters hold their full values (gathering it now if needed)."""
        for name in u.unit.depends:
            self.ready(self.units[self.index[name]])
        if u.ready:
            return
        self.start(u)
        for work in u.works:
            work.wait()
        u.works = []
        for fg, buf, shapes in zip(u.flats, u.buffers, u.shapes):
            for p, off, numel, shape in zip(fg.params, fg.offsets, fg.numels, shapes):
                p.data = buf[off:off + numel].view(shape)
        u.ready = True

    def release(self, u: UnitFlats) -> None:
        """Back to shards; the gathered buffer's memory is freed (its storage shrunk)."""
        if not u.gathered:
            return
        for work in u.works:  # a prefetch nobody used: finish it before freeing its buffer
            work.wait()
        for fg, master in zip(u.flats, u.masters):
            for i, p in enumerate(fg.params):
                p.data = master[fg.shard_slice(i)]
        for buf in u.buffers:
            self.bytes -= buf.numel() * buf.element_size()
            buf.untyped_storage().resize_(0)
        u.works, u.ready, u.gathered = [], False, False

    def release_all(self) -> None:
        for u in self.units:
            self.release(u)

    # -- hooks ----------------------------------------------------------------
    def install(self) -> None:
        """Forward and gradient hooks on every unit (see the module docstring)."""
        shared = {name for u in self.units for name in u.unit.depends}
        for i, u in enumerate(self.units):
            u.keep_after_forward = (not self.reshard_after_forward or i == len(self.units) - 1
                                    or u.unit.name in shared)
            u.frozen = any(not p.requires_grad for fg in u.flats for p in fg.params)
            first, last = u.unit.modules[0], u.unit.modules[-1]
            self._handles.append(first.register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i)))
            self._handles.append(last.register_forward_hook(lambda m, a, out, i=i: self._after_forward(i, out)))
            for fg in u.flats:
                for p in fg.params:
                    if p.requires_grad:  # (a frozen weight gets no gradient: its unit is released by release_all)
                        self._handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._got_grad(i)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _before_forward(self, i: int) -> None:
        u = self.units[i]
        self.ready(u)
        u.pending_grads = sum(p.requires_grad for fg in u.flats for p in fg.params)
        if i + 1 < len(self.units):
            self.start(self.units[i + 1])

    def _after_forward(self, i: int, out: Any) -> None:
        u = self.units[i]
        grads = isinstance(out, torch.Tensor) and out.requires_grad
        if not grads or not u.keep_after_forward:
            self.release(u)
        if grads:
            out.register_hook(lambda g, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self.ready(self.units[i])
        if i > 0:
            self.start(self.units[i - 1])
        if i + 1 < len(self.units) and self.units[i + 1].frozen:  # its backward has reached its input: done
            self.release(self.units[i + 1])

    def _got_grad(self, i: int) -> None:
        # a tied parameter's gradient comes once, after its last use in
        # backward, so its owner unit is released only when both uses are done
        u = self.units[i]
        u.pending_grads -= 1
        if u.pending_grads == 0 and not u.frozen:
            self.release(u)

    def stats(self) -> Dict[str, int]:
        return {"gathers": self.gathers}
