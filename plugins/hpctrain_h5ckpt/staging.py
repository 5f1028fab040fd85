"""Staging: the copy of a save's owned boxes to host memory, in the save
call or overlapped with the next training step.

An async save must hold its own copy of the state it writes, because the
next optimizer step changes the tensors in place. ``checkpoint.hdf5.staging``
says when that copy happens:

- ``blocking``: ``save()`` copies before it returns, so the step waits for a
  memcpy of this rank's owned state (docs/checkpointing.md, "Measured").
- ``overlap`` (the default): ``save()`` only records which tensors to copy;
  the copy runs on the background saver's thread while the next forward and
  backward run (they read parameters and optimizer state, never write
  them), and the trainer calls ``Checkpointer.before_update()`` right before
  the optimizer step, which waits until the copy is done (torchtitan waits
  for its pinned-memory staging at the same point). On a GPU the
  copy is a device-to-host transfer on its own CUDA stream into pinned
  buffers, done by the copy engine beside the compute kernels. On a
  CPU-only node the copy shares the cores with the forward and backward: the
  step no longer waits for it, but runs slower by about the copy's CPU time
  (``hpctrain-bench ckpt`` reports both).

What keeps the copy consistent: the checkpointer also registers
``before_update`` as a step pre-hook on a torch optimizer
(``register_step_pre_hook``), so even a training loop that never calls it
cannot step the optimizer during the copy. Beyond that, a best-effort
guard: each tensor's version counter (``Tensor._version``, bumped by
in-place changes autograd sees; shared with the alias kept here) is
recorded by ``save()`` and checked once the copy is done, and a change
fails the save with an error that says so, committing nothing. It cannot
see writes through ``.data`` or a raw buffer (numpy view, MPI receive), nor
an in-place op still running when the copy ends (a ``_foreach_`` op bumps
the counters only when the whole list is done).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.layout import Box
from hpctrain_h5ckpt.snapshot import Data, StateView, host_copy
from hpctrain_h5ckpt.writer import Owned


class HostBuffers:
    """Host copies of the owned boxes, kept from one async save to the next.

    Allocating fresh memory each save makes the copy pay a page fault per
    4 KiB; reusing the buffers leaves a plain memcpy. Safe because a save
    starts only after the previous one has finished writing. Costs one host
    copy of this rank's owned state for the life of the checkpointer.
    """

    def __init__(self) -> None:
        self._bufs: Dict[Tuple[str, Box], torch.Tensor] = {}

    def get(self, path: str, box: Box, like: Data) -> Optional[torch.Tensor]:
        if not isinstance(like, torch.Tensor):
            return None
        buf = self._bufs.get((path, box))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.device.type == "cuda")
            self._bufs[(path, box)] = buf
        return buf


class Stager:
    """The boxes this rank owns, captured in the training thread by ``save()``;
    ``copy()`` (on any thread) returns them in host memory.

    ``buffers=None``: no copy where none is needed (a synchronous save of CPU
    tensors writes from the tensors themselves, which training cannot change
    before ``save()`` returns).
    """

    def __init__(self, view: StateView, owned: Dict[str, List[Box]], buffers: Optional[HostBuffers]):
        self.buffers = buffers
        self.items: List[Tuple[str, Box, Data, int]] = []
        for path, boxes in owned.items():
            held = view.boxes[path]
            for box in boxes:
                data, version = view.data[path][held.index(box)], 0
                if isinstance(data, torch.Tensor):
                    # an alias of today's storage (survives a ``p.data = ...`` swap);
                    # it shares the tensor's version counter
                    data = data.detach()
                    version = data._version
                self.items.append((path, box, data, version))
        # CUDA: the copies must start after the work already queued on the
        # training stream (which produced these values); record that point now
        devices = {d.device for _, _, d, _ in self.items if isinstance(d, torch.Tensor) and d.device.type == "cuda"}
        self._ready = {dev: torch.cuda.current_stream(dev).record_event() for dev in devices}

    @property
    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() if isinstance(d, torch.Tensor) else d.nbytes
                   for _, _, d, _ in self.items)

    def copy(self) -> Owned:
        """The owned boxes in host memory. Runs once; afterwards the Stager
        holds no reference to the training's tensors."""
        buffers = self.buffers
        copy = buffers is not None
        streams = {dev: torch.cuda.Stream(dev) for dev in self._ready}
        out: Owned = {}
        try:
            for dev, stream in streams.items():
                stream.wait_event(self._ready[dev])
            for path, box, data, _ in self.items:
                buf = buffers.get(path, box, data) if buffers is not None else None
                on = streams.get(data.device) if isinstance(data, torch.Tensor) else None
                if on is not None:
                    with torch.cuda.stream(on):
                        arr = host_copy(data, copy, buf, non_blocking=True)
                else:
                    arr = host_copy(data, copy, buf)
                out.setdefault(path, []).append((box, arr))
        finally:
            # also after a failure: queued copies into the reused buffers must end first
            for stream in streams.values():
                stream.synchronize()
        if copy:
            self._check_unchanged()
        self.items = []
        return out

    def _check_unchanged(self) -> None:
        changed = [path for path, _, d, v in self.items if isinstance(d, torch.Tensor) and d._version != v]
        if changed:
            raise CheckpointError(
                f"{len(changed)} tensor(s) changed while an async save was copying them to host memory "
                f"(first: {changed[0]}), so the copy would mix two steps; nothing was committed. The training "
                "loop must call checkpointer.before_update() before the optimizer step (hpctrain's Trainer "
                "does), or use checkpoint.hdf5.staging=blocking")
