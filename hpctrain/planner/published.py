"""Published training runs as data: ``published_runs.yaml``, loaded and checked.

The table is the planner's yardstick (``hpctrain-plan --validate``,
``hpctrain.planner.validate``): every row is a run someone measured and
printed, with its model, GPUs, layout, batch, sequence, precision, measured
throughput and the source it was transcribed from. A row that is incomplete,
inconsistent (a mesh that does not multiply to the GPU count, a batch the
data-parallel ranks cannot split) or uncited is refused here, when the file is
read, with one line naming the file, the row and the field: a validation that
silently skipped rows would report a different set of runs each time.

``None`` in a layout knob or in ``vocab`` means the source does not print it;
the planner is then left to choose that knob (``validate`` says so per row).

Rows marked ``held_out`` follow a fixed rule (``held_out_by_rule``: the 1st,
4th, 7th ... row of each source in file order) and are never to be used for
tuning a planner constant; the loader keeps the flag as written, the tests
check it follows the rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml  # type: ignore[import-untyped]  # (pyyaml is a dependency; its stubs are not installed)

from hpctrain.errors import ConfigError
from hpctrain.planner.frameworks import FRAMEWORKS

DEFAULT_TABLE = Path(__file__).with_name("published_runs.yaml")

PRECISIONS = ("bf16", "fp16", "fp8", "16-bit")
"""As the sources print them; ``16-bit``: mixed precision, fp16 or bf16 not said."""
SCHEDULES = ("1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
POSITIONS = ("learned", "rope", "alibi")
TFLOPS_KINDS = ("model", "hardware")
METRICS = ("step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")

_RUN_KEYS = {"id", "source", "where", "held_out", "model", "gpu", "gpus", "global_batch", "seq_len", "precision",
             "layout", "published", "note", "cluster_overrides", "framework"}
_OPTIONAL_RUN_KEYS = {"note", "cluster_overrides", "framework"}
_MODEL_KEYS = {"family", "preset", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied", "positions"}
_LAYOUT_KEYS = {"tp", "pp", "dp", "cp", "ep", "schedule", "vpp", "zero", "recompute", "micro_batch"}
_PUBLISHED_KEYS = set(METRICS) | {"tflops_kind"}


@dataclass(frozen=True)
class Source:
    """Where a group of rows was read: the citation and the exact copy read."""

    key: str
    cite: str
    read_from: str
    note: str = ""
    framework: str = ""
    """The training code that ran the source's rows (``frameworks.FRAMEWORKS``); a row may name another."""


