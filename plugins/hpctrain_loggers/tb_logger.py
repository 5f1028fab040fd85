"""``logging.backends=[...,tensorboard]``: event files through ``torch.utils.tensorboard``.

One directory per run, ``<logging.dir>/tensorboard/<run name>``, so
``tensorboard --logdir <logging.dir>/tensorboard`` shows a sweep's points
side by side. Every metric is a scalar at its step.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional

from hpctrain import hookimpl
from hpctrain.train.loggers import logging_dir, run_name

from hpctrain_loggers.checks import missing_library
from hpctrain_loggers.config import TensorBoardConfig

NAME = "tensorboard"


def event_dir(cfg: Any, run_dir: str) -> str:
    """``<logging.dir>/tensorboard/<run name>``, the name kept to characters every file system takes."""
    return os.path.join(logging_dir(cfg, run_dir), "tensorboard", re.sub(r"[^\w.=,+-]+", "_", run_name(cfg, run_dir)))


class TensorBoardLogger:
    def __init__(self, cfg: Any, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard extra

        self.dir = event_dir(cfg, run_dir)
        os.makedirs(self.dir, exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.dir, flush_secs=int(cfg.logging.tensorboard.flush_secs))

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"logging.backend": [NAME]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"logging.tensorboard": TensorBoardConfig}


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> List[str]:
    problems = missing_library(cfg, NAME, "tensorboard", "tensorboard")
    if NAME in cfg.logging.backends and cfg.logging.tensorboard.flush_secs < 1:
        problems.append(f"logging.tensorboard.flush_secs={cfg.logging.tensorboard.flush_secs}: must be an "
                        "integer >= 1 (seconds)")
    return problems


@hookimpl
def hpctrain_make_logger(name: str, cfg: Any, run_dir: str) -> Optional[TensorBoardLogger]:
    return TensorBoardLogger(cfg, run_dir) if name == NAME else None
