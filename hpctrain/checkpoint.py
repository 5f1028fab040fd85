"""What a checkpoint format plugin must do (``hpctrain_make_checkpointer``).

The trainer owns *when* (``checkpoint.every``, on demand, at resume); the
plugin owns *how*. A checkpoint holds logical (unsharded) tensors keyed by
ShardSpec.logical_name, so any layout can load any checkpoint; each rank
writes and reads only the pieces it holds (``ShardSpec.pieces``: boxes of
the logical tensor, padding left out, each with a view of the local tensor).

What a checkpointer reads and restores is a ``TrainState``
(``hpctrain.train.state``), never the trainer:
- ``state.model.named_parameters()`` with ``hpctrain_spec`` on each, and
  the model's persistent buffers (with a spec when they carry one);
- ``state.optimizer``: ``optimizer.state`` maps each parameter to its
  state; a state tensor shaped like its parameter shares the parameter's
  ShardSpec, and an optimizer whose state is laid out otherwise (ZeRO's flat
  shards) answers ``optimizer.state_spec(param, key) -> ShardSpec``
  (``ShardedStateOptimizer``); an optimizer that cannot take a checkpoint
  answers ``optimizer.checkpoint_problem({dataset path: shape})`` with the
  reason and the fix (DiLoCo saved with another number of replicas);
- ``state.step`` (the LR schedule is a pure function of it): saved, and
  returned by ``load`` in ``Restored.step``; the coordinator sets it;
- ``state.extra_state()`` / ``load_extra_state(dict)``: small JSON-able
  state of the loop, the same on every rank (fp16's loss scale);
- ``state.cursor.state_dict()`` / ``load_state_dict`` (global data cursor);
- ``state.cfg`` (resolved config) and ``state.mesh`` (the layout);
- torch RNG state per rank (``torch.get_rng_state()``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, runtime_checkable

from omegaconf import OmegaConf

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState


class ShardedStateOptimizer(Protocol):
    """An optimizer whose state tensors are not shaped like their parameters."""

    def state_spec(self, param: Any, key: str) -> Optional[Any]:
        """The ShardSpec of ``state[param][key]`` (None: the parameter's own)."""


@dataclass(frozen=True)
class Restored:
    """What ``Checkpointer.load`` put back."""

    path: str
    """The checkpoint actually read (``resume=auto`` may skip a damaged newer one)."""
    step: int
    """The optimizer steps it was saved after; the coordinator sets ``TrainState.step`` to it."""
    optimizer: Optional[str] = None
    """The ``optim.name`` that saved it, where the format records one (None: unknown); training refuses
    another optimizer's state (``hpctrain.train.checkpointing``)."""
    provenance: Optional[Dict[str, Any]] = None
    """Where it came from (``hpctrain.provenance``: software, job, config and data hashes), where the format
    records it; a resume on another software stack logs what differs."""


@runtime_checkable
class Checkpointer(Protocol):
    def save(self, state: "TrainState", path: Optional[str] = None) -> str:
        """Write a checkpoint of ``state`` (collective over all ranks) and
        return its final path. With async saving this may return before the
        tensors are even copied to host memory (overlapped staging); the
        commit happens in the background. Until ``before_update`` returns,
        the caller must not change parameters or optimizer state in place."""

    def load(self, state: "TrainState", path: str) -> Restored:
        """Restore ``state`` in place (model, optimizer, cursor, extra state,
        RNG) from ``path`` on the state's current layout, and say what was
        restored. ``state.step`` is left alone: the caller sets it from
        ``Restored.step``. With resume=auto a corrupt ``path`` may be skipped
        for an older checkpoint (``Restored.path`` names the one read)."""

    def resolve(self, resume: str) -> Optional[str]:
        """Turn ``checkpoint.resume`` ("auto" or a path) into a checkpoint path,
        or None when "auto" finds nothing to resume."""

    def wait(self) -> None:
        """Block until any background save has committed."""

    def close(self) -> None:
        """The run is over: wait as ``wait`` does, then release what the
        checkpointer holds (its directory's lock). Optional: the coordinator calls
        ``wait`` on a checkpointer without it."""

    def before_update(self) -> None:
        """Called by the coordinator every step right before the optimizer step
        (the first in-place change to parameters and optimizer state after a
        save). A checkpointer that copies state in the background waits here
        until that copy is done. Optional: the coordinator skips a checkpointer
        without it, which must then finish copying inside ``save``."""

    def failed(self) -> bool:
        """Whether a background save has failed and its error waits for the next
        ``wait``, answered without waiting: the coordinator asks at every step
        boundary and agrees on it over the ranks (``hpctrain.train.save_failures``).
        Optional: without it a background failure is found by the next save."""

    def save_seconds(self) -> Optional[float]:
        """The longest of the recent saves, from its start to its commit (the
        background part included), or None before the first: how long a stop's
        save will take (``hpctrain.train.deadline``). Optional: without it the
        coordinator measures the ``save`` call, which is the whole save only
        when it commits before returning."""


EXPERIMENT_KEYS = ("model", "data", "optim", "trainer.global_batch_size", "trainer.seq_len", "trainer.seed",
                   "trainer.precision", "finetune")
"""What makes two launches the same experiment for the default checkpoint
directory. Left out on purpose: the layout (``parallel.*``: checkpoints
resume at any layout), ``trainer.steps`` (a relaunch may train longer), the
micro-batch size, logging, communication and cluster settings. The weights a
run starts from (``checkpoint.init_from``) count too, when set: two fine-tunings
of one model from different weights are different experiments (left out when
unset, so the directories of runs without it keep their names)."""

LATER_KEYS_AT_DEFAULT = {"model.head_dim": None, "model.qkv_bias": False, "model.qk_norm": False,
                         "model.moe.ffn_hidden": None, "model.moe.norm_topk_prob": True,
                         "model.mtp_depth": 0, "model.mtp_loss_weight": 0.3, "model.moe.expert_groups": 1,
                         "model.moe.topk_groups": 1, "model.moe.routed_scaling_factor": 1.0,
                         "model.moe.first_dense_blocks": 0, "model.attention_kind": "gqa",
                         "model.mla": {"q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                                       "qk_rope_head_dim": 64, "v_head_dim": 128},
                         "model.rope_scaling.beta_fast": 32.0, "model.rope_scaling.beta_slow": 1.0,
                         "model.rope_scaling.mscale": None, "model.rope_scaling.mscale_all_dim": None,
                         "finetune.method": "full",
                         "finetune.lora": {"rank": 8, "alpha": 16.0, "dropout": 0.0,
                                           "targets": ["q", "k", "v", "o"], "experts": False}}
"""Keys added to the ``EXPERIMENT_KEYS`` sections after directories were first
named, with their defaults: left out of the hash while at their default, so an
experiment that does not use them keeps the directory name it had before they
existed (a relaunch after an upgrade finds its checkpoints). A new key of
those sections joins this table (tests/unit/test_checkpoint_dir_names.py). A section
added later (``LATER_SECTIONS``) is left out whole when all its keys are."""

NOT_EXPERIMENT_KEYS = ("data.stage",)
"""Keys inside ``EXPERIMENT_KEYS`` sections that never name another experiment: where the shards are read from
(node-local copies, ``hpctrain.data.stage``) is not what they hold; a run that starts staging finds its
checkpoints."""

LATER_SECTIONS = ("finetune",)
"""``EXPERIMENT_KEYS`` sections added after directories were first named."""


def default_checkpoint_dir(cfg: Any, launch_dir: str) -> str:
    """``<launch dir>/checkpoints/<model name>-<8 hex digits>``: the digits hash
    the ``EXPERIMENT_KEYS`` values, so relaunching the same experiment from
    the same directory (a requeued or resubmitted job, a crash) finds its
    checkpoints with ``checkpoint.resume=auto``, and a different experiment
    does not."""


    chosen = {key: OmegaConf.to_container(OmegaConf.select(cfg, key), resolve=True)
              if OmegaConf.is_config(OmegaConf.select(cfg, key)) else OmegaConf.select(cfg, key)
              for key in EXPERIMENT_KEYS}
    for key, default in LATER_KEYS_AT_DEFAULT.items():
        section, *inner, name = key.split(".")
        values = chosen.get(section)
        for part in inner:  # a plugin's section inside one (model.moe)
            values = values.get(part) if isinstance(values, dict) else None
        if isinstance(values, dict) and values.get(name, default) == default:
            values.pop(name, None)
    for key in NOT_EXPERIMENT_KEYS:
        section, name = key.split(".")
        values = chosen.get(section)
        if isinstance(values, dict):
            values.pop(name, None)
    for section in LATER_SECTIONS:
        if chosen.get(section) == {}:
            chosen.pop(section)
    if OmegaConf.select(cfg, "checkpoint.init_from", default=None):
        chosen["checkpoint.init_from"] = str(cfg.checkpoint.init_from)
    digest = hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return os.path.join(os.path.abspath(launch_dir), "checkpoints", f"{cfg.model.name}-{digest}")


def weight_mismatches(source: str, missing: Sequence[str], wrong: Sequence[str], missing_fix: str, wrong_fix: str,
                      limit: int = 3) -> List[str]:
    """At most two lines about the weights ``source`` (``checkpoint.init_from=...``) holds for this model: the
    tensors it lacks and those of the wrong shape (``"name is [a, b], the model needs [c, d]"``), ``limit`` of
    each named, then a count; each line ends with its fix."""
    def some(items: Sequence[str], sep: str) -> str:
        return sep.join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")

    out = []
    if missing:
        out.append(f"{source} lacks {some(missing, ', ')}; {missing_fix}")
    if wrong:
        out.append(f"{source}: a tensor of the wrong shape: {some(wrong, '; ')}; {wrong_fix}")
    return out
