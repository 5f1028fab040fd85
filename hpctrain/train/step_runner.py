"""The step runner: how one optimizer step's micro-batches are run.

The trainer calls its ``StepRunner``'s ``run(...)`` once per step. The
default (``GradAccumulation``) runs forward and backward per micro-batch and
accumulates gradients; a pipeline plugin's handle gives its own runner, which
executes a pipeline programme (1F1B, ...; ``hpctrain.pipeline.schedules``).
(The learning-rate curve is ``hpctrain.train.lr_schedule``.)

A runner returns a ``StepResult``: the sum of this rank's per-token losses
and the number of tokens they cover (0 and 0 on ranks that compute no loss,
such as a pipeline's non-last stages). The trainer adds both up over the
mesh, so the logged loss is the global mean whatever the layout.

Gradients: each micro-batch's backward is of its mean token loss (plus the
auxiliary losses, ``hpctrain.model.aux``) divided by the number of
micro-batches; the gradient-sync engine then averages over the data axes.
With the same number of tokens on every data rank (the cursor guarantees
it) that is the gradient of the global mean loss, as in one process.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Protocol, Sequence, Union

import torch

from hpctrain.data.cursor import MicroBatch
from hpctrain.model.aux import collect_aux_losses, with_aux
from hpctrain.parallel.handles import GradientControl


@dataclass
class StepResult:
    """What one step's forward passes computed on this rank."""

    loss_sum: torch.Tensor
    """Sum over this rank's tokens of the language-model loss (detached scalar)."""
    tokens: int
    """Tokens the sum covers."""


class StepRunner(Protocol):
    def run(
        self,
        model: torch.nn.Module,
        microbatches: Sequence[MicroBatch],
        grads: GradientControl,
        autocast: Callable[[], ContextManager],
        forward_only: bool = False,
    ) -> StepResult:
        """Forward and backward every micro-batch (gradients: the mean over
        micro-batches) and return this rank's loss sum and token count;
        ``forward_only`` (validation): forwards alone, no gradient made.
        Call ``grads.before_backward`` before each backward (or run the
        backwards under ``grads.no_sync()``; ``grads.mark_ready`` for a
        gradient written by hand). (Returning a detached mean-loss tensor or
        None, the protocol's first form, still works: see ``as_step_result``.)"""


def as_step_result(out: Union[StepResult, torch.Tensor, None], microbatches: Sequence[MicroBatch]) -> StepResult:
    """A runner's return value as a StepResult (a mean-loss tensor counts
    every target token of ``microbatches``; None: this rank has no loss)."""
    if isinstance(out, StepResult):
        return out
    if out is None:
        return StepResult(torch.zeros(()), 0)
    tokens = sum(mb.targets.numel() for mb in microbatches)
    return StepResult(out.detach().float() * tokens, tokens)


class GradAccumulation:
    """Forward then backward per micro-batch (loss scaled by 1/n)."""

    def run(self, model: torch.nn.Module, microbatches: Sequence[MicroBatch], grads: GradientControl,
            autocast: Callable[[], ContextManager] = contextlib.nullcontext,
            forward_only: bool = False) -> StepResult:
        n = len(microbatches)
        total: Optional[torch.Tensor] = None
        tokens = 0
        for i, mb in enumerate(microbatches):
            if forward_only:  # validation: no graph, no auxiliary losses, the gradients untouched
                with torch.no_grad(), autocast():
                    loss = model(mb.inputs, mb.targets, mb.positions, segments=mb.segments)
            else:
                with autocast(), collect_aux_losses() as aux:
                    loss = model(mb.inputs, mb.targets, mb.positions, segments=mb.segments)
                    objective = with_aux(loss, aux)
                grads.before_backward(i, n)
                (objective / n).backward()
            count = mb.targets.numel()
            part = loss.detach().float() * count
            total = part if total is None else total + part
            tokens += count
        return StepResult(total if total is not None else torch.zeros(()), tokens)
