"""``hpctrain-train --dry-run``: ranks of a 16-rank job played in this one process (``hpctrain.dry_run``).

For each layout (tp with sequence parallelism, pp, cp, ep on a MoE model, ZeRO-3)
the first and last rank's report holds the parameter bytes the shard sizes
give, computed here from the model's shape (``ModelShape``) and the layout
alone, and collectives on the layout's axes; the dry run's flags and the
request are checked before anything is built, and the command line prints
the report. The bytes the recording backend writes down are compared with
a real step's in ``tests/mpi/test_dry_run_bytes.py``.
"""
from __future__ import annotations

import math

import pytest

from hpctrain.dry_run import (
    DryRunFlags,
    check_launch,
    default_ranks,
    dry_run,
    report_text,
    request_problems,
    split_flags,
)
from hpctrain.errors import ConfigError
from hpctrain.model.shapes import ModelShape

WORLD = 16
BASE = ("trainer.global_batch_size=16", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off")
FP32 = 4


def _block(s: ModelShape, ffn: int, tp: int = 1) -> int:
    """Parameters of one dense block on a tp rank (the two norms whole)."""
    return (2 * s.q_dim * s.d_model + 2 * s.kv_dim * s.d_model + 3 * ffn * s.d_model) // tp + 2 * s.d_model


def _ends(s: ModelShape, tp: int = 1) -> int:
    """Embedding, final norm and head (untied) on a tp rank."""
    return 2 * s.vocab_size * s.d_model // tp + s.d_model


def expected_tp2(s, rank):
    return (s.n_layers * _block(s, s.ffn_hidden, 2) + _ends(s, 2)) * FP32


def expected_pp2(s, rank):  # blocks [2, 2]: the embedding on the first stage, the norm and head on the last
    blocks = 2 * _block(s, s.ffn_hidden)
    return (blocks + (s.vocab_size * s.d_model if rank < 8 else s.vocab_size * s.d_model + s.d_model)) * FP32


def expected_cp2(s, rank):  # cp splits the sequence only: every weight whole
    return (s.n_layers * _block(s, s.ffn_hidden) + _ends(s)) * FP32


def expected_ep2(s, rank):  # 4 experts of width 64, 2 per rank, and the router's (experts x d) weight
    attention = 2 * s.q_dim * s.d_model + 2 * s.kv_dim * s.d_model + 2 * s.d_model
    experts = 2 * 3 * 64 * s.d_model + 4 * s.d_model
    return (s.n_layers * (attention + experts) + _ends(s)) * FP32


def expected_zero3(s, rank):  # ZeRO's units (embedding, each block, head) cut into 16 equal padded chunks
    units = [s.vocab_size * s.d_model] + [_block(s, s.ffn_hidden)] * s.n_layers + [s.vocab_size * s.d_model
                                                                                     + s.d_model]
    return sum(math.ceil(n / WORLD) for n in units) * FP32


LAYOUTS = {
    "tp2-sp": (("parallel.tp=2",), expected_tp2, {"tp"}),
    "pp2": (("parallel.pp=2", "model.n_layers=4", "parallel.pipeline.layers=[2,2]"), expected_pp2, {"pp"}),
    "cp2": (("parallel.cp=2",), expected_cp2, {"cp"}),
    # 4 x 256 tokens x top-2: more assignments than _Values computes beside the meta tensors (its fallback)
    "ep2-moe": (("model=tiny-moe", "parallel.ep=2", "trainer.global_batch_size=64", "trainer.micro_batch_size=4",
                 "trainer.seq_len=256"), expected_ep2, {"ep"}),
    "zero3": (("parallel.zero.stage=3",), expected_zero3, {"dp"}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_holds_its_shards_and_talks_on_its_axes(make_config, pm, name):
    overrides, expected, axes = LAYOUTS[name]
    cfg = make_config(*BASE, *overrides)
    shape = ModelShape.from_config(cfg.model)
    reports = dry_run(cfg, DryRunFlags(WORLD, (0, WORLD - 1)), pm)
    assert [r.rank for r in reports] == [0, WORLD - 1]
    for r in reports:
        assert r.params == expected(shape, r.rank), (name, r.rank)
        assert r.grads > 0 and r.optimizer >= 2 * r.params, (name, r)  # AdamW: two moments per element
        assert r.activations > 0, (name, r)
        moved = r.bytes_by_axis()
        assert axes <= {a for a, b in moved.items() if b > 0}, (name, moved)
        assert all(rec.nbytes >= 0 and rec.peers for rec in r.records)
        assert r.planner.weights is not None or r.planner.problem, r.planner
    text = report_text(cfg, reports)
    assert f"rank {WORLD - 1} of {WORLD}" in text and "parameters" in text and "activation peak" in text, text


def test_defaults_play_the_first_rank_of_the_first_and_last_stage(make_config):
    cfg = make_config("parallel.tp=2", "parallel.pp=4")
    assert default_ranks(cfg, 64) == (0, 48)


def test_flags_are_split_from_the_overrides_and_checked():
    rest, flags = split_flags(["model=tiny", "--dry-run", "--world", "64", "--ranks=0,63", "trainer.steps=2"])
    assert rest == ["model=tiny", "trainer.steps=2"] and flags == DryRunFlags(64, (0, 63))
    assert split_flags(["trainer.steps=2"]) == (["trainer.steps=2"], None)
    for argv, message in ((["--dry-run"], "--dry-run needs the job's size"),
                          (["--dry-run", "--world", "0"], "--world 0: give the job's number of ranks"),
                          (["--dry-run", "--world"], "--world needs a value"),
                          (["--ranks", "3"], "add --dry-run")):
        with pytest.raises(ConfigError, match=message):
            split_flags(argv)


def test_a_launch_of_several_ranks_and_a_bad_request_are_refused(make_config, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="this launch started 8 ranks; run it without mpirun or srun"):
        check_launch(DryRunFlags(64))
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    check_launch(DryRunFlags(64))
    cfg = make_config("parallel.tp=2", "parallel.pp=4")
    assert request_problems(cfg, DryRunFlags(64, (0, 63))) == []
    assert "use --world a multiple of 8 (e.g. 96 or 104)" in request_problems(cfg, DryRunFlags(100))[0]
    assert "64 is outside the world of 64 ranks" in request_problems(cfg, DryRunFlags(64, (1, 64)))[0]


def test_the_command_line_prints_the_report(capfd, monkeypatch, tmp_path):
    from hpctrain.cli import main

    monkeypatch.chdir(tmp_path)
    code = main([*BASE, "parallel.tp=2", "--dry-run", "--world", str(WORLD), "--ranks", "3"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "dry run: tiny, rank 3 of 16" in out and "dry run of 1 rank(s) in" in out, out
    code = main([*BASE, "--dry-run", "--world", "16", "--ranks", "16"])
    _, err = capfd.readouterr()
    assert code == 2 and "hpctrain: error: --ranks 16: 16 is outside the world of 16 ranks" in err, err
