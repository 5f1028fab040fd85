"""metrics.jsonl is written whatever logging.backends names: ``logging.backends=[wandb]`` alone wrote
none, so hpctrain-report (and hpctrain-plan --compare, a sweep's summary) had nothing to read."""
from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("backends", ["[wandb]", "[]"])
def test_metrics_jsonl_is_written_with_any_backends(tmp_path, capfd, monkeypatch, backends):
    pytest.importorskip("wandb")
    from hpctrain.cli import main
    from hpctrain.report.cli import main as report

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert main([f"logging.backends={backends}", "trainer.steps=2", "trainer.progress=off",
                 f"hydra.run.dir={run}"]) == 0, capfd.readouterr()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    if backends == "[wandb]":
        assert list((run / "wandb").glob("offline-run-*"))  # and the backend asked for
    assert report([str(run)]) == 0 and (run / "report.html").exists()
