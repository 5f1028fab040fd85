"""Units: the parameter groups ZeRO shards and gathers as one flat buffer.

In forward order: the token embedding, each transformer block, then the
head (final norm and output projection), then multi-token prediction's
modules (``mtp``), which use the embedding and the head's projection again
(dependencies, so those stay gathered until their gradients are out). Parameters that belong to none of
them (a plugin's extra module) form a last unit, ``rest``. A parameter shared
by two units (tied embeddings) belongs to the first that holds it; the
units that use it record that one as a dependency.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from torch import nn

from hpctrain.model.transformer import Transformer


@dataclass
class Unit:
    name: str
    modules: List[nn.Module]
    """Modules whose forward needs the unit's parameters (hooks go on them)."""
    params: List[nn.Parameter] = field(default_factory=list)
    depends: List[str] = field(default_factory=list)
    """Earlier units holding parameters this one also uses (tied weights)."""


def model_units(model: nn.Module) -> List[Unit]:
    """The units of ``model``: of every part of the core's model it runs (a
    ``Transformer``, one pipeline stage's part of it, or an interleaved
    rank's several parts), in order; with several parts each unit's name
    starts with ``part<i>.``."""
    parts = [m for m in model.modules() if isinstance(m, Transformer)]
    if len(parts) > 1:
        return [Unit(f"part{i}.{u.name}", u.modules, u.params, [f"part{i}.{d}" for d in u.depends])
                for i, part in enumerate(parts) for u in _part_units(part)]
    return _part_units(model)


def _part_units(model: nn.Module) -> List[Unit]:
    found: List[Unit] = []
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is not None:
        found.append(Unit("embed", [embeddings]))
    layers = getattr(model, "layers", None)
    for key, block in (layers.items() if layers is not None else ()):
        found.append(Unit(f"layers.{key}", [block]))
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if head:
        found.append(Unit("head", head))
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # multi-token prediction, after the head: it calls the embedding and output projection again
        found.append(Unit("mtp", [mtp], depends=[u.name for u in found if u.name in ("embed", "head")]))
    owner: Dict[int, str] = {}
    for unit in found:
        for module in unit.modules:
            for p in module.parameters():
                if id(p) in owner:
                    if owner[id(p)] != unit.name and owner[id(p)] not in unit.depends:
                        unit.depends.append(owner[id(p)])
                    continue
                owner[id(p)] = unit.name
                unit.params.append(p)
    rest = [p for p in model.parameters() if id(p) not in owner]
    if rest:
        found.append(Unit("rest", [model], rest))
    return [u for u in found if u.params]