@dataclass(frozen=True)
class ModelSpec:
    """The published architecture (``preset``: our config preset with that shape)."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: Optional[int]
    tied: bool
    positions: str
    preset: Optional[str] = None


@dataclass(frozen=True)
class PublishedLayout:
    """The parallel layout as published; None: the source does not print it."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    schedule: Optional[str]
    vpp: Optional[int]
    zero: Optional[int]
    recompute: Optional[str]
    micro_batch: Optional[int]

    def label(self) -> str:
        parts = [f"{a}{n}" for a, n in (("tp", self.tp), ("cp", self.cp), ("ep", self.ep), ("dp", self.dp),
                                         ("pp", self.pp)) if n > 1 or a == "dp"]
        if self.pp > 1 and self.schedule:
            parts.append(self.schedule + (f"(v{self.vpp})" if self.vpp and self.vpp > 1 else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Throughput:
    """The measured throughput, as printed (any of them may be None)."""

    step_time_s: Optional[float] = None
    tokens_per_s_per_gpu: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    tflops_kind: Optional[str] = None
    """``model`` (no recompute credited, as MFU) or ``hardware`` (recomputation counted)."""
    mfu: Optional[float] = None


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: Source
    where: str
    """Table and row (or section) inside the source."""
    model: ModelSpec
    gpu: str
    """Cluster preset name (hpctrain/conf/cluster/)."""
    gpus: int
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    precision: str
    layout: PublishedLayout
    published: Throughput
    held_out: bool
    note: str = ""
    cluster_overrides: Tuple[str, ...] = ()
    framework: str = ""
    """The code that ran it (the row's own, else its source's)."""


def held_out_by_rule(index_in_source: int) -> bool:
    """The held-out rule, fixed before any prediction was seen: the 1st, 4th,
    7th ... row of each source (index counted from 0 in file order)."""
    return index_in_source % 3 == 0


def load_runs(path: Optional[str] = None) -> List[PublishedRun]:
    """The rows of ``path`` (default: the table shipped with the planner);
    ConfigError with one line naming the file, the row and the problem."""
    where = Path(path) if path else DEFAULT_TABLE
    try:
        text = where.read_text()
    except OSError as e:
        raise ConfigError(f"published runs table {where}: cannot read it ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(f"published runs table {where}: not valid YAML{at}: {problem}") from None
    if not isinstance(data, dict) or not isinstance(data.get("sources"), dict) or not data.get("runs"):
        raise ConfigError(f"published runs table {where}: expected a mapping with 'sources' (a mapping) and "
                          "'runs' (a non-empty list)")
    if not isinstance(data["runs"], list):
        raise ConfigError(f"published runs table {where}: 'runs' must be a list of rows")
    sources = {key: _source(where, key, value) for key, value in data["sources"].items()}
    runs: List[PublishedRun] = []
    for i, row in enumerate(data["runs"]):
        runs.append(_run(where, i, row, sources))
    seen: Dict[str, int] = {}
    for i, run in enumerate(runs):
        if run.id in seen:
            raise ConfigError(f"published runs table {where}: run {run.id!r} appears twice (rows {seen[run.id] + 1} "
                              f"and {i + 1}); ids must be unique")
        seen[run.id] = i
    return runs


# -- checking ----------------------------------------------------------------------
class _Bad(Exception):
    """One problem in one row (turned into the ConfigError line by ``_run``)."""


def _source(path: Path, key: Any, value: Any) -> Source:
    if not isinstance(value, dict):
        raise ConfigError(f"published runs table {path}: source {key!r} must be a mapping with cite and read_from")
    for field in ("cite", "read_from"):
        if not isinstance(value.get(field), str) or not value[field].strip():
            raise ConfigError(f"published runs table {path}: source {key!r}: '{field}' must say where the figures "
                              "were read (a non-empty string)")
    framework = value.get("framework") or ""
    if framework and framework not in FRAMEWORKS:
        raise ConfigError(f"published runs table {path}: source {key!r}: framework {framework!r} is not one of "
                          f"{', '.join(sorted(FRAMEWORKS))}")
    return Source(str(key), value["cite"], value["read_from"], str(value.get("note") or ""), str(framework))


def _run(path: Path, index: int, row: Any, sources: Mapping[str, Source]) -> PublishedRun:
    name = row.get("id") if isinstance(row, dict) and isinstance(row.get("id"), str) else f"#{index + 1}"
    try:
        if not isinstance(row, dict):
            raise _Bad("each row must be a mapping")
        _keys(row, _RUN_KEYS, _RUN_KEYS - _OPTIONAL_RUN_KEYS, "")
        if not isinstance(row["id"], str) or not row["id"].strip():
            raise _Bad("'id' must be a non-empty string")
        if row["source"] not in sources:
            raise _Bad(f"source {row['source']!r} is not one of the table's sources ({', '.join(sources)})")
        for key in ("where", "gpu"):
            _text(row, key, "")
        if not isinstance(row["held_out"], bool):
            raise _Bad("'held_out' must be true or false")
        gpus, batch, seq = (_count(row, k, "") for k in ("gpus", "global_batch", "seq_len"))
        if row["precision"] not in PRECISIONS:
            raise _Bad(f"precision {row['precision']!r} is not one of {', '.join(PRECISIONS)}")
        model = _model(row["model"])
        layout = _layout(row["layout"], gpus, batch)
        published = _published(row["published"])
        overrides = row.get("cluster_overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) and o.startswith("cluster.") and "=" in o
                                                      for o in overrides):
            raise _Bad("'cluster_overrides' must be a list of cluster.KEY=VALUE strings")
        note = row.get("note") or ""
        if not isinstance(note, str):
            raise _Bad("'note' must be a string")
        framework = row.get("framework") or sources[row["source"]].framework
        if not framework:
            raise _Bad("no framework: give the row's, or its source's ('framework: KEY')")
        if framework not in FRAMEWORKS:
            raise _Bad(f"framework {framework!r} is not one of {', '.join(sorted(FRAMEWORKS))}")
    except _Bad as e:
        raise ConfigError(f"published runs table {path}: run {name!r}: {e}") from None
    return PublishedRun(row["id"], sources[row["source"]], row["where"], model, row["gpu"], gpus, batch, seq,
                        row["precision"], layout, published, row["held_out"], note, tuple(overrides), framework)


def _keys(d: Mapping[str, Any], allowed: set, required: set, what: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise _Bad(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(what + k for k in unknown)} "
                   f"(allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(d))
    if missing:
        raise _Bad(f"missing {', '.join(what + k for k in missing)}")


def _text(d: Mapping[str, Any], key: str, what: str) -> str:
    if not isinstance(d[key], str) or not d[key].strip():
        raise _Bad(f"'{what}{key}' must be a non-empty string")
    return d[key]


def _count(d: Mapping[str, Any], key: str, what: str, optional: bool = False) -> Any:
    value = d[key]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Bad(f"'{what}{key}' must be a positive integer" + (" or null (not published)" if optional else "")
                   + f", got {value!r}")
    return value


def _model(m: Any) -> ModelSpec:
    if not isinstance(m, dict):
        raise _Bad("'model' must be a mapping")
    _keys(m, _MODEL_KEYS, _MODEL_KEYS - {"preset"}, "model.")
    family = _text(m, "family", "model.")
    dims = [_count(m, k, "model.") for k in ("layers", "hidden", "heads", "kv_heads", "ffn")]
    vocab = _count(m, "vocab", "model.", optional=True)
    if not isinstance(m["tied"], bool):
        raise _Bad("'model.tied' must be true or false")
    if m["positions"] not in POSITIONS:
        raise _Bad(f"model.positions {m['positions']!r} is not one of {', '.join(POSITIONS)}")
    preset = m.get("preset")
    if preset is not None and (not isinstance(preset, str) or not preset):
        raise _Bad("'model.preset' must be a preset name")
    layers, hidden, heads, kv_heads, ffn = dims
    if hidden % heads or heads % kv_heads:
        raise _Bad(f"model: heads {heads} must divide hidden {hidden} and be a multiple of kv_heads {kv_heads}")
    return ModelSpec(family, layers, hidden, heads, kv_heads, ffn, vocab, m["tied"], m["positions"], preset)


def _layout(lay: Any, gpus: int, batch: int) -> PublishedLayout:
    if not isinstance(lay, dict):
        raise _Bad("'layout' must be a mapping")
    _keys(lay, _LAYOUT_KEYS, _LAYOUT_KEYS, "layout.")
    tp, pp, dp, cp, ep = (_count(lay, k, "layout.") for k in ("tp", "pp", "dp", "cp", "ep"))
    if tp * pp * dp * cp * ep != gpus:
        raise _Bad(f"tp({tp}) * pp({pp}) * dp({dp}) * cp({cp}) * ep({ep}) = {tp * pp * dp * cp * ep} "
                   f"!= gpus {gpus}")
    if lay["schedule"] is not None and lay["schedule"] not in SCHEDULES:
        raise _Bad(f"layout.schedule {lay['schedule']!r} is not one of {', '.join(SCHEDULES)} or null")
    if lay["recompute"] is not None and lay["recompute"] not in RECOMPUTE:
        raise _Bad(f"layout.recompute {lay['recompute']!r} is not one of {', '.join(RECOMPUTE)} or null")
    zero = lay["zero"]
    if zero is not None and (isinstance(zero, bool) or zero not in (0, 1, 2, 3)):
        raise _Bad(f"layout.zero must be 0-3 or null, got {zero!r}")
    vpp, mb = _count(lay, "vpp", "layout.", True), _count(lay, "micro_batch", "layout.", True)
    if batch % dp:
        raise _Bad(f"global_batch {batch} is not divisible by dp {dp}")
    if mb is not None and batch % (dp * mb):
        raise _Bad(f"global_batch {batch} is not divisible by dp({dp}) x micro_batch({mb})")
    return PublishedLayout(tp, pp, dp, cp, ep, lay["schedule"], vpp, zero, lay["recompute"], mb)


def _published(p: Any) -> Throughput:
    if not isinstance(p, dict):
        raise _Bad("'published' must be a mapping")
    _keys(p, _PUBLISHED_KEYS, set(), "published.")
    values = {}
    for key in METRICS:
        value = p.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _Bad(f"'published.{key}' must be a positive number, got {value!r}")
        values[key] = float(value)
    if not values:
        raise _Bad(f"'published' needs at least one of {', '.join(METRICS)}")
    if values.get("mfu", 0.0) > 1:
        raise _Bad(f"'published.mfu' is a fraction (0.41 for 41%), got {values['mfu']}")
    kind = p.get("tflops_kind")
    if "tflops_per_gpu" in values and kind not in TFLOPS_KINDS:
        raise _Bad(f"'published.tflops_kind' must be one of {', '.join(TFLOPS_KINDS)} with tflops_per_gpu")
    return Throughput(values.get("step_time_s"), values.get("tokens_per_s_per_gpu"), values.get("tflops_per_gpu"),
                      kind, values.get("mfu"))
