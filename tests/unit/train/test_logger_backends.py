"""logging.backends: a 3-step run writes the same numbers, step by step, to
metrics.jsonl, TensorBoard event files (read back with tensorboard's own
event reader), an offline W&B run directory (its .wandb records) and an
MLflow file store (read with MLflow's client). Only rank 0 logs; the
logger plugins are loaded through their entry points."""
from __future__ import annotations

import glob
import json
import math
import os

import pytest

from hpctrain.plugins import capabilities
from hpctrain.run import reference_trainer

from wandb_records import history

ALL = "logging.backends=[jsonl,tensorboard,wandb,mlflow]"


def _jsonl(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _expected(records):
    """{key: {step: value}} of every finite number (what every backend must hold)."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                out.setdefault(k, {})[r["step"]] = float(v)
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import create_manager

    pm = create_manager()
    run_dir = str(tmp_path_factory.mktemp("run"))
    cfg = compose_resolved(["trainer.steps=3", "trainer.log_every=2", ALL, "cluster.peak_tflops=0.1",
                            "logging.name=probe", "logging.group=g1", "trainer.progress=off"], pm)
    reference_trainer(cfg, pm, run_dir).fit()
    return run_dir, _expected(_jsonl(run_dir))


def test_the_backends_are_plugins_listed_under_logging_backend(pm):
    served = capabilities(pm)["logging.backend"]
    assert {"tensorboard", "wandb", "mlflow"} <= set(served)


def test_tensorboard_event_files_hold_every_scalar_at_every_step(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, want = logged
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard", "probe"), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(want)
    for key, by_step in want.items():
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == pytest.approx(by_step, rel=1e-6), key  # event files hold float32


def test_an_offline_wandb_run_holds_every_number_at_every_step(logged):
    run_dir, want = logged
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    rows = history(path)
    got = {}
    for row in rows:
        for k, v in row.items():
            if not k.startswith("_"):
                got.setdefault(k, {})[row["_step"]] = v
    assert set(got) == set(want)
    for key, by_step in want.items():
        assert got[key] == pytest.approx(by_step, rel=1e-12), key


def test_an_mlflow_file_store_holds_every_number_at_every_step(logged):
    from mlflow.tracking import MlflowClient

    run_dir, want = logged
    client = MlflowClient(tracking_uri="file:" + os.path.join(run_dir, "mlruns"))
    exp = client.get_experiment_by_name("g1")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "probe" and run.info.status == "FINISHED"
    assert run.data.params["trainer.steps"] == "3"
    assert set(run.data.metrics) == set(want)
    for key, by_step in want.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx(by_step, rel=1e-12), key


def test_the_numbers_users_compare_are_in_every_record(logged):
    _, want = logged
    for key in ("tokens_per_s", "tokens_per_s_per_device", "model_tflops_per_device", "mfu", "data_wait_s",
                "peak_rss_bytes"):
        assert sorted(want[key]) == [1, 2, 3], key
    # the memory over the ranks is gathered on log steps (log_every=2) and the last
    assert sorted(want["peak_rss_bytes.max"]) == [2, 3] and want["peak_rss_bytes.max_rank"] == {2: 0, 3: 0}
