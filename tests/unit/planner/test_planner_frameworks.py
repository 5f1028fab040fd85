"""Memory as the codes of the published runs keep it, and every published layout expressible (issue 55
items 2 and 3): mixed-precision model states, 16-bit and per-op-checkpointed activations, the GiB
capacity, virtual stages that divide the blocks, the nemotron family, and refusals that name their
reason."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpctrain.model.shapes import ModelShape
from hpctrain.planner import activations as act
from hpctrain.planner.arch import Arch
from hpctrain.planner.cluster import cluster_spec
from hpctrain.planner.estimate import Workload, estimate
from hpctrain.planner.frameworks import FRAMEWORKS, FSDP2_MP, MEGATRON_DISTOPT
from hpctrain.planner.layouts import Layout, enumerate_layouts, vpp_choices
from hpctrain.planner.memory import model_states
from hpctrain.planner.search import model_config_for

LLAMA_8B = Arch.from_shape(ModelShape(128256, 4096, 32, 32, 8, 14336, False))
GPT3 = Arch.gpt(96, 12288, 96, 51200, 2048)


def test_mixed_precision_model_states():
    """Megatron's distributed optimizer: bf16 weights (2), fp32 main gradients (4), fp32 masters and Adam
    moments (12) sharded over dp; FSDP2 mixed precision: everything fp32 and sharded (16 / dp)."""
    p, d = 1e9, 8
    assert model_states(p, 1, d, MEGATRON_DISTOPT).total == pytest.approx(p * (6 + 12 / d))
    assert model_states(p, 3, d, FSDP2_MP).total == pytest.approx(p * 16 / d)


def test_fused_16bit_llama_block_and_torchtitans_op_sac():
    h, kv, f, a = 4096, 1024, 14336, 32
    fused = act.layer_bytes_per_token(LLAMA_8B, "bf16", 8192, profile="megatron")
    # x, norm out, q, k, v, attention out, FFN residual, norm out, gate, up, product (16-bit); stats, lse (fp32)
    assert fused == pytest.approx(2 * (h + h + h + kv + kv + h + h + h + 3 * f) + 4 * (2 + 2) + 4 * a)
    sac = act.layer_bytes_per_token(LLAMA_8B, "bf16", 8192, recompute="selective", profile="torchtitan")
    # block input, wq, wv, attention out + lse, w1, w2 outputs (parallelize_llama.py's policy)
    assert sac == pytest.approx(2 * (h + h + kv + h + f + h) + 4 * a)
    assert sac < fused / 1.5


def test_gpt_with_flash_attention_keeps_no_score_matrix():
    s = 2048
    paper = act.layer_bytes_per_token(GPT3, "bf16", s, tp=8, sp=True)
    flash = act.layer_bytes_per_token(GPT3, "bf16", s, tp=8, sp=True, profile="megatron", flash=True)
    h, a = GPT3.d_model, GPT3.n_heads
    assert paper - flash == pytest.approx((5 * a * s - 4 * a) / 8)  # the 5as/t bytes out, the fp32 lse in
    no_dropout = act.layer_bytes_per_token(GPT3, "bf16", s, tp=8, sp=True, profile="megatron", flash=True,
                                           dropout=False)
    assert flash - no_dropout == pytest.approx(2 * h / 8)  # the two 1-byte masks of the residual dropouts


def test_torchtitans_8b_fsdp_fits_its_96gb_h100s():
    """The issue's refusal: Llama 3.1 8B, FSDP over 8 GPUs, local batch 2, per-op selective checkpointing;
    torchtitan measured 82.4 GiB reserved on 96 GB parts. The planner must let it fit."""
    cluster = cluster_spec(SimpleNamespace(name="h100-96gb-gt", gpus=8, gpus_per_node=8, gpu_mem_gb=96,
                                           peak_tflops=989, intra_bw_gbs=450, inter_bw_gbs=50))
    fw = FRAMEWORKS["torchtitan-eager"]
    work = Workload(16, 8192, "bf16", fw.states, framework=fw)
    e = estimate(LLAMA_8B, Layout(1, 1, 1, 8, 1, 2, zero=3, recompute="selective"), work, cluster)
    assert e.fits and 50e9 < e.memory.total < cluster.mem_bytes


def test_nemotron_family_counts():
    arch = Arch.nemotron(96, 18432, 96, 8, 73728, 256000)
    attention = 2 * 18432 ** 2 + 2 * 18432 * 1536
    assert arch.layer_params == attention + 2 * 18432 * 73728 + 4 * 18432
    assert arch.total_params == 96 * arch.layer_params + 2 * 256000 * 18432 + 2 * 18432
    assert 340e9 < arch.total_params < 342e9
    assert arch.layer_forward_flops_per_token(4096) == pytest.approx(
        2 * (2 * 18432 ** 2 + 2 * 18432 * 1536) + 2 * 2 * 18432 * 73728 + 4 * 4096 * 96 * 192)


def test_any_vpp_that_divides_the_stage():
    assert vpp_choices(96, 8) == [2, 3, 4, 6, 8, 12]
    assert vpp_choices(126, 16) == [2, 4]  # blocks do not divide: the powers of two (uneven chunks)
    cfg = model_config_for(GPT3, 2048)
    layouts, _ = enumerate_layouts(GPT3, cfg, 64, 2048, 64, 8, {"tp": 8, "pp": 8, "cp": 1, "ep": 1, "vpp": 3,
                                                                   "schedule": "interleaved", "micro_batch": 1})
    assert layouts and {lay.vpp for lay in layouts} == {3}
    # Megatron's rule: the blocks divide into pp x vpp equal chunks (126 on 16 x 4 do not)
    llama = Arch.from_shape(ModelShape(1000, 256, 126, 8, 8, 512, False))
    even, why = enumerate_layouts(llama, model_config_for(llama, 2048), 512, 2048, 128, 8,
                                  {"tp": 8, "pp": 16, "cp": 1, "ep": 1, "schedule": "interleaved"},
                                  even_chunks=True)
    assert not even and any("needs pp x vpp equal chunks" in r for r in why)
    uneven, _ = enumerate_layouts(llama, model_config_for(llama, 2048), 512, 2048, 128, 8,
                                  {"tp": 8, "pp": 16, "cp": 1, "ep": 1, "schedule": "interleaved"})
    assert {lay.vpp for lay in uneven} == {2, 4}  # hpctrain's pipeline takes uneven chunks


def test_refusals_name_their_reason():
    cfg = model_config_for(GPT3, 2048)
    _, why = enumerate_layouts(GPT3, cfg, 64, 2048, 64, 8, {"tp": 8, "pp": 8, "cp": 1, "ep": 1, "dp": 2})
    assert any("tp(8) * cp(1) * ep(1) * dp(2) * pp(8) = 128 != 64 GPUs" in r for r in why)
    _, why = enumerate_layouts(GPT3, cfg, 64, 2048, 64, 8, {"schedule": "zb-h1"}, schedules=("1f1b", "interleaved"))
    assert any("schedule zb-h1 is not available in this training code" in r for r in why)
    _, why = enumerate_layouts(GPT3, cfg, 64, 2048, 64, 8, {"zero": 3}, zeros=(0,))
    assert any("zero 3 is not available" in r for r in why)


def test_every_code_is_cited_and_consistent():
    for fw in FRAMEWORKS.values():
        assert fw.source and fw.attention in ("flash", "unfused") and fw.activations in act.PROFILES
        assert fw.tp_overlap in ("none", "backward", "full") and set(fw.zero) <= {0, 1, 2, 3}
        assert set(fw.schedules) <= {"1f1b", "interleaved", "zb-h1"}


def test_hpctrains_autocast_copies_live_per_micro_batch_in_flight():
    """hpctrain's autocast keeps a bf16 copy of each weight its backward saved, per micro-batch (the cache
    lives for one forward): under a pipeline every micro-batch in flight holds its own copies of the
    row-parallel weights (what hpctrain-train's dry run measured); fp32 runs have none; full recompute keeps
    one transient set."""
    work = Workload(64, 4096, "bf16", FRAMEWORKS["hpctrain"].states)
    base = dict(tp=8, cp=1, ep=1, dp=2, pp=4, micro_batch=1, schedule="1f1b")
    from hpctrain.planner.estimate import stage_memory

    full = stage_memory(LLAMA_8B, Layout(**base, recompute="full"), work, 0)
    held = stage_memory(LLAMA_8B, Layout(**base), work, 0)
    from hpctrain.planner.layouts import per_rank_layers

    blocks = per_rank_layers(LLAMA_8B, Layout(**base))[0]  # the first stage's (auto split: [7, 9, 9, 7])
    rows = blocks * (4096 * 4096 // 8 + 4096 * 14336 // 8)  # wo and w2 per block, tp 8
    replay = stage_memory(LLAMA_8B, Layout(**base, recompute="full"), work, 0).buffers - 2 * (
        held.weights / 4)  # full recompute: one transient copy of the stage, plus one block rematerialised
    assert held.buffers == pytest.approx(2 * held.weights / 4 + 2 * rows * 3)  # 4 in flight: 3 more copies
    assert replay > 0 and full.buffers < held.buffers
    fp32 = stage_memory(LLAMA_8B, Layout(**base), Workload(64, 4096, "fp32", FRAMEWORKS["hpctrain"].states), 0)
    assert fp32.buffers == 0


def test_a_schedule_pin_or_a_code_without_interleaving_is_kept():
    cfg = model_config_for(GPT3, 2048)
    pins = {"tp": 8, "pp": 8, "cp": 1, "ep": 1, "micro_batch": 1}
    one, _ = enumerate_layouts(GPT3, cfg, 64, 2048, 64, 8, {**pins, "schedule": "1f1b"})
    assert one and {lay.schedule for lay in one} == {"1f1b"}
    code, _ = enumerate_layouts(GPT3, cfg, 64, 2048, 64, 8, pins, schedules=("1f1b",))
    assert code and {lay.schedule for lay in code} == {"1f1b"}


def test_interleaved_layouts_count_micro_batches_over_dp_and_ep():
    """The pipeline plugin splits samples over dp x ep: an interleaved layout is offered only where
    those micro-batches are a multiple of pp (counting them over dp alone let ep8 dp16 pp2 through
    with 15 micro-batches, and the memory estimate raised on it)."""
    shape = ModelShape(256, 64, 8, 4, 4, 128, False)
    moe = Arch.from_shape(shape, num_experts=8, top_k=2)
    cfg = model_config_for(moe, 64)
    # 1,920 samples on 256 GPUs at ep8 pp2: dp 16, 120 micro-batches per dp rank but 15 per dp x ep rank
    layouts, _ = enumerate_layouts(moe, cfg, 1920, 64, 256, 8, {"tp": 1, "cp": 1, "ep": 8, "pp": 2, "micro_batch": 1})
    assert layouts and not [lay for lay in layouts if lay.schedule == "interleaved"]
    layouts, _ = enumerate_layouts(moe, cfg, 512, 64, 64, 8, {"tp": 1, "cp": 1, "ep": 8, "pp": 2, "micro_batch": 1})
    interleaved = [lay for lay in layouts if lay.schedule == "interleaved"]
    assert interleaved and all(lay.microbatches(512) % lay.pp == 0 for lay in interleaved)
