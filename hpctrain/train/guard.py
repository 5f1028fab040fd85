"""Catching divergence: a non-finite loss or gradient norm, and loss spikes.

Both values are global (one all-reduce over the world gives every rank the
same loss and gradient norm, ``grad_norm.reduce_step``), so every rank makes
the same decision at the same step with no further communication.

``NonFiniteGuard`` runs before the optimizer update (``reliability.nonfinite``):

- ``stop``: raise ``TrainingDiverged`` (exit status 3) naming the step and
  the values; the update is not applied, so the weights, the optimizer state
  and any checkpoint written later (there is none: the run ends) stay finite;
- ``skip``: the update is dropped (gradients discarded; the step, the data
  and the learning-rate schedule still advance, as a loss-scaler's skipped
  step does) and counted; ``reliability.max_skips`` skips in a row stop the
  run as above.

``LossSpikes`` flags a finite loss more than ``reliability.spike_zscore``
standard deviations above the mean of the last ``reliability.spike_window``
finite losses: it is logged and recorded (``loss_spike``), not acted on.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, Optional

from hpctrain.errors import TrainingDiverged

ADVICE = "lower optim.lr, raise optim.warmup_steps, keep optim.grad_clip on, or resume from the last checkpoint"


class NonFiniteGuard:
    def __init__(self, policy: str, max_skips: int):
        self.policy, self.max_skips = policy, max_skips
        self.skipped = 0
        """Steps whose update was dropped, in all."""
        self.in_a_row = 0

    def update_allowed(self, step: int, loss: float, grad_norm: float) -> bool:
        """True: apply the update. False: skip it. Raises when the run must stop."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        what = f"step {step}: loss {loss} and gradient norm {grad_norm}"
        if self.policy == "stop":
            raise TrainingDiverged(f"{what} are not all finite; the run stops before this update "
                                   "(reliability.nonfinite=stop), so the weights and checkpoints stay finite. "
                                   f"{ADVICE}; "
                                   "reliability.nonfinite=skip drops such steps instead")
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_skips:
            raise TrainingDiverged(f"{what} are not all finite, {self.in_a_row} steps in a row "
                                   f"(reliability.max_skips={self.max_skips}); the run stops with the weights "
                                   f"of the last finite step. {ADVICE}")
        return False


class LossSpikes:
    def __init__(self, window: int, zscore: float):
        self.zscore, self.window = zscore, window
        self.recent: Deque[float] = collections.deque(maxlen=window)

    def check(self, loss: float) -> Optional[float]:
        """The loss's z-score when it is a spike, else None; a finite loss that
        is not a spike joins the window (a spike would hide the next one)."""
        if not math.isfinite(loss):
            return None
        z = None
        if len(self.recent) >= max(2, self.window // 2):
            mean, std = statistics.fmean(self.recent), statistics.pstdev(self.recent)
            if std > 0 and (loss - mean) / std > self.zscore:
                z = (loss - mean) / std
        if z is None:
            self.recent.append(loss)
        return z
