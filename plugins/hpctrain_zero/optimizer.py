"""The ZeRO optimizer: torch's AdamW (or the core's LAMB, LARS or Muon,
``optim.name``) over this rank's shards only.

Each model parameter is represented by a *shard parameter*: the elements of
its flat group this rank holds (``FlatGroup.held``), as a 1-D tensor whose
memory is the master copy (stages 1 and 2 in the parameters' dtype: a view
of the unit's flat parameter buffer; with ``param_dtype`` or at stage 3 an
fp32 master chunk). AdamW runs per shard parameter, so its per-parameter
rules stay exactly those of one process: weight decay decided from the
logical shape, a parameter no rank produced a gradient for is skipped,
``step`` counts per parameter. A parameter of which this rank holds no
element has no shard parameter here.

For the rest of hpctrain it looks like the optimizer of the model's own
parameters:
- ``state`` maps each model parameter to its shard's AdamW state (plus
  ``master``, the fp32 chunk, when the parameters compute in 16 bits), and
  ``state_spec(param, key)`` is the parameter's flat ShardSpec, so the
  checkpoint stores logical tensors and any layout can load them;
- ``gradients()`` hands the shard gradients to the trainer's norm and
  clipping, with the same flat specs;
- ``param_groups`` (learning rate) and ``zero_grad`` reach every inner
  AdamW; ``step`` runs the step pre-hooks, then each segment's AdamW (with
  nvme offload one flat group at a time, its pages dropped after; LAMB,
  LARS and Muon: one optimizer of every shard, given every parameter's flat
  spec, held or not, for their collectives over logical tensors), the
  post-hooks, and ``after_step`` (stages 1 and 2: all-gather the updated
  parameters).
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from hpctrain.mesh import Mesh
from hpctrain.optimizers.adamw import param_groups
from hpctrain.optimizers.build import build_optimizer
from hpctrain.shard import ShardSpec

MASTER = "master"
"""State key of the fp32 master chunk when parameters compute in ``param_dtype``
(stages 1-2), so a checkpoint keeps the exact weights beside the 16-bit copy."""


class _StateView(MutableMapping):
    """``optimizer.state`` keyed by model parameters."""

    def __init__(self, owner: "ZeroOptimizer"):
        self._owner = owner

    def _shard(self, param: Any) -> Optional[torch.nn.Parameter]:
        return self._owner.shard_of.get(id(param))

    def __getitem__(self, param: Any) -> Dict[str, Any]:
        shard = self._shard(param)
        if shard is None or shard not in self._owner.state_of(shard):
            raise KeyError(param)
        state = self._owner.state_of(shard)[shard]
        if self._owner.masters_apart:  # the fp32 master is state too when the parameter computes in 16 bits
            return {**state, MASTER: shard.detach()}
        return state

    def __setitem__(self, param: Any, value: Dict[str, Any]) -> None:
        shard = self._shard(param)
        if shard is None:  # a rank holding none of the parameter keeps no state for it
            return
        value = dict(value)
        master = value.pop(MASTER, None)
        if master is not None and master.data_ptr() != shard.data_ptr():
            with torch.no_grad():
                shard.copy_(master)
        self._owner.state_of(shard)[shard] = value

    def __delitem__(self, param: Any) -> None:
        shard = self._shard(param)
        if shard is None or shard not in self._owner.state_of(shard):
            raise KeyError(param)
        del self._owner.state_of(shard)[shard]

    def __iter__(self) -> Iterator[Any]:
        return (p for p in self._owner.model_params
                if (s := self._shard(p)) is not None and s in self._owner.state_of(s))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Segment:
    """Model parameters whose shards one AdamW updates (with nvme offload: one
    flat group, whose moments live in ``mapped``)."""

    params: List[torch.nn.Parameter]
    mapped: Optional[Any] = None
    """``offload.MappedState`` of the group, or None."""
    slices: Dict[int, slice] = field(default_factory=dict)
    """Where each parameter's shard sits in ``mapped`` (by id of the model parameter)."""


