"""A Hydra sweep in one process: each point's train.log holds only its own
lines (file handlers of earlier points are removed), and each point is a
run of its own in every logger backend, grouped by the sweep. (``--help``:
tests/unit/test_cli_one_process.py.)"""
import glob
import os
import subprocess
import sys

from test_launchers import TIMEOUT, _env
from wandb_records import run_group


def _hpctrain(args, cwd):
    r = subprocess.run([sys.executable, "-m", "hpctrain", *args], env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=cwd)
    return r.returncode, r.stdout + r.stderr


def test_a_3_point_sweep_leaves_three_logs_of_their_own_and_three_runs_per_backend(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    code, out = _hpctrain(["--multirun", "trainer.steps=2", "trainer.log_every=1", "trainer.progress=off",
                           "optim.lr=1e-3,2e-3,3e-3", "logging.backends=[jsonl,tensorboard,wandb,mlflow]",
                           f"hydra.sweep.dir={sweep}"], tmp_path)
    assert code == 0, out
    counts = []
    for point, lr in enumerate(("0.001", "0.002", "0.003")):
        lines = (sweep / str(point) / "train.log").read_text().splitlines()
        counts.append(len(lines))
        assert sum("model tiny:" in ln for ln in lines) == 1, lines
        done = [ln for ln in lines if " done: " in ln]
        assert len(done) == 1 and str(sweep / str(point) / "metrics.jsonl") in done[0], lines
        assert all(str(sweep / str(other)) not in ln for ln in lines for other in range(3) if other != point)
        assert (sweep / str(point) / "metrics.jsonl").read_text().count("\n") == 2
        assert any(f"lr {float(lr) * 2 / 5:.2e}" in ln for ln in lines), (lr, lines)  # warmup: step 2 of 5
    assert counts[0] == counts[1] == counts[2], counts
    # every backend: one run per point, side by side under the sweep directory, grouped by the sweep
    assert sorted(os.listdir(sweep / "tensorboard")) == ["0_optim.lr=0.001", "1_optim.lr=0.002", "2_optim.lr=0.003"]
    runs = glob.glob(str(sweep / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 3 and {run_group(r) for r in runs} == {str(sweep)}
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
    client = MlflowClient(tracking_uri=f"file:{sweep}/mlruns")
    exp = client.get_experiment_by_name(str(sweep))
    names = sorted(r.info.run_name for r in client.search_runs([exp.experiment_id]))
    assert names == ["0 optim.lr=0.001", "1 optim.lr=0.002", "2 optim.lr=0.003"]
