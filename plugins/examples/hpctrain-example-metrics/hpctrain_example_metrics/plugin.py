"""Observer writing an exponential moving average of the loss."""
from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from typing import Any

from hpctrain import hookimpl


@dataclass
class ExampleMetricsConfig:
    """Settings of the example observer."""

    every: int = 0
    """Write a record every N steps; 0 disables the observer."""
    filename: str = "ema_loss.jsonl"
    """File in the run directory."""
    decay: float = 0.9
    """EMA decay of the loss."""


_ema: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()
"""The moving average per run, keyed by the run's TrainState (an observer has no axis handle to keep it in)."""


@hookimpl
def hpctrain_capabilities():
    return {"observer": ["example_metrics"]}


@hookimpl
def hpctrain_config_sections():
    return {"example_metrics": ExampleMetricsConfig}


@hookimpl
def hpctrain_validate(cfg, world_size):
    if cfg.example_metrics.every < 0:
        return [f"example_metrics.every={cfg.example_metrics.every} must be >= 0"]
    return None


@hookimpl
def hpctrain_on_step_end(state, step, metrics):
    opts = state.cfg.example_metrics
    if opts.every <= 0 or state.mesh.world_rank != 0 or state.run_dir is None:
        return
    prev = _ema.get(state)
    ema = metrics["loss"] if prev is None else opts.decay * prev + (1 - opts.decay) * metrics["loss"]
    _ema[state] = ema
    if step % opts.every == 0:
        with open(os.path.join(state.run_dir, opts.filename), "a") as f:
            f.write(json.dumps({"step": step, "ema_loss": ema}) + "\n")