class _Handle:
    def __init__(self, hooks: List[Callable], hook: Callable):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class ZeroOptimizer:
    """AdamW over shard parameters, seen through the model's parameters."""

    def __init__(self, model_params: List[torch.nn.Parameter], shards: Dict[int, Tuple[torch.nn.Parameter, ShardSpec]],
                 optim_cfg: Any, after_step: Callable[[], None], masters_apart: bool = False,
                 segments: Optional[List[Segment]] = None, mesh: Optional[Mesh] = None,
                 specs: Optional[List[ShardSpec]] = None):
        self.model_params = model_params
        self.shard_of = {k: s for k, (s, _) in shards.items()}
        self.spec_of = {k: spec for k, (_, spec) in shards.items()}
        self.shards = [self.shard_of[id(p)] for p in model_params if id(p) in self.shard_of]
        self.segments = segments or [Segment(list(model_params))]
        self.optimizers: List[torch.optim.Optimizer] = []
        self._owner: Dict[int, torch.optim.Optimizer] = {}
        self._runs: List[Tuple[Segment, torch.optim.Optimizer]] = []
        """(segment, its optimizer) in step order."""
        if optim_cfg.name != "adamw":  # LAMB, LARS, Muon: one optimizer of every shard, made on every rank
            assert mesh is not None and specs is not None and segments is None
            opt = build_optimizer(self.shards, optim_cfg, mesh, specs)  # collective: even with no shard
            self._owner = {id(s): opt for s in self.shards}
            self.optimizers = [opt]
            self._runs = [(self.segments[0], opt)]
        for seg in self.segments if not self.optimizers else ():
            mine = [self.shard_of[id(p)] for p in seg.params if id(p) in self.shard_of]
            if not mine:
                continue
            opt = torch.optim.AdamW(param_groups(mine, optim_cfg.weight_decay), lr=optim_cfg.lr,
                                    betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps, foreach=True)
            for p in seg.params:
                shard = self.shard_of.get(id(p))
                if shard is None:
                    continue
                self._owner[id(shard)] = opt
                if seg.mapped is not None:  # moments in the group's file; AdamW keeps state it finds
                    sl = seg.slices[id(p)]
                    opt.state[shard] = {"step": torch.tensor(0.0), "exp_avg": seg.mapped.exp_avg[sl],
                                        "exp_avg_sq": seg.mapped.exp_avg_sq[sl]}
            self.optimizers.append(opt)
            self._runs.append((seg, opt))
        self.state = _StateView(self)
        self._after_step = after_step
        self.masters_apart = masters_apart
        self._pre: List[Callable] = []
        self._post: List[Callable] = []

    def state_of(self, shard: torch.nn.Parameter) -> Dict[Any, Dict[str, Any]]:
        """The AdamW ``state`` mapping that holds ``shard``'s state."""
        return self._owner[id(shard)].state

    def shard_states(self) -> List[Dict[str, Any]]:
        """Every shard's AdamW state dict (tests, memory accounting)."""
        return [st for opt in self.optimizers for st in opt.state.values()]

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def register_step_pre_hook(self, hook: Callable) -> _Handle:
        self._pre.append(hook)
        return _Handle(self._pre, hook)

    def register_step_post_hook(self, hook: Callable) -> _Handle:
        self._post.append(hook)
        return _Handle(self._post, hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        if closure is not None:
            raise ValueError("the ZeRO optimizer takes no closure")
        for hook in list(self._pre):
            hook(self, (), {})
        for seg, opt in self._runs:
            opt.step()
            if seg.mapped is not None:
                seg.mapped.release()
        for hook in list(self._post):
            hook(self, (), {})
        self._after_step()

    def state_spec(self, param: Any, key: str) -> Optional[ShardSpec]:
        """The flat spec of ``param``'s state tensors (``hpctrain.checkpoint``)."""
        return self.spec_of.get(id(param))

    def gradients(self) -> List[Tuple[torch.Tensor, ShardSpec]]:
        """(shard gradient, flat spec) of every shard that has a gradient."""
        return [(s.grad, self.spec_of[id(p)]) for p in self.model_params
                if (s := self.shard_of.get(id(p))) is not None and s.grad is not None]

    def __repr__(self) -> str:
        return (f"ZeroOptimizer({len(self.shards)} shards of {len(self.model_params)} parameters, "
                f"{len(self.optimizers)} AdamW)")
