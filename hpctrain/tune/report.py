"""The tuner's report: predicted against measured per layout, their rank correlation, the fastest
measured layout and its command (``hpctrain.planner.report.launch_line``, the line ``hpctrain-plan``
prints), and all of it as JSON. Strings and dicts only; ``cli`` prints and writes them."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from hpctrain.tune.rank import Candidate
from hpctrain.tune.trial import Trial

GB = 1e9


def _ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (Pearson's of the ranks); None with fewer than 2 pairs or no spread."""
    if len(xs) != len(ys) or len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


def fastest(trials: Sequence[Trial]) -> Optional[int]:
    """Index of the fastest measured layout among those that trained; None when none did."""
    done = [i for i, t in enumerate(trials) if t.ok and t.median_step_s is not None]
    return min(done, key=lambda i: trials[i].median_step_s) if done else None  # type: ignore[arg-type,return-value]


def correlation(cands: Sequence[Candidate], trials: Sequence[Trial]) -> Optional[float]:
    pairs = [(c.predicted_s, t.median_step_s) for c, t in zip(cands, trials)
             if t.ok and c.predicted_s is not None and t.median_step_s is not None]
    return spearman([p for p, _ in pairs], [m for _, m in pairs])


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 2 ** 20:.1f}"


def table(cands: Sequence[Candidate], trials: Sequence[Trial]) -> str:
    """One row per layout, in the planner's order."""
    head = ["#", "layout", "pred ms", "meas ms", "pred MiB", "meas MiB", "result"]
    rows = [head]
    for i, (c, t) in enumerate(zip(cands, trials), start=1):
        rows.append([str(i), c.label, _ms(c.predicted_s), _ms(t.median_step_s), _mb(c.predicted_bytes),
                     _mb(t.peak_bytes), "ok" if t.ok else f"failed: {t.reason}"])
    widths = [max(len(r[k]) for r in rows) for k in range(len(head) - 1)]
    lines = ["  ".join([cell.ljust(w) if k == 1 else cell.rjust(w) for k, (cell, w) in enumerate(zip(r, widths))]
                       + [r[-1]]) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def text(cands: Sequence[Candidate], trials: Sequence[Trial], command: Optional[str], steps: int,
         calibration_path: Optional[str]) -> str:
    rho = correlation(cands, trials)
    best = fastest(trials)
    lines = [f"trained {len(trials)} layouts for {steps} steps each (measured: median step after the first, "
             f"peak memory, max over ranks); predicted with the calibration in {calibration_path}:",
             table(cands, trials),
             "rank correlation of predicted and measured step time (Spearman): "
             + ("n/a (fewer than 2 layouts trained)" if rho is None else f"{rho:.2f}")]
    if best is None:
        lines.append("no layout trained: see the reasons above")
    else:
        lines += [f"fastest measured: #{best + 1} {cands[best].label}, {_ms(trials[best].median_step_s)} ms "
                  "per step", "run it with:", "  " + (command or "")]
    return "\n".join(lines)


def as_json(cands: Sequence[Candidate], trials: Sequence[Trial], calibration: Dict[str, float],
            measured: Dict[str, Any], uncalibrated: Sequence[str], command: Optional[str],
            steps: int) -> Dict[str, Any]:
    best = fastest(trials)
    return {
        "steps": steps,
        "calibration": calibration,
        "measured": measured,
        "uncalibrated_order": list(uncalibrated),
        "layouts": [{**dataclasses.asdict(c), **{k: v for k, v in dataclasses.asdict(t).items()
                                                 if k not in ("label", "overrides")}}
                    for c, t in zip(cands, trials)],
        "spearman": correlation(cands, trials),
        "best": None if best is None else {"index": best, "label": cands[best].label,
                                           "overrides": cands[best].overrides, "command": command},
    }
