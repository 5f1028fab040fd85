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

``sharded_states`` is the one table, in elements of flat groups (padded to
their group size, as the ZeRO plugin cuts them, or unpadded as the planner
estimates): the plugin's memory log and the planner's estimate both call
it, and ``zero_in_flight`` is the one rule for what ZeRO-2/3 hold on top
while a step runs. tests/mpi/test_zero.py checks the plugin's tensors hold
exactly that on the tiny model.

GB is 1e9 bytes everywhere in the planner (as in the ZeRO table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hpctrain.optimizers.kinds import state_bytes_per_element

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


def optimizer_profile(name: str, muon_share: float = 1.0) -> StateBytes:
    """``HPCTRAIN``'s fp32 weights and gradients with ``optim.name``'s state
    (``hpctrain.optimizers.kinds.state_bytes_per_element``): AdamW and LAMB
    8 bytes per parameter plus a ``step`` tensor per tensor, LARS 4 (one
    momentum), Muon 4 on its hidden matrices (``muon_share`` of the
    parameters, ``Arch.muon_share``) and AdamW's 8 on the rest. The share is
    the model's average: the stage holding the embedding keeps a little more."""
    if name == "adamw":
        return HPCTRAIN
    per_tensor = 0.0 if name == "lars" else 4.0
    what = {"lamb": "2 fp32 moments", "lars": "1 fp32 momentum",
            "muon": f"1 fp32 momentum on {muon_share:.0%} (matrices), 2 moments on the rest"}[name]
    return StateBytes(4, 4, state_bytes_per_element(name, muon_share), per_tensor,
                      f"hpctrain {name.upper() if name != 'muon' else 'Muon'}: fp32 weights, fp32 grads, {what}", True)


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


def sharded_states(stage: int, padded: float, chunk: float, unsharded: float, param_bytes: float,
                   grad_bytes: float, optimizer_bytes: float, master_bytes: float = 0.0,
                   stage1_keeps_shard: bool = True, params_are_masters: bool = True) -> ModelStates:
    """Bytes one rank holds between steps under ZeRO ``stage``, for flat groups of
    ``padded`` elements in all, of which this rank owns ``chunk``, and
    ``unsharded`` elements of parameters with nothing to shard (kept whole,
    4 + 4 + 8 bytes each: fp32 weight, gradient and AdamW's moments).

    ``param_bytes``/``grad_bytes``: an element of the computed parameters and
    of the reduced gradients; ``optimizer_bytes``: the optimizer state per
    owned element (AdamW's two fp32 moments: 8); ``master_bytes``: an fp32
    master copy kept apart when parameters compute in 16 bits (4, else 0).
    Stage 1 keeps the whole gradient and, with ``stage1_keeps_shard``, the
    reduce-scatter's output beside it; stage 3 keeps only owned chunks, whose
    fp32 values are the masters when ``params_are_masters`` (ours), else
    ``param_bytes`` plus the master in the optimizer state (the paper's)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage}")
    whole = ModelStates(4.0 * unsharded, 4.0 * unsharded, 8.0 * unsharded)
    optimizer = optimizer_bytes * chunk
    if stage == 0:
        return whole + ModelStates(param_bytes * padded, grad_bytes * padded, optimizer_bytes * padded)
    if stage == 1:
        grads = grad_bytes * padded + (grad_bytes * chunk if stage1_keeps_shard else 0.0)
        return whole + ModelStates(param_bytes * padded, grads, optimizer + master_bytes * chunk)
    if stage == 2:
        return whole + ModelStates(param_bytes * padded, grad_bytes * chunk, optimizer + master_bytes * chunk)
    if params_are_masters:
        return whole + ModelStates(4.0 * chunk, grad_bytes * chunk, optimizer)
    return whole + ModelStates(param_bytes * chunk, grad_bytes * chunk, optimizer + master_bytes * chunk)


def zero_in_flight(stage: int, grad_bytes: float, param_bytes: float, group_sizes: Sequence[float],
                   unit_sizes: Sequence[float], pipeline: bool, reshard_after_forward: bool = True,
                   whole_gradient: float = 0.0) -> float:
    """Bytes ZeRO-2/3 hold on top of ``sharded_states`` while a step runs.

    Gradient buffers of the flat groups being reduce-scattered: the two
    largest (``group_sizes``, elements; one in flight while the next fills);
    under a pipeline, whose micro-batches' backwards interleave, the stage's
    ``whole_gradient`` (elements) accumulates until the last backward.
    Stage 3's gathered units (``unit_sizes``, elements): the one in use and
    the one prefetched; under a pipeline also the stage's last unit, kept
    gathered for its backward while the next micro-batch's forward gathers;
    every unit without ``reshard_after_forward``."""
    if stage < 2:
        return 0.0
    two = lambda xs: sum(sorted(xs)[-2:])  # noqa: E731
    buckets = whole_gradient * grad_bytes if pipeline else two(group_sizes) * grad_bytes
    if stage < 3:
        return buckets
    units = list(unit_sizes)
    if not reshard_after_forward:
        gathered = sum(units)
    elif pipeline and len(units) > 2:
        gathered = units[-1] + two(units[:-1])
    else:
        gathered = two(units)
    return buckets + gathered * param_bytes


def model_states(params: float, stage: int, shards: int, profile: StateBytes, tensors: int = 0) -> ModelStates:
    """Bytes of ``params`` parameters on one GPU under ZeRO ``stage`` over ``shards`` ranks.

    ``tensors`` (the number of parameter tensors) only matters for stage 0
    with torch's AdamW; sharded optimizers work on flat buffers, whose few
    step counters we ignore.
    """
    if shards < 1:
        raise ValueError(f"ZeRO needs at least one shard, got {shards}")
    states = sharded_states(stage, params, params / shards, 0.0, profile.weights, profile.grads, profile.optimizer,
                            stage1_keeps_shard=profile.stage1_keeps_shard, params_are_masters=False)
    if stage == 0:
        states = states + ModelStates(0.0, 0.0, profile.optimizer_per_tensor * tensors)
    return states


def zero_table_gb(psi: float, nd: int, stage: int) -> float:
    """The ZeRO paper's Table 1 cell: model-state GB per device (paper profile)."""
    return model_states(psi, stage, nd, ZERO_PAPER).total / 1e9
