"""Smoke run of ``hpctrain-bench optim`` (tiny model, no timing asserted):
every rank finishes, rank 0 prints a row per optimizer at dp and at tp, and
each optimizer ends on the same loss at both layouts (the same model, init,
data and steps; 1e-4 relative covers fp32 reassociation over 2 steps and
the 6 printed digits)."""
from __future__ import annotations

import pytest

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "trainer.seq_len=16"]


@pytest.mark.mpi(min_size=2)
def test_optim_bench_runs_and_layouts_agree(world, capsys):
    from hpctrain.bench import optim

    if world.Get_size() != 2:
        pytest.skip("smoke-tested at 2 ranks (tiny model: 2 heads)")
    assert optim.main(["--steps", "2", "--warmup", "0", *TINY]) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in optim.OPTIMIZERS]
        assert [r[0] for r in rows] == list(optim.OPTIMIZERS) * 2
        dp, tp = rows[:4], rows[4:]
        assert rows[3][4] != "-" and rows[3][4].endswith("/7")  # Muon: rank 0's share of the 7 matrices
        for a, b in zip(dp, tp):
            assert float(a[-1]) == pytest.approx(float(b[-1]), rel=1e-4), (a, b)
