"""Smoke run of ``hpctrain-bench loggers`` (a tiny model, 3 steps; no timing
asserted: benchmarks are not timed tests): it is listed, runs both rows,
and rank 0's logging time is counted with every backend and is nothing
without one."""
from __future__ import annotations


def test_loggers_bench_runs_both_rows(capsys):
    from hpctrain.bench import cli, loggers

    assert cli.main(["--list"]) == 0
    assert "loggers " in capsys.readouterr().out
    assert loggers.main(["--steps", "2", "--warmup", "1", "model.d_model=64", "model.n_layers=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0]: line.split() for line in out if line.startswith(("every backend", "no backend"))}
    assert set(rows) == {"every backend", "no backend"}, out
    assert float(rows["every backend"][4]) > 0 and float(rows["no backend"][4]) < float(rows["every backend"][4])
    assert any(line.startswith("period with every backend / without: ") for line in out)
