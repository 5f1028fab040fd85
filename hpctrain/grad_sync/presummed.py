"""Gradients already summed over a data axis by the forward's own collectives.

A parameter split on a data axis (an expert weight split on ``ep``) is not
averaged over that axis by the gradient-sync engine: the collective that
brought it its inputs (the MoE dispatch all-to-all) carries each rank's
gradient contribution back to the weight's one owner, so its ``.grad`` is
already the *sum* over that axis's ranks. The data average is the sum over
every data rank divided by their number; the engine divides by the size of
the group it reduces over (the other data axes), so the axes the parameter
is split on still owe their factor. ``scale_presummed`` divides by it, in a
gradient hook that runs before the gradient is accumulated (and before the
engine sees it), so every later consumer (the engine, ZeRO's shards, the
norm, the optimizer) gets the averaged value, whatever the schedule.
"""
from __future__ import annotations

import math
from typing import Iterable, List

import torch

from hpctrain.mesh import DATA_AXES, Mesh
from hpctrain.shard import get_spec


def presummed_factor(split_axes: Iterable[str], mesh: Mesh) -> int:
    """Ranks of the data axes in ``split_axes`` (1 when it is split on none)."""
    return math.prod(mesh.size(a) for a in set(split_axes) if a in DATA_AXES)


def scale_presummed(params: Iterable[torch.nn.Parameter], mesh: Mesh) -> List[torch.nn.Parameter]:
    """Hook every parameter with a *dimension* split on a data axis of size
    > 1 to divide its gradient by that axis's size (see the module
    docstring); returns them. ZeRO's flat shards over the data axes are not
    such splits: their gradients are reduced over those axes as usual."""
    scaled = []
    for p in params:
        factor = presummed_factor([a for s in get_spec(p).splits for a in s.axes], mesh)
        if factor > 1 and p.requires_grad:
            p.register_hook(lambda g, f=float(factor): g / f)
            scaled.append(p)
    return scaled
