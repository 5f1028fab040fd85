"""What LAMB, LARS and Muon share: torch's Optimizer over the tensors a rank
updates, each known by its slot in the stage's list of ShardSpecs.

``tensors`` are what this rank updates (model parameters, or ZeRO's shard
parameters), each carrying its ShardSpec (``hpctrain.shard.get_spec``);
``specs`` lists every tensor of the rank's pipeline stage, held or not, in
an order every rank of the stage shares (the collectives are entered for all
of them on every rank, so a rank holding no element of a tensor still takes
part). Without ``specs`` the tensors' own specs are the list (every rank of
the stage holds a piece of every tensor: no ZeRO).

Two parameter groups: tensors that decay (logical rank >= 2) and those that
do not, as the core AdamW groups them; ``lr`` is set per step by the trainer.
A rank updating no tensor still builds the optimizer (one empty group) and
enters its collectives.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from hpctrain.mesh import Mesh
from hpctrain.optimizers.kinds import decays
from hpctrain.shard import ShardSpec, get_spec


class ShardedOptimizer(torch.optim.Optimizer):
    """The common set-up (module docstring); subclasses implement ``step``."""

    def __init__(self, tensors: Sequence[torch.nn.Parameter], optim: Any, mesh: Mesh,
                 specs: Optional[Sequence[ShardSpec]] = None, defaults: Optional[Dict[str, Any]] = None):
        tensors = list(tensors)
        self.mesh = mesh
        self.cfg = optim
        self.specs: List[ShardSpec] = list(specs) if specs is not None else [get_spec(t) for t in tensors]
        index = {spec: i for i, spec in enumerate(self.specs)}
        self.slot: Dict[int, int] = {}
        for t in tensors:
            spec = get_spec(t)
            if spec not in index:
                raise ValueError(f"{spec.logical_name}: its ShardSpec is not in the optimizer's list of specs")
            self.slot[id(t)] = index[spec]
        groups = [{"params": [t for t in tensors if decays(get_spec(t))], "weight_decay": float(optim.weight_decay)},
                  {"params": [t for t in tensors if not decays(get_spec(t))], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]] or [{"params": [], "weight_decay": 0.0}]
        super().__init__(groups, dict(defaults or {}, lr=float(optim.lr)))
        self.device = tensors[0].device if tensors else _default_device()
        """Where the norms' and Muon's collectives run: the tensors' device."""

    def held(self) -> List[torch.Tensor]:
        """Every tensor this rank updates, group by group."""
        return [t for g in self.param_groups for t in g["params"]]

    def group_of(self) -> Dict[int, Dict[str, Any]]:
        """Each held tensor's parameter group, by id."""
        return {id(t): g for g in self.param_groups for t in g["params"]}


def _default_device() -> torch.device:
    """A rank updating nothing still enters the collectives, on the device its backend expects."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
