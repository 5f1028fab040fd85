"""Logger backends: where rank 0 sends each step's metrics (``logging.backends``).

``jsonl`` (``metrics.jsonl`` in the run directory, one JSON object per step)
is built in and always on, whatever ``logging.backends`` names, because the
sweep summary, ``hpctrain-report`` and ``hpctrain-plan --compare`` read it
(``logging.backends=[wandb]`` is W&B and metrics.jsonl); every other backend
is a plugin answering ``hpctrain_make_logger`` (the built-in TensorBoard, W&B
and MLflow loggers in ``plugins/hpctrain_loggers``; a third-party logger is
a pip package registering the same hook). Only rank 0 logs. Loggers are
opened before the first step (``open_loggers``): a backend that cannot start
is one ``hpctrain: error:`` line then, not a crash at step 500.

In a Hydra sweep every point is a run of its own in every backend, named by
its number and overrides and grouped by the sweep (``logging.group``, filled
in by ``hpctrain-train``).
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Protocol

from hpctrain.errors import ConfigError
from hpctrain.plugins import blocked_hint, capabilities
from hpctrain.train.metrics import MetricsWriter

BUILTIN = ("jsonl",)


class MetricLogger(Protocol):
    def log(self, step: int, metrics: Dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def logging_dir(cfg: Any, run_dir: str) -> str:
    """Where backends write: ``logging.dir``, else the run directory."""
    return str(cfg.logging.dir) if cfg.logging.dir else run_dir


def run_group(cfg: Any) -> str:
    return str(cfg.logging.group) if cfg.logging.group else str(cfg.model.name)


def run_name(cfg: Any, run_dir: str) -> str:
    return str(cfg.logging.name) if cfg.logging.name else os.path.basename(os.path.normpath(run_dir))


def scalars(record: Dict[str, Any]) -> Dict[str, float]:
    """The finite numbers of a step's record, ``step`` left out (backends take it apart)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class JsonlLogger:
    """``metrics.jsonl``: the step's whole record, non-finite values as null."""

    def __init__(self, path: str):
        self.path = path
        self._writer = MetricsWriter(path)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self._writer.write({"step": step, **metrics})

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Loggers:
    """Every backend of the run; empty on ranks other than 0 and without a run directory."""

    def __init__(self, loggers: Optional[List[Any]] = None):
        self.loggers: List[Any] = list(loggers or [])

    @property
    def jsonl_path(self) -> Optional[str]:
        return next((lg.path for lg in self.loggers if isinstance(lg, JsonlLogger)), None)

    def log(self, record: Dict[str, Any]) -> None:
        if not self.loggers:
            return
        step = int(record["step"])
        for lg in self.loggers:
            if isinstance(lg, JsonlLogger):  # the record as it is: null for a non-finite loss
                lg.log(step, {k: v for k, v in record.items() if k != "step"})
            else:
                lg.log(step, scalars(record))

    def flush(self) -> None:
        for lg in self.loggers:
            lg.flush()

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
        self.loggers = []


def known_backends(pm) -> List[str]:
    return list(BUILTIN) + sorted(n for n in capabilities(pm).get("logging.backend", []) if n not in BUILTIN)


def backend_problems(cfg: Any, pm) -> List[str]:
    """Backends in ``logging.backends`` that nothing provides (validation; every rank)."""
    known = known_backends(pm) if pm is not None else list(BUILTIN)
    problems = []
    for name in cfg.logging.backends:
        if name not in known:
            hint = blocked_hint()
            problems.append(f"logging.backends: {name!r} is not provided by any installed plugin; choose from "
                            f"{', '.join(known)}, or install the logger plugin that provides it"
                            + (f" ({hint})" if hint else ""))
    if len(set(cfg.logging.backends)) != len(cfg.logging.backends):
        problems.append(f"logging.backends={list(cfg.logging.backends)} names a backend twice; name each once")
    return problems


def open_loggers(cfg: Any, pm, run_dir: str) -> Loggers:
    """Rank 0's loggers, opened now; a backend that cannot start is a ConfigError
    naming it and why (the loggers opened before it are closed)."""
    opened: List[Any] = []
    name = "jsonl"
    try:
        opened.append(JsonlLogger(os.path.join(run_dir, "metrics.jsonl")))  # always: the run's own record
        for name in cfg.logging.backends:
            if name == "jsonl":
                continue
            made = pm.hook.hpctrain_make_logger(name=name, cfg=cfg, run_dir=run_dir)
            if made is None:
                raise ConfigError(f"logging.backends: no plugin made a {name!r} logger; install its plugin "
                                  "or remove it from logging.backends")
            lacking = [m for m in ("log", "flush", "close") if not callable(getattr(made, m, None))]
            if lacking:
                raise ConfigError(f"logging.backends: the {name!r} logger its plugin made has no "
                                  f"{', '.join(lacking)} method; fix the plugin (hpctrain_make_logger's object has "
                                  "log(step, metrics), flush() and close()) or remove it from logging.backends")
            opened.append(made)
    except Exception as e:
        for lg in opened:
            try:
                lg.close()
            except Exception:  # noqa: BLE001 - the error that stopped the start is the one to report
                pass
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"logging.backends: the {name!r} logger could not start: {type(e).__name__}: {e}; "
                          f"fix it or remove {name} from logging.backends") from e
    return Loggers(opened)
