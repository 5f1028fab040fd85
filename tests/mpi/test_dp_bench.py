"""Smoke runs of ``hpctrain-bench comm`` and ``hpctrain-bench dp`` (tiny sizes,
no timing asserted: benchmarks are not timed tests). What is checked: every
rank finishes, rank 0 prints a row per implementation, and in the dp
benchmark our data parallelism and torch DDP end on the same loss (same model,
same data; tolerance 1e-4 relative for fp32 reassociation over 2 steps and
the 6 printed digits)."""
from __future__ import annotations

import re

import pytest

# Benchmark plumbing does not change with the rank count, and at 8
# oversubscribed ranks these smoke runs are slow.
MAX_RANKS = 4


@pytest.mark.mpi(min_size=2)
def test_comm_bench_prints_a_row_per_implementation(world, capsys):
    from hpctrain.bench import comm

    if world.Get_size() > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    code = comm.main(["--max-size", "16K", "--factor", "16", "--warmup", "1", "--iters", "2",
                      "--ops", "all_reduce,all_to_all", "--backends", "torch,mpi"])
    out = capsys.readouterr().out
    assert code == 0
    if world.Get_rank() == 0:
        assert "## all_reduce" in out and "## all_to_all" in out
        rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1 KiB", "16 KiB"))]
        impls = {r[2] for r in rows}
        assert {"raw-mpi4py", "raw-gloo", "torch(gloo)"} <= impls
        assert len(rows) == 2 * 2 * len(impls)  # ops x sizes x implementations


@pytest.mark.mpi(min_size=2)
def test_dp_bench_runs_and_agrees_with_ddp(world, capsys):
    from hpctrain.bench import dp

    if world.Get_size() > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    code = dp.main(["--steps", "2", "--warmup", "1", "--backends", "torch", "--phases", "model.d_model=32",
                    "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "trainer.seq_len=16"])
    out = capsys.readouterr().out
    assert code == 0
    if world.Get_rank() == 0:
        main, phases = out.split("## where the time goes")
        loss = {line.split()[0]: float(line.split()[-1]) for line in main.splitlines()
                if line.startswith(("hpctrain[torch]", "torch DDP"))}
        assert set(loss) == {"hpctrain[torch]", "torch"}
        assert loss["hpctrain[torch]"] == pytest.approx(loss["torch"], rel=1e-4)
        floor_row = next(line.split() for line in main.splitlines() if line.startswith("local (no comm)"))
        assert float(floor_row[-2]) == 1.0  # the floor's paired ratio to itself
        # one row per phase: the floor's milliseconds, then a difference per other contender
        cells = [re.split(r"\s{2,}", line.strip()) for line in phases.splitlines()[3:] if line.strip()]
        rows = {c[0]: c[1:] for c in cells}
        assert list(rows) == list(dp.PHASES)
        assert all(len(cells) == 3 for cells in rows.values())  # floor, hpctrain[torch], torch DDP
        assert float(rows["forward"][0]) > 0
