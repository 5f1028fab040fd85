"""The optimizer's settings, checked before any collective (``hpctrain.config.validate``)."""
from __future__ import annotations

from typing import Any, List, Sequence

from hpctrain.model.build import build_model
from hpctrain.optimizers.kinds import ADAPTATION_KINDS, OPTIMIZERS, muon_matrix
from hpctrain.optimizers.muon import NS_DTYPES
from hpctrain.shard import get_spec


def optimizer_problems(cfg: Any, pm: Any, plugin_names: Sequence[str] = ()) -> List[str]:
    """One message per bad optimizer setting; ``plugin_names``: optimizers plugins provide."""
    o = cfg.optim
    out = []
    if o.name not in OPTIMIZERS and o.name not in plugin_names:
        names = list(OPTIMIZERS) + [n for n in plugin_names if n not in OPTIMIZERS]
        out.append(f"optim.name={o.name!r} is not one of {', '.join(names)}; choose a preset: "
                   + ", ".join(f"optim={n}" for n in names[:-1]) + f" or optim={names[-1]}")
    bad = [k for k in o.exclude_from_adaptation if k not in ADAPTATION_KINDS]
    if bad:
        out.append(f"optim.exclude_from_adaptation={list(o.exclude_from_adaptation)}: {', '.join(map(repr, bad))} "
                   f"is not a kind of tensor; use any of {', '.join(ADAPTATION_KINDS)} (or [] to adapt every tensor)")
    if o.ns_dtype not in NS_DTYPES:
        out.append(f"optim.ns_dtype={o.ns_dtype!r} is not one of {', '.join(NS_DTYPES)}")
    if o.name == "muon" and not out:
        out += _muon_has_matrices(cfg, pm)
    return out


def _muon_has_matrices(cfg: Any, pm: Any) -> List[str]:
    """Muon needs a hidden matrix left after ``optim.adamw_params`` (checked on the model built on the meta device)."""
    try:
        model = build_model(cfg, pm)
    except Exception:  # noqa: BLE001 (a model config the other checks reject: they say why)
        return []
    specs = [get_spec(p) for p in model.parameters()]
    if any(muon_matrix(s, list(cfg.optim.adamw_params)) for s in specs):
        return []
    return [f"optim=muon but no 2-D hidden matrix of model {cfg.model.name!r} is left for Muon after "
            f"optim.adamw_params={list(cfg.optim.adamw_params)}; keep the hidden matrices out of "
            "optim.adamw_params (default: ['tok_embeddings.*', 'output.*']) or use optim=adamw"]
