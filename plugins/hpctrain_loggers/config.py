"""Each backend's config section (``logging.tensorboard``, ``logging.wandb``, ``logging.mlflow``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TensorBoardConfig:
    """TensorBoard event files (``torch.utils.tensorboard``)."""

    flush_secs: int = 30
    """Seconds between the writer's flushes to disk (also flushed every trainer.log_every steps and at the end)."""


@dataclass
class WandbConfig:
    """Weights & Biases; offline unless told otherwise (compute nodes rarely reach the internet)."""

    mode: str = "offline"
    """offline (files under <logging.dir>/wandb; upload later with `wandb sync <dir>`), online or disabled."""
    project: str = "hpctrain"
    """The W&B project."""
    entity: Optional[str] = None
    """The W&B team or user; None: the account's default."""


@dataclass
class MlflowConfig:
    """MLflow tracking."""

    tracking_uri: Optional[str] = None
    """Where runs go; None: a file store, <logging.dir>/mlruns (browse it with `mlflow ui --backend-store-uri
    <that directory>`). A server (http://...) works when the nodes reach it."""
    experiment: Optional[str] = None
    """The MLflow experiment; None: logging.group (a sweep's points share one experiment)."""
