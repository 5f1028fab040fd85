"""What a run directory holds, read for the report."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from hpctrain.config.store import run_config_path, to_config
from hpctrain.errors import ConfigError
from hpctrain.plugins import get_manager


@dataclass
class Run:
    path: str
    metrics: List[Dict[str, Any]]
    config: Optional[Any] = None
    """The run's config (``store.run_config_path``, typed), when present."""
    layout: Dict[str, Any] = field(default_factory=dict)
    peaks: Dict[str, List[float]] = field(default_factory=dict)
    timeline_png: Optional[bytes] = None
    overrides: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    """What the page leaves out and why (an incomplete last line of metrics.jsonl), also said on stderr."""

    def series(self, key: str) -> List[tuple]:
        return [(r["step"], float(r[key])) for r in self.metrics if isinstance(r.get(key), (int, float))]

    @property
    def last(self) -> Dict[str, Any]:
        return self.metrics[-1] if self.metrics else {}


def _json(path: str, default: Any) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _config(run_dir: str) -> Optional[Any]:
    path = run_config_path(run_dir)
    if path is None:
        return None

    try:
        return to_config(open(path).read(), get_manager())
    except Exception:  # noqa: BLE001 - a config of another version: the page goes on without what needs it
        return None


def _overrides(run_dir: str) -> List[str]:
    path = os.path.join(run_dir, ".hydra", "overrides.yaml")
    if not os.path.exists(path):
        return []

    return [str(o) for o in OmegaConf.load(path)]


def is_run(path: str) -> bool:
    return os.path.exists(os.path.join(path, "metrics.jsonl"))


def read_metrics(path: str) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The records of ``metrics.jsonl`` at ``path``, and notes on what was skipped.

    A last line that is not a whole JSON object is a record still being
    written (a running run) or cut off (a killed one): it is skipped, with a
    note. Any other line that does not parse is damage: a ConfigError naming
    the file and the line."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records: List[Dict[str, Any]] = []
    notes: List[str] = []
    for k, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            if k == len(numbered) - 1:
                notes.append(f"{path}: line {number} is incomplete ({len(line)} bytes"
                             f"{'' if line.rstrip().endswith(b'}') else ', cut short'}): skipped; the run is "
                             "still writing it, or was stopped while it did")
                break
            raise ConfigError(f"{path}: line {number} is not a JSON object ({e}); the file is damaged: remove or "
                              "repair that line") from None
        records.append(record)
    return records, notes


def load_run(run_dir: str) -> Run:
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        metrics, notes = read_metrics(path)
    except OSError as e:
        raise ConfigError(f"{run_dir} is not a run directory: no readable metrics.jsonl ({e.strerror}); give "
                          "the directory hpctrain-train wrote (logging.backends with jsonl), or a sweep's") from e
    png = os.path.join(run_dir, "pipeline_timeline.png")
    return Run(path=run_dir, metrics=metrics, config=_config(run_dir), notes=notes,
               layout=_json(os.path.join(run_dir, "layout.json"), {}),
               peaks=_json(os.path.join(run_dir, "memory_per_rank.json"), {}),
               timeline_png=open(png, "rb").read() if os.path.exists(png) else None,
               overrides=_overrides(run_dir))


def sweep_points(sweep_dir: str) -> List[str]:
    """A sweep directory's point directories (numbered, as Hydra makes them), in order."""
    names = [n for n in os.listdir(sweep_dir) if n.isdigit() and is_run(os.path.join(sweep_dir, n))]
    return [os.path.join(sweep_dir, n) for n in sorted(names, key=int)]
