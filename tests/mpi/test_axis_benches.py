"""Smoke runs of ``hpctrain-bench zero``, ``tp``, ``pp``, ``moe`` and ``cp`` (tiny model, no
timing asserted: benchmarks are not timed tests). What is checked: every
rank finishes, rank 0 prints a row per contender, and the peer (FSDP2,
torch's tensor-parallel API, torch.distributed.pipelining) and ours end on
the same loss
(same model, init and data; 1e-4 relative covers fp32 reassociation over 2
steps and the 6 printed digits)."""
from __future__ import annotations

import pytest

MAX_RANKS = 4  # as test_dp_bench: the plumbing does not change with the rank count
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2", "trainer.seq_len=16"]


def _losses(out, labels):
    return {line.split()[0]: float(line.split()[-1]) for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in labels}


@pytest.mark.mpi(min_size=2)
def test_zero_bench_runs_and_agrees_with_fsdp2(world, capsys):
    from hpctrain_zero import bench as zero

    if world.Get_size() > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    assert zero.main(["--steps", "2", "--warmup", "0", "--no-rss", "--stages", "0,3", *TINY]) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        loss = _losses(out, {"FSDP2", "zero-0[mpi]", "zero-3[mpi]", "zero-3[torch]"})
        assert set(loss) == {"FSDP2", "zero-0[mpi]", "zero-3[mpi]", "zero-3[torch]"}
        assert all(v == pytest.approx(loss["FSDP2"], rel=1e-4) for v in loss.values())


@pytest.mark.mpi(min_size=2)
def test_tp_bench_runs_and_agrees_with_torch_tp(world, capsys):
    from hpctrain_tp import bench as tp

    n = world.Get_size()
    if n > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    heads = [f"model.n_heads={n}", f"model.n_kv_heads={n}", "model.d_model=32"]
    assert tp.main(["--steps", "2", "--warmup", "0", *TINY, *heads]) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        loss = _losses(out, {"torch-TP", "tp[mpi]", "tp[torch]"})
        assert set(loss) == {"torch-TP", "tp[mpi]", "tp[torch]"}
        assert all(v == pytest.approx(loss["torch-TP"], rel=1e-4) for v in loss.values())


@pytest.mark.mpi(min_size=2)
def test_pp_bench_runs_and_agrees_with_torch_pipelining(world, capsys):
    from hpctrain_pp import bench as pp

    n = world.Get_size()
    if n > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    model = [*TINY[:1], f"model.n_layers={2 * n}", *TINY[2:], "trainer.global_batch_size=8",
             "trainer.micro_batch_size=1"]
    assert pp.main(["--steps", "2", "--warmup", "0", "--bubble-steps", "1", *model]) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        def rows(part, numbers):  # label (may hold spaces) -> its last ``numbers`` columns
            return {" ".join(line.split()[:-numbers]): line.split()[-numbers:] for line in part.splitlines()
                    if line.startswith(("torch Schedule", "ours "))}

        steps = rows(out.split("## step time")[1].split("## bubble")[0], 4)
        bubbles = rows(out.split("## bubble")[1], 7)
        for schedule, (peer, _) in pp.SCHEDULES.items():
            ours = f"ours {schedule}[mpi]"
            assert float(steps[ours][-1]) == pytest.approx(float(steps[f"torch {peer}"][-1]), rel=1e-4), schedule
            assert float(bubbles[ours][2]) >= 0.0, schedule  # measured bubble


@pytest.mark.mpi(min_size=2)
def test_moe_bench_runs(world, capsys):
    """Every contender's row and the layer table; the bench itself checks
    that our exchange moves the same rows as raw Alltoallv."""
    from hpctrain_moe import bench as moe

    if world.Get_size() > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    small = ["model.d_model=32", "model.ffn_hidden=32", "model.moe.num_experts=4", "trainer.seq_len=16",
             "trainer.micro_batch_size=2"]
    assert moe.main(["--iters", "2", "--warmup", "0", *small]) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        first = {line.split()[0] for line in out.splitlines() if line.split()}
        assert {"raw-mpi4py", "exchange[mpi]", "ours[mpi]", "ours[torch]", "dispatch+combine[mpi]",
                "dispatch+combine[torch]",
                "one", f"ep={world.Get_size()}"} <= first


@pytest.mark.mpi(min_size=2)
def test_cp_bench_runs(world, capsys):
    """Every row of both tables; the bench itself checks each layout's
    output rows against one process's attention."""
    from hpctrain_cp import bench as cp

    n = world.Get_size()
    if n > MAX_RANKS:
        pytest.skip(f"smoke-tested at 2..{MAX_RANKS} ranks")
    assert cp.main(["--seq", str(16 * n), "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--iters", "1",
                    "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        for row in ("one process (sdpa)", f"ring, zigzag, cp={n}", f"ring, contiguous, cp={n}",
                    f"allgather, zigzag, cp={n}"):
            assert row in out
        assert sum(1 for line in out.splitlines() if line.startswith(("zigzag ", "contiguous "))) == 2
