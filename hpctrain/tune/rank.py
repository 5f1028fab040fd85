"""The planner's ranking, with the tuner's calibration or without it.

``hpctrain-plan`` and the tuner share ``make_plan``: the same enumeration
(only layouts the installed plugins' validation accepts), the same
estimates, and the same ``hpctrain-train`` overrides per layout
(``hpctrain.planner.report.train_overrides``), so a printed command is one
``hpctrain-plan --calibration`` would print.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hpctrain.mesh import AXES
from hpctrain.planner.plan import make_plan, parse_pins
from hpctrain.planner.report import train_overrides


@dataclass
class Candidate:
    """One layout the tuner may train: its name, the overrides that select it, what the planner predicts."""

    label: str
    overrides: List[str]
    predicted_s: Optional[float]
    predicted_bytes: Optional[float]
    predicted_comm: Dict[str, float]
    sizes: Dict[str, int]


def describe(est: Any) -> str:
    lay = est.layout
    return f"{lay.label()} zero{lay.zero} {lay.recompute} mb{lay.micro_batch}"


def plan(overrides: Sequence[str], calibration: Optional[str], pm) -> Tuple[Any, ...]:
    """``hpctrain.planner.plan.make_plan``: (plan, arch, workload, cluster, cfg, overrides)."""
    return make_plan(list(overrides), calibration, pm, parse_pins([]))


def candidates(ranked: Sequence[Any], user: Sequence[str], precision: str, top: int) -> List[Candidate]:
    """The ``top`` fastest predicted layouts as candidates, with the overrides built from ``user``."""
    out = []
    for est in list(ranked)[:top]:
        out.append(Candidate(describe(est), train_overrides(user, est.layout, precision), est.time.total,
                             est.memory.total, dict(est.comm_bytes), est.layout.sizes()))
    return out


def axis_layouts(ranked: Sequence[Any]) -> Dict[str, Tuple[str, Dict[str, int]]]:
    """For each axis some layout splits: the best-ranked such layout (its label and mesh sizes),
    whose groups ``measure.measure_links`` times."""
    out: Dict[str, Tuple[str, Dict[str, int]]] = {}
    for est in ranked:
        sizes = est.layout.sizes()
        for a in AXES:
            if sizes[a] > 1 and a not in out:
                out[a] = (est.layout.label(), sizes)
    return out
