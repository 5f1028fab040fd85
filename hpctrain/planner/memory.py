"""Model-state memory: parameters, gradients and optimizer state per GPU.

ZeRO (Rajbhandari et al. 2020) shards these over the Nd ranks that hold the
same weights. With w, g, K bytes per parameter for weights, gradients and
optimizer state:

    stage 0: (w + g + K) * P          stage 2: w * P + (g + K) * P / Nd
    stage 1: (w + g) * P + K * P / Nd  stage 3: (w + g + K) * P / Nd

Two byte profiles, because the paper and our trainer keep different copies:

- ``ZERO_PAPER`` (w=2, g=2, K=12): fp16 weights and gradients, fp32 master
  weights + Adam moments in the optimizer (the paper's 16 bytes/parameter).
- ``HPCTRAIN`` (w=4, g=4, K=8): our trainer keeps fp32 weights (bf16 runs
  autocast; the bf16 weight copies autocast saves for backward are counted
  with activations), fp32 gradients, and AdamW's two fp32 moments; torch's
  AdamW also keeps a 4-byte ``step`` tensor per parameter tensor. Also 16
  bytes per parameter, split differently, which changes what each stage saves.
  At stage 1 our ZeRO plugin keeps the reduce-scatter's output (g * P / Nd)
  next to the whole accumulated gradient, so its stage-1 gradients are
  g * P * (1 + 1 / Nd); at stage 3 the fp32 parameters are the masters.
  ``plugins/hpctrain_zero/memory.py`` has the plugin's exact table (padding
  included); tests/mpi/test_zero.py checks the two agree on the tiny model.

GB is 1e9 bytes everywhere in the planner (as in the ZeRO table).
"""
from __future__ import annotations

from dataclasses import dataclass

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter held for weights, gradients and optimizer state."""

    weights: float
    grads: float
    optimizer: float
    optimizer_per_tensor: float = 0.0
    """Extra optimizer bytes per parameter tensor (torch AdamW's ``step``)."""
    name: str = ""
    stage1_keeps_shard: bool = False
    """Stage 1 holds the reduced gradient shard apart from the whole gradient."""

    @property
    def per_param(self) -> float:
        return self.weights + self.grads + self.optimizer


ZERO_PAPER = StateBytes(2, 2, 12, 0.0, "mixed-precision Adam, K=12 (ZeRO paper)")
HPCTRAIN = StateBytes(4, 4, 8, 4.0, "hpctrain AdamW: fp32 weights, fp32 grads, 2 fp32 moments", True)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def __add__(self, other: "ModelStates") -> "ModelStates":
        return ModelStates(self.weights + other.weights, self.grads + other.grads, self.optimizer + other.optimizer)


def model_states(params: float, stage: int, shards: int, profile: StateBytes, tensors: int = 0) -> ModelStates:
    """Bytes of ``params`` parameters on one GPU under ZeRO ``stage`` over ``shards`` ranks.

    ``tensors`` (the number of parameter tensors) only matters for stage 0
    with torch's AdamW; sharded optimizers work on flat buffers, whose few
    step counters we ignore.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage}")
    if shards < 1:
        raise ValueError(f"ZeRO needs at least one shard, got {shards}")
    w, g, k = profile.weights * params, profile.grads * params, profile.optimizer * params
    if stage == 0:
        return ModelStates(w, g, k + profile.optimizer_per_tensor * tensors)
    if stage == 1:
        return ModelStates(w, g + (g / shards if profile.stage1_keeps_shard else 0.0), k / shards)
    if stage == 2:
        return ModelStates(w, g / shards, k / shards)
    return ModelStates(w / shards, g / shards, k / shards)


def zero_table_gb(psi: float, nd: int, stage: int) -> float:
    """The ZeRO paper's Table 1 cell: model-state GB per device (paper profile)."""
    return model_states(psi, stage, nd, ZERO_PAPER).total / 1e9
