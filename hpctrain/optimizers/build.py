"""``optim.name`` -> the optimizer of the tensors a rank updates."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from hpctrain.errors import PluginError
from hpctrain.mesh import Mesh
from hpctrain.optimizers.adamw import build_adamw
from hpctrain.optimizers.lamb import Lamb
from hpctrain.optimizers.lars import Lars
from hpctrain.optimizers.muon import Muon
from hpctrain.shard import ShardSpec


def build_optimizer(tensors: Sequence[torch.nn.Parameter], optim: Any, mesh: Mesh,
                    specs: Optional[Sequence[ShardSpec]] = None) -> torch.optim.Optimizer:
    """AdamW (torch's), LAMB, LARS or Muon over ``tensors`` (``base``
    describes ``specs``: every tensor of the stage, held or not; collective
    set-up for all but AdamW, so every rank calls it)."""
    name = optim.name
    if name == "adamw":
        return build_adamw(tensors, optim)
    made = {"lamb": Lamb, "lars": Lars, "muon": Muon}.get(name)
    if made is None:  # validation passed it: a plugin lists it, but its hpctrain_make_optimizer made none
        raise PluginError(f"optim.name={name!r}: the plugin that lists it under 'optim' in hpctrain_capabilities "
                          "made no optimizer (its hpctrain_make_optimizer returned None); fix the plugin")
    return made(tensors, optim, mesh, specs)
