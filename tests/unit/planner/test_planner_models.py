"""Unit behaviour of the planner's building blocks: collectives, schedules,
parameters per rank, layouts and the shared validator."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpctrain.config.validate import check_layout
from hpctrain.pipeline.bubble import bubble_fraction, bubble_time, check_schedule, in_flight
from hpctrain.planner import comm_model as cm
from hpctrain.planner.arch import Arch
from hpctrain.planner.layouts import Layout, enumerate_layouts

INTRA, INTER = cm.Link(busbw=100e9, alpha=0.0), cm.Link(busbw=10e9, alpha=0.0)


# -- collectives ----------------------------------------------------------------
@pytest.mark.parametrize("kind,n,factor", [("all_reduce", 8, 2 * 7 / 8), ("all_gather", 8, 7 / 8),
                                            ("reduce_scatter", 4, 3 / 4), ("all_to_all", 2, 1 / 2), ("p2p", 2, 1.0)])
def test_busbw_factors_follow_nccl_tests(kind, n, factor):
    assert cm.bus_factor(kind, n) == pytest.approx(factor)
    # time = bytes / algbw and algbw = busbw / factor
    assert cm.flat_time(kind, 1e9, n, INTRA) == pytest.approx(1e9 * factor / INTRA.busbw)


def test_alpha_term_counts_ring_steps():
    link = cm.Link(busbw=1e30, alpha=1e-6)
    assert cm.flat_time("all_reduce", 1, 8, link) == pytest.approx(14e-6)
    assert cm.flat_time("all_gather", 1, 8, link) == pytest.approx(7e-6)
    assert cm.flat_time("all_reduce", 1e9, 1, link) == 0.0


def test_hierarchical_all_reduce():
    nbytes, n_in, n_out = 8e9, 8, 4
    t = cm.group_time("all_reduce", nbytes, n_in, n_out, INTRA, INTER)
    expect = (2 * nbytes * 7 / 8 / INTRA.busbw) + (nbytes / 8) * 2 * 3 / 4 / INTER.busbw
    assert t == pytest.approx(expect)
    # cheaper than a flat ring over the slow link, equal to the flat ring within a node
    assert t < cm.flat_time("all_reduce", nbytes, 32, INTER)
    assert cm.group_time("all_reduce", nbytes, 8, 1, INTRA, INTER) == cm.flat_time("all_reduce", nbytes, 8, INTRA)


def test_group_placement():
    assert cm.placement(1, 8, 8) == (8, 1)      # tp=8 fills a node
    assert cm.placement(8, 4, 8) == (1, 4)      # dp across 4 nodes
    assert cm.placement(2, 16, 8) == (4, 4)     # dp after tp=2: 4 per node, 4 nodes


# -- schedules ------------------------------------------------------------------
def test_bubbles():
    p, m, v = 8, 32, 4
    assert bubble_fraction("1f1b", p, 1, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_time("interleaved", p, v, 1, 2, 1) == pytest.approx(bubble_time("1f1b", p, 1, 1, 2, 1) / v)
    # ZB-H1 with T_F = T_B = T_W (t_b = 2 t_f, t_w = t_f): a third of 1F1B
    assert bubble_time("zb-h1", p, 1, 1, 2, 1) == pytest.approx(bubble_time("1f1b", p, 1, 1, 2, 1) / 3)
    assert bubble_time("none", 1, 1, 1, 2, 1) == 0


def test_in_flight_micro_batches():
    assert in_flight("1f1b", 8, 1, 32, stage=0) == 8 and in_flight("1f1b", 8, 1, 32, stage=7) == 1
    assert in_flight("1f1b", 8, 1, 4, stage=0) == 4
    assert in_flight("gpipe", 8, 1, 32, stage=0) == 32
    assert in_flight("interleaved", 8, 2, 32, stage=0) == pytest.approx(8 * (1 + 7 / 16))
    assert "multiple of parallel.pp" in check_schedule("interleaved", 4, 2, 6)


# -- our model's counts -----------------------------------------------------------
def test_llama3_8b_parameters_and_tp_shards(make_config):
    arch = Arch.from_model_config(make_config("model=llama3-8b").model)
    assert arch.total_params == 8_030_261_248  # Meta's published count
    # per-rank matrices add back up; kv heads (8) are split up to tp=8 and replicated beyond
    for tp in (1, 2, 4, 8):
        assert tp * (arch.layer_params_per_rank(tp) - arch.norm_params) == arch.layer_params - arch.norm_params
    assert arch.kv_dim_per_rank(16) == arch.head_dim


def test_moe_counts():
    base = Arch.from_model_config(SimpleNamespace(
        vocab_size=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=None, ffn_hidden=128,
        ffn_multiple_of=32, tie_embeddings=False), num_experts=8, top_k=2)
    dense = Arch.from_model_config(SimpleNamespace(
        vocab_size=1000, d_model=64, n_layers=2, n_heads=4, n_kv_heads=None, ffn_hidden=128,
        ffn_multiple_of=32, tie_embeddings=False))
    assert base.total_params == dense.total_params + 2 * (7 * dense.expert_params + 64 * 8)
    assert base.active_params == dense.total_params + 2 * (dense.expert_params + 64 * 8)
    assert (base.layer_params_per_rank(1, ep=4)
            == dense.layer_params - dense.expert_params + 2 * dense.expert_params + 64 * 8)


def test_mixtral_8x7b_parameters(make_config):
    arch = Arch.from_model_config(make_config("model=mixtral-8x7b").model)
    assert (arch.num_experts, arch.top_k) == (8, 2)
    assert arch.total_params == 46_702_792_704  # Mistral's published 46.7B
    assert arch.active_params == 12_879_925_248  # 12.9B used per token (2 of 8 experts)


def test_moe_every_and_shared_experts_counts(make_config):
    every = Arch.from_model_config(make_config("model=tiny-moe", "model.n_layers=4", "model.moe.every=2").model)
    dense = Arch.from_model_config(make_config("model=tiny", "model.ffn_hidden=64", "model.n_layers=4").model)
    moe_block = dense.layer_params - dense.expert_params + 4 * dense.expert_params + 64 * 4
    assert every.n_moe_layers == 2 and [every.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert every.total_params == dense.total_params + 2 * (moe_block - dense.layer_params)
    shared = Arch.from_model_config(make_config("model=tiny-moe", "model.moe.shared_experts=2").model)
    assert shared.layer_params == moe_block + 2 * dense.expert_params
    assert shared.active_params == shared.total_params - 2 * 2 * dense.expert_params  # 2 of 4 routed unused


# -- layouts use the training validator ---------------------------------------------
def test_check_layout_gives_the_training_messages(make_config, pm):
    from hpctrain.config.validate import validate

    cfg = make_config("trainer.global_batch_size=10", "trainer.micro_batch_size=2")
    assert check_layout({"dp": -1}, cfg.trainer, cfg.model, 4) == validate(cfg, 4, pm)
    (p,) = check_layout({"dp": 3}, cfg.trainer, cfg.model, 4)
    assert p == "tp(1) * cp(1) * ep(1) * dp(3) * pp(1) = 3 != world size 4; launch 3 ranks or set parallel.dp=-1"


def test_enumeration_rules(make_config):
    cfg = make_config("model=llama3-8b")
    arch = Arch.from_model_config(cfg.model)
    layouts, rejected = enumerate_layouts(arch, cfg.model, 64, 4096, 16, 8)
    assert layouts and all(lay.gpus == 16 for lay in layouts)
    assert all(lay.tp <= 8 and 64 % (lay.dp * lay.micro_batch) == 0 for lay in layouts)
    assert {lay.zero for lay in layouts if lay.pp > 1} == {0, 1, 2, 3}  # every stage goes with a pipeline
    assert {lay.recompute for lay in layouts} == {"none", "selective", "full"}
    assert {lay.zero for lay in layouts} == {0, 1, 2, 3}
    assert {lay.schedule for lay in layouts if lay.pp > 1} == {"1f1b", "interleaved", "zb-h1"}
    assert any(lay.vpp > 1 for lay in layouts)
    assert all(lay.sp == (lay.tp > 1) for lay in layouts)
    # a batch that dp cannot split is rejected with the validator's own message
    _, rejected = enumerate_layouts(arch, cfg.model, 6, 4096, 16, 8, pins={"tp": 1, "pp": 1, "cp": 1})
    assert any("is not divisible by dp(16)" in msg for msg in rejected)


def test_pins_are_respected(make_config):
    cfg = make_config("model=llama3-8b")
    arch = Arch.from_model_config(cfg.model)
    layouts, _ = enumerate_layouts(arch, cfg.model, 64, 4096, 16, 8, pins={"pp": 2, "micro_batch": 1, "zero": 1})
    assert layouts and {(lay.pp, lay.micro_batch, lay.zero) for lay in layouts} == {(2, 1, 1)}
    assert Layout(2, 1, 1, 4, 2, 1).label() == "tp2 dp4 pp2 none"


def test_expert_parallel_layouts():
    from hpctrain.planner.cluster import cluster_spec
    from hpctrain.planner.estimate import Workload, estimate
    from hpctrain.planner.memory import HPCTRAIN

    shape = SimpleNamespace(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=512,
                            ffn_multiple_of=32, tie_embeddings=False, max_seq_len=2048)
    moe = Arch.from_model_config(shape, num_experts=8, top_k=2)
    layouts, _ = enumerate_layouts(moe, shape, 64, 2048, 16, 8)
    assert {lay.ep for lay in layouts} == {1, 2, 4, 8}
    cluster = cluster_spec(SimpleNamespace(name="c", gpus=16, gpus_per_node=8, gpu_mem_gb=80, peak_tflops=989,
                                           intra_bw_gbs=450, inter_bw_gbs=50))
    work = Workload(64, 2048, "bf16", HPCTRAIN)
    one, four = (estimate(moe, Layout(1, 1, ep, 16 // ep, 1, 1), work, cluster) for ep in (1, 4))
    assert one.comm_bytes["ep"] == 0 < four.comm_bytes["ep"]
    assert four.memory.weights < one.memory.weights  # experts sharded 4 ways
    dense_part = moe.total_params - 4 * 8 * moe.expert_params
    assert four.memory.weights == pytest.approx(4 * (dense_part + 4 * 2 * moe.expert_params))
