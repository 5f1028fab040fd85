"""The step schedule: how one optimizer step's micro-batches are run.

The trainer calls ``schedule.run(...)`` once per step. The default runs
forward and backward per micro-batch and accumulates gradients; a pipeline
plugin returns its own schedule from ``hpctrain_step_schedule`` (1F1B, ...).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Protocol, Sequence, Tuple

import torch


class StepSchedule(Protocol):
    def run(
        self,
        model: torch.nn.Module,
        microbatches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
        hooks: Any,
        autocast: Callable[[], ContextManager],
    ) -> Optional[torch.Tensor]:
        """Forward and backward every micro-batch; gradients are the mean over
        micro-batches. Return this rank's mean loss (detached), or None on
        ranks that do not compute a loss (non-last pipeline stages)."""


class GradAccumulation:
    """Forward then backward per micro-batch (loss scaled by 1/n)."""

    def run(self, model, microbatches, hooks, autocast=contextlib.nullcontext):
        n = len(microbatches)
        total = None
        for i, (inputs, targets) in enumerate(microbatches):
            with autocast():
                loss = model(inputs, targets)
            hooks.hpctrain_before_backward(model=model, microbatch=i, num_microbatches=n)
            (loss / n).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total / n
