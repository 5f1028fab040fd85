"""Fault injection (``debug.*``): make one rank (``debug.fault_rank``; -1:
every rank) fail in a chosen way at a chosen step, to test (and show) how a
job fails.

Kinds (``debug.fault``):

- ``die``: the rank is killed (SIGKILL), as by the out-of-memory killer;
- ``stall``: its training thread stops for good; the process stays alive
  (its watchdog thread keeps sending heartbeats), like a rank stuck in a
  driver call or a dead-locked data loader;
- ``freeze``: the whole process stops (SIGSTOP), like a node that hangs;
- ``nan``: its loss becomes NaN (the global loss and gradient norm follow);
- ``slow``: every micro-batch forward sleeps ``debug.slow_s`` from that step
  on (a straggler), also in a run resumed after that step;
- ``corrupt``: one of its weights changes after that step's update (silent
  data corruption, which the replica check catches);
- ``overflow``: one of the gradients it holds becomes inf once the step's
  gradients are reduced, as an fp16 overflow seen by one rank
  (``hpctrain.train.loss_scale``: every rank must skip that step).
- ``oom``: its step raises ``torch.cuda.OutOfMemoryError`` before the
  forward (on any device), so the out-of-memory path (the snapshot and the
  error line naming it, ``hpctrain.train.profile``) runs where no GPU is.
- ``save_error``: its part of the persistent save after that step fails
  with an I/O error while it is copied (in the background with
  ``checkpoint.async_save``), as on a broken file system; the ranks agree on
  it inside the save, as on a real failure (the checkpoint format asks
  ``save_error``; ``hpctrain.train.save_failures`` does the rest);
- ``local_save_error``: its node-local save after that step fails with an
  I/O error as it writes its file (``hpctrain.localckpt``).

``debug.fault_at=checkpoint`` fires die, stall and freeze just before the
checkpoint save after the step instead, so the other ranks are waiting
inside the save's collectives.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, List

import torch

from hpctrain.log import get_logger

log = get_logger(__name__)


class FaultInjector:
    """The ``debug`` section, for this rank."""

    def __init__(self, debug: Any, world_rank: int):
        self.kind = str(debug.fault)
        self.step = int(debug.fault_step)
        self.at = str(debug.fault_at)
        self.slow_s = float(debug.slow_s)
        self.mine = self.kind != "none" and int(debug.fault_rank) in (world_rank, -1)
        self._slowed = False

    def _fire(self, what: str) -> None:
        log.warning("debug.fault=%s: injecting it now (%s)", self.kind, what)
        for h in logging.getLogger("hpctrain").handlers:
            h.flush()
        if self.kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "stall":
            while True:
                time.sleep(3600)

    def before_step(self, step: int, modules: List[torch.nn.Module]) -> None:
        """At the start of ``step`` (1-based), before its forward."""
        if not self.mine:
            return
        if self.kind == "slow":  # from that step on, also in a run resumed past it
            if step >= self.step and not self._slowed:
                self._slowed = True
                for m in modules:
                    m.register_forward_pre_hook(lambda *_: time.sleep(self.slow_s))
            return
        if step != self.step:
            return
        if self.kind in ("die", "stall", "freeze") and self.at == "step":
            self._fire(f"step {step}")
        elif self.kind == "oom":
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (debug.fault=oom in step {step}). "
                                              "Tried to allocate 2.00 GiB.")

    def loss_scale(self, step: int) -> float:
        """What this rank's summed loss is multiplied by (NaN for a nan fault)."""
        return float("nan") if self.mine and self.kind == "nan" and step == self.step else 1.0

    def after_finalize(self, step: int, grads: List[torch.Tensor]) -> None:
        """Once ``step``'s gradients are reduced (before the norm): an overflow fault."""
        held = [g for g in grads if g.numel()]  # (a ZeRO rank may hold an empty shard)
        if self.mine and self.kind == "overflow" and step == self.step and held:
            log.warning("debug.fault=overflow: making a gradient inf at step %d", step)
            with torch.no_grad():
                held[0][(0,) * held[0].dim()] = float("inf")

    def after_update(self, step: int, params: List[torch.nn.Parameter]) -> None:
        if self.mine and self.kind == "corrupt" and step == self.step and params:
            with torch.no_grad():
                params[0].view(-1)[0] += 1e-3

    def save_error(self, step: int, tier: str) -> bool:
        """Whether this rank's save of ``tier`` (``persistent`` or ``local``) after ``step`` is to fail."""
        kind = {"persistent": "save_error", "local": "local_save_error"}[tier]
        return self.mine and self.kind == kind and step == self.step

    def before_checkpoint(self, step: int) -> None:
        if self.mine and self.at == "checkpoint" and step == self.step and self.kind in ("die", "stall", "freeze"):
            self._fire(f"before the checkpoint save after step {step}")
