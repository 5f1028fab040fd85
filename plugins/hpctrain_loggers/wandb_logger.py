"""``logging.backends=[...,wandb]``: Weights & Biases, offline by default.

Offline runs are written under ``<logging.dir>/wandb/offline-run-*`` and
uploaded later from a machine with internet by ``wandb sync <that dir>``.
The run is named ``logging.name`` and grouped by ``logging.group`` (a
sweep's points share the sweep's group); the resolved config is the run's
config.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from hpctrain import hookimpl
from hpctrain.train.loggers import logging_dir, run_group, run_name

from hpctrain_loggers.checks import missing_library
from hpctrain_loggers.config import WandbConfig

NAME = "wandb"
MODES = ("offline", "online", "disabled")


class WandbLogger:
    def __init__(self, cfg: Any, run_dir: str):
        import wandb  # optional: the wandb extra

        w = cfg.logging.wandb
        self.dir = logging_dir(cfg, run_dir)
        os.makedirs(self.dir, exist_ok=True)
        self._run = wandb.init(project=w.project, entity=w.entity, mode=w.mode, dir=self.dir,
                               group=run_group(cfg), name=run_name(cfg, run_dir),
                               config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
                               settings=wandb.Settings(silent=True, console="off"), reinit="create_new")

    @property
    def run_path(self) -> str:
        """The run's own directory (offline: what ``wandb sync`` takes)."""
        return os.path.dirname(self._run.dir)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def flush(self) -> None:
        pass  # the W&B service writes as it receives

    def close(self) -> None:
        self._run.finish()


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"logging.backend": [NAME]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"logging.wandb": WandbConfig}


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> List[str]:
    problems = missing_library(cfg, NAME, "wandb", "wandb")
    if NAME in cfg.logging.backends and cfg.logging.wandb.mode not in MODES:
        problems.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r} is not one of {', '.join(MODES)}")
    return problems


@hookimpl
def hpctrain_make_logger(name: str, cfg: Any, run_dir: str) -> Optional[WandbLogger]:
    return WandbLogger(cfg, run_dir) if name == NAME else None
