"""Dynamic loss scaling for ``trainer.precision=fp16``.

fp16 keeps 5 exponent bits: gradients below 2^-24 vanish and values above
65504 overflow. The objective is multiplied by a scale before backward
(``hpctrain.model.aux.objective_scale``, so every schedule and pipeline
stage starts its backward scaled), the finished gradients are divided by it
again, and the scale follows torch's ``GradScaler`` rule
(``trainer.loss_scale``): an overflow multiplies it by ``backoff`` and
drops that step's update; ``growth_interval`` clean steps in a row multiply
it by ``growth``. The weights, their gradients and the optimizer state stay
fp32 (autocast computes in fp16).

Agreement. A rank's overflow (an inf or NaN in any gradient it holds) is
one more value in the all-reduce that already sums the gradient norm
(``grad_norm.reduce_totals``), so every rank learns of any rank's overflow
at no extra collective, skips the same step and lowers the scale alike;
ZeRO shards and pipeline stages need nothing of their own.

Overflow and the non-finite guard (``reliability.nonfinite``). An overflow
at a scale above 1 is the scaler's business, expected a few times early in
a run: the step is skipped, counted in ``loss_scale_skips`` and not passed
to the guard (it neither stops the run nor counts towards
``reliability.max_skips``). Once the scale has come down to 1 or less,
scaling is no longer the cause: a non-finite gradient is then a divergence
and goes to the guard like in fp32 and bf16 (the scale is left as it is). A
non-finite loss always goes to the guard.

Not ``torch.amp.GradScaler`` itself: its overflow check is per rank and per
optimizer (``unscale_`` then ``step``), and a ZeRO rank holds only gradient
shards; the rule is the same (``tests/unit/train/test_loss_scale.py``
replays it against GradScaler).
"""
from __future__ import annotations

from typing import Any, Dict


class DynamicLossScale:
    """The scale and its growth counter (``trainer.loss_scale``)."""

    def __init__(self, cfg: Any):
        self.scale = float(cfg.initial)
        self.growth_interval = int(cfg.growth_interval)
        self.backoff = float(cfg.backoff)
        self.growth = float(cfg.growth)
        self.clean = 0
        """Steps without an overflow since the scale last changed (GradScaler's growth tracker)."""
        self.skipped = 0
        """Steps dropped for an overflow, in all."""

    def handles_overflow(self) -> bool:
        """Whether an overflow now is the scale's doing (skip and back off) rather than a divergence."""
        return self.scale > 1.0

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (the step was dropped: counted
        in ``skipped``), grow after ``growth_interval`` clean steps."""
        if overflow:
            self.scale *= self.backoff
            self.clean = 0
            self.skipped += 1
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale *= self.growth
            self.clean = 0

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "clean": float(self.clean), "skipped": float(self.skipped)}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean = int(state["clean"])
        self.skipped = int(state["skipped"])
