"""``logging.backends=[...,mlflow]``: MLflow tracking, a local file store by default.

The client is given its tracking URI explicitly (no process-wide
``mlflow.set_tracking_uri``), so a sweep in one process, or a program that
uses MLflow itself, is not redirected. The run is named ``logging.name`` in
the experiment ``logging.mlflow.experiment`` (default ``logging.group``: a
sweep's points share one); the resolved config is logged as parameters.
``mlflow-skinny`` is enough (the client and the file store, without the
server's dependencies).
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from hpctrain import hookimpl
from hpctrain.train.loggers import logging_dir, run_group, run_name

from hpctrain_loggers.checks import missing_library
from hpctrain_loggers.config import MlflowConfig

NAME = "mlflow"


def tracking_uri(cfg: Any, run_dir: str) -> str:
    uri = cfg.logging.mlflow.tracking_uri
    return str(uri) if uri else "file:" + os.path.abspath(os.path.join(logging_dir(cfg, run_dir), "mlruns"))


def flat_params(cfg: Any) -> Dict[str, str]:
    out: Dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)[:500]  # MLflow's limit on a parameter's value

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out


class MlflowLogger:
    def __init__(self, cfg: Any, run_dir: str):
        from mlflow.entities import Param  # optional: the mlflow extra
        from mlflow.tracking import MlflowClient  # optional: the mlflow extra

        self.uri = tracking_uri(cfg, run_dir)
        if self.uri.startswith("file:"):
            # MLflow 3 keeps the file store in "maintenance mode" and refuses it unless this is set; it is what
            # works offline on a shared file system with no database (the sqlite store needs SQLAlchemy, alembic)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=self.uri)
        experiment = str(cfg.logging.mlflow.experiment or run_group(cfg))
        found = self._client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        run = self._client.create_run(exp_id, run_name=run_name(cfg, run_dir), tags={"hpctrain.run_dir": run_dir})
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flat_params(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])
        self._pending: List[Any] = []

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional: the mlflow extra

        now = int(time.time() * 1000)
        self._pending += [Metric(k, v, now, step) for k, v in metrics.items()]
        if len(self._pending) >= 900:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self._pending), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=self._pending[i:i + 1000])
        self._pending = []

    def close(self) -> None:
        self.flush()
        self._client.set_terminated(self.run_id)


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"logging.backend": [NAME]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"logging.mlflow": MlflowConfig}


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> List[str]:
    return missing_library(cfg, NAME, "mlflow", "mlflow")


@hookimpl
def hpctrain_make_logger(name: str, cfg: Any, run_dir: str) -> Optional[MlflowLogger]:
    return MlflowLogger(cfg, run_dir) if name == NAME else None
