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

**A loss mask** (chat data: ``MicroBatch.counted``) breaks that equality:
ranks, micro-batches and cp's halves of a sample hold different numbers of
targets that count. The step's loss is then the mean over the counted
targets of the whole global batch, ``N`` of them: ``weigh_masked`` (called
by the trainer before the step's forwards, one all-reduce of one number per
replica over the world) gives each micro-batch the weight ``c * D * n / N``
(``c`` its counted targets on this rank, ``D`` the ranks a gradient is
averaged over, ``n`` the micro-batches), and its mean loss enters the
objective times that weight (``weighted_loss``): after the division by
``n`` and the average over ``D`` the gradient is that of the sum of the
masked losses over ``N``, whatever the layout. A micro-batch with nothing
to count contributes nothing. The loss sum and token count a runner returns
count the counted targets only (``counted_targets``). Auxiliary losses keep
their ``1 / n``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional, Protocol, Sequence, Union

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.data.cursor import MicroBatch
from hpctrain.mesh import AXES, Mesh
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


def counted_targets(mb: MicroBatch) -> int:
    """The targets of ``mb`` the loss counts (all of them without a loss mask)."""
    return mb.targets.numel() if mb.counted is None else int(mb.counted)


def weighted_loss(loss: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """``mb``'s mean loss as it enters the objective (before the division by the micro-batches)."""
    return loss if mb.loss_weight is None else loss * mb.loss_weight


def weigh_masked(microbatches: Sequence[MicroBatch], mesh: Mesh, device: torch.device) -> List[MicroBatch]:
    """The step's micro-batches with their ``loss_weight`` (module docstring); collective over the world.

    Every rank adds its counted targets into its replica's slot (DiLoCo's replicas, ``Mesh.alone_axes``,
    each normalise over their own batch; else one slot); tensor- and pipeline-parallel ranks hold the same
    samples, so a slot is ``N`` times tp x pp."""
    alone = mesh.alone_axes
    slots = torch.zeros(math.prod(mesh.size(a) for a in alone) if alone else 1, dtype=torch.float64, device=device)
    slots[mesh.index_on(alone) if alone else 0] = float(sum(counted_targets(mb) for mb in microbatches))
    mesh.group(AXES).communicator().all_reduce(slots, ReduceOp.SUM)
    total = float(slots[mesh.index_on(alone) if alone else 0]) / (mesh.size("tp") * mesh.size("pp"))
    scale = mesh.averaged_data_size * len(microbatches) / total if total else 0.0
    return [mb._replace(loss_weight=counted_targets(mb) * scale) for mb in microbatches]


def as_step_result(out: Union[StepResult, torch.Tensor, None], microbatches: Sequence[MicroBatch]) -> StepResult:
    """A runner's return value as a StepResult (a mean-loss tensor counts
    every target token of ``microbatches``; None: this rank has no loss)."""
    if isinstance(out, StepResult):
        return out
    if out is None:
        return StepResult(torch.zeros(()), 0)
    tokens = sum(counted_targets(mb) for mb in microbatches)
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
                    objective = with_aux(weighted_loss(loss, mb), aux, mb.loss_weight)
                grads.before_backward(i, n)
                (objective / n).backward()
            count = counted_targets(mb)
            part = loss.detach().float() * count
            total = part if total is None else total + part
            tokens += count
        return StepResult(total if total is not None else torch.zeros(()), tokens)
