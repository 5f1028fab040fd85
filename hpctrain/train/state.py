"""``TrainState``: what a run is, for everything around the training loop.

The trainer builds one ``TrainState`` at set-up and hands it, never itself,
to the code around the loop:

- a checkpointer saves it (``Checkpointer.save(state, path)``) and restores
  it in place (``load(state, path)``: the tensors, the cursor, the extra
  state), returning a ``Restored`` (the path it read, the step, the
  optimizer that saved it). The checkpointing coordinator
  (``hpctrain.train.checkpointing``), not the format, then sets ``step``;
- lifecycle hooks (``hpctrain_on_train_start``, ``hpctrain_step_metrics``,
  ...) read it, with the step and the metrics as arguments of their own;
- axis handles receive it at the step boundary (``AxisHandle.after_update``,
  ``step_metrics``, ``after_training``).

What may change it: the loop (``step``, the tensors through the optimizer),
a checkpoint load (the tensors, the cursor, the ``extra`` objects' state)
and the coordinator (``step`` after a load). Plugins only read it; per-run
state of a plugin lives in its axis handle.

``extra`` holds the loop's small stateful objects by name (fp16's loss
scale as ``"loss_scale"``): each has ``state_dict()`` and
``load_state_dict(dict)`` returning JSON-able values, the same on every
rank; a checkpoint stores ``extra_state()`` beside the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Protocol

import torch
from torch import nn

from hpctrain.data import DataCursor
from hpctrain.mesh import Mesh


class Stateful(Protocol):
    """A small object of the loop a checkpoint keeps (JSON-able state)."""

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


@dataclass(eq=False)
class TrainState:
    """One rank's training state and the context it lives in (see the module docstring)."""

    cfg: Any
    """The resolved run config (the same on every rank)."""
    mesh: Mesh
    """The layout: axis sizes, this rank's coordinates, the groups."""
    device: torch.device
    model: nn.Module
    """What this rank runs: the whole model, a pipeline stage, or an interleaved rank's chunks; every
    parameter carries its ShardSpec (``hpctrain_spec``)."""
    optimizer: torch.optim.Optimizer
    """This rank's optimizer; ``optimizer.state`` maps each parameter to its state (a ZeRO optimizer
    answers ``state_spec`` for state not shaped like its parameter, ``hpctrain.checkpoint``)."""
    cursor: DataCursor
    """The global data cursor (``state_dict`` / ``load_state_dict``), independent of the layout."""
    handles: Mapping[str, Any] = field(default_factory=dict)
    """The layout's axis implementations, by axis: ``hpctrain.parallel.handles.AxisHandle`` (typed loosely:
    the handles' methods take a TrainState, and the import graph stays without a cycle)."""
    run_dir: Optional[str] = None
    """The run's directory (rank 0 writes there), None for runs without one (tests, tools)."""
    step: int = 0
    """Optimizer steps taken (the LR schedule is a pure function of it)."""
    extra: Dict[str, Stateful] = field(default_factory=dict)
    """The loop's small stateful objects by name (``"loss_scale"`` with fp16)."""

    def extra_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of ``extra``: ``{name: state_dict()}``."""
        return {name: obj.state_dict() for name, obj in self.extra.items()}

    def load_extra_state(self, saved: Mapping[str, Any]) -> None:
        """Put back what ``extra_state`` gave; an object the checkpoint has no entry for (an older file, an
        fp32 run's checkpoint resumed in fp16) keeps its fresh state."""
        for name, obj in self.extra.items():
            if name in saved:
                obj.load_state_dict(saved[name])
