"""What an axis implementation gives back to the core.

A plugin that implements a mesh axis answers ``hpctrain_parallelize`` with a
handle: the model this rank runs after the axis's transform (``model``),
and the explicit methods the core calls at fixed points of the run. The
core holds the handles; a plugin keeps its per-run state in its handle,
never on the model, and never reads another plugin's handle or config.

- ``AxisHandle`` (every axis): ``after_materialize`` once the weights are
  real (attach gradient hooks, make buffers); at the step boundary, on
  every rank in axis order, ``after_update`` (after an optimizer step that
  was not skipped: update what is not a gradient, e.g. MoE's router
  biases), ``step_metrics`` (the step's metrics of the axis) and, once,
  ``after_training``. These receive the run's ``TrainState``
  (``hpctrain.train.state``) and may use collectives.
- ``DataHandle`` (the data axes, ``dp`` standing for ``cp x ep x dp``): how
  gradients are reduced. The step schedule calls ``before_backward``,
  ``no_sync`` and ``mark_ready`` while it runs the micro-batches;
  ``finalize_grads`` calls ``reduce_gradients`` after the last backward and
  ``gradients_of`` for the tensors that hold a parameter's gradient (a ZeRO
  shard's, or the parameter's own); ``make_optimizer`` may shard the
  optimizer's state.
- ``PipelineHandle`` (``pp``): the step runner that runs the stages.

``LocalData`` is the data handle of a layout without data parallelism
(gradients stay as backward leaves them).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterable, List, Optional

import torch
from torch import nn

from hpctrain.mesh import Mesh
from hpctrain.shard import get_spec

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState


class AxisHandle:
    """One axis's implementation, as the core sees it (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        """What this rank runs after the axis's transform (the whole model, or a pipeline's stages).
        The data handle may replace it in ``after_materialize`` with a wrapper of the real model
        (forward must then go through the wrapper); the core reads it again afterwards."""

    def after_materialize(self) -> None:
        """The model's parameters now hold their real values (the same
        parameter objects as during ``hpctrain_parallelize``)."""

    def after_update(self, state: "TrainState", step: int) -> None:
        """Optimizer step ``step`` (1-based) updated the weights (not called for a skipped update)."""

    def step_metrics(self, state: "TrainState", step: int) -> Dict[str, float]:
        """This axis's metrics of step ``step``, prefixed with the plugin's name (``{}``: none)."""
        return {}

    def after_training(self, state: "TrainState") -> None:
        """The last step is done (files of the run go to ``state.run_dir`` when it is set)."""


class GradientControl:
    """What a step schedule may do to the gradients' reduction while it runs
    the micro-batches (the data axes' handle implements it)."""

    def before_backward(self, microbatch: int, num_microbatches: int) -> None:
        """Micro-batch ``microbatch`` (of ``num_microbatches``) is about to run its backward."""

    def no_sync(self) -> ContextManager[None]:
        """Backwards run inside only accumulate (a schedule whose backwards interleave)."""
        return contextlib.nullcontext()

    def mark_ready(self, param: nn.Parameter) -> None:
        """``param``'s gradient for this step is complete, written by hand (a weight pass)."""


class DataHandle(AxisHandle, GradientControl):
    """The data axes' implementation: gradient reduction and the optimizer's state."""

    def reduce_gradients(self) -> None:
        """After the step's last backward: every gradient averaged over the
        data axes it is not split on, where the optimizer reads it."""

    def gradients_of(self, params: Iterable[nn.Parameter]) -> List[torch.Tensor]:
        """The tensors that hold each parameter's (reduced) gradient, in
        order, made zero where the rank has none, to be changed in place: the
        parameter's ``.grad``, or a ZeRO shard's."""
        out = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def make_optimizer(self, params: List[nn.Parameter], cfg: Any) -> Optional[torch.optim.Optimizer]:
        """An optimizer over sharded state, or None for the core's optimizer of ``params``."""
        return None


class LocalData(DataHandle):
    """The data handle of a layout with one data rank: nothing to reduce."""


class PipelineHandle(AxisHandle):
    """The pipeline axis's implementation."""

    def step_runner(self) -> Any:
        """The ``StepRunner`` (``hpctrain.train.step_runner``) that runs this rank's stages for a step."""
        raise NotImplementedError


def tied_parameters(model: nn.Module, mesh: Mesh) -> List[nn.Parameter]:
    """Parameters this rank holds that other pipeline stages hold copies of
    (tied embeddings: the first stage's table is the last stage's output
    projection), from their ShardSpecs."""

    if mesh.size("pp") == 1:
        return []
    seen, out = set(), []
    for p in model.parameters():
        # (a frozen table, LoRA's base, has no gradient to sum: both ends leave it out alike)
        if id(p) not in seen and p.requires_grad and len(dict(get_spec(p).held_on).get("pp", ())) > 1:
            seen.add(id(p))
            out.append(p)
    return out
