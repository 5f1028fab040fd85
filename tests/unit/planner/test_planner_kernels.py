"""The kernel-level compute model (issue 55 item 1): GEMM rooflines with wave quantization, attention
kernels, memory-bound passes counted per code, the tensor-parallel overlap each code has, the cited
hardware constants, float8 GEMMs and the optimizer step."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from hpctrain.model.shapes import ModelShape
from hpctrain.planner import hardware as hw
from hpctrain.planner import kernels as k
from hpctrain.planner.arch import Arch
from hpctrain.planner.cluster import IB_NCCL_EFFICIENCY, NVLINK_NCCL_EFFICIENCY, cluster_spec
from hpctrain.planner.estimate import Workload, estimate
from hpctrain.planner.frameworks import FRAMEWORKS, HPCTRAIN_COMPILED, HPCTRAIN_FW, for_config
from hpctrain.planner.layouts import Layout
from hpctrain.planner.memory import HPCTRAIN

H100 = hw.H100_80GB
RATE = H100.sustained_mamf
GPT_22B = Arch.gpt(48, 6144, 64, 51200, 2048)
LLAMA_8B = Arch.from_shape(ModelShape(128256, 4096, 32, 32, 8, 14336, False))
LLAMA_70B = Arch.from_shape(ModelShape(128256, 8192, 80, 64, 8, 28672, False))


def _cluster(name="h100-80gb", gpus=8, mem=80, peak=989):
    return cluster_spec(SimpleNamespace(name=name, gpus=gpus, gpus_per_node=8, gpu_mem_gb=mem, peak_tflops=peak,
                                        intra_bw_gbs=450, inter_bw_gbs=50))


# -- the hardware figures are the cited ones ------------------------------------------
def test_hardware_constants_are_their_sources():
    assert H100.mamf_flops == 794.5e12 and hw.A100_80GB.mamf_flops == 271.2e12  # ml-engineering MAMF table
    assert H100.fp8_mamf_flops == 1402.6e12
    assert hw.HBM_EFFICIENCY == pytest.approx(1220.7 / 1448.4)  # GPUInspector.jl, A100-SXM4-40GB
    assert hw.HOPPER_SUSTAINED_CLOCK == pytest.approx(1575 / 1980) == pytest.approx(1395 / 1755, abs=1e-3)
    assert hw.A100_80GB.sustained_clock == pytest.approx(1305 / 1410)  # HPL at the power limit
    assert H100.attention["fa2"] == 0.35 and H100.attention["fa3"] == pytest.approx(0.525)
    assert hw.H200_141GB.mamf_flops == H100.mamf_flops and hw.H200_141GB.hbm_bytes_per_s == 4800e9
    assert hw.H100_96GB_GT.hbm_bytes_per_s == 2400e9
    assert NVLINK_NCCL_EFFICIENCY == pytest.approx(370 / 450) and IB_NCCL_EFFICIENCY == 0.91


def test_known_gpus_use_the_measured_rate_and_gib():
    c = _cluster()
    # (the preset's 989 TFLOP/s peak against the datasheet's 989.4 scales the measured rate)
    assert c.gpu is H100 and c.matmul_flops == pytest.approx(H100.sustained_mamf * 989 / 989.4)
    assert c.capacity_bytes == 80 * 2 ** 30 and c.mem_bytes == pytest.approx(0.9 * 80 * 2 ** 30)
    assert c.intra.busbw == pytest.approx(450e9 * 370 / 450) and c.inter.busbw == pytest.approx(50e9 * 0.91)
    other = _cluster(name="custom")  # no figures: the FLOPs-only model at the assumed 0.75 x peak
    assert other.gpu is None and other.matmul_flops == pytest.approx(0.75 * 989e12)
    assert other.intra.busbw == 450e9


# -- GEMMs ------------------------------------------------------------------------------
def test_gemm_roofline_and_wave_quantization():
    big = k.Gemm(8192, 8192, 8192)
    t = k.gemm_time(big, H100, RATE)
    assert t == pytest.approx(big.flops / (RATE * hw.wave_efficiency(8192, 8192, H100.sms)))
    # one tile too many: 133 output tiles of 256 x 128 on 132 SMs take two waves (or smaller tiles)
    assert hw.wave_efficiency(256 * 133, 128, 132) < hw.wave_efficiency(256 * 132, 128, 132) == 1.0
    # a skinny projection (a tp-split key/value head, n = 128) is timed by its bytes, not its FLOPs
    skinny = k.Gemm(65536, 128, 4096)
    assert k.gemm_time(skinny, H100, RATE) == pytest.approx(skinny.bytes / H100.hbm_effective)
    assert k.gemm_time(skinny, H100, RATE) > skinny.flops / RATE


# -- attention ----------------------------------------------------------------------------
def test_flash_attention_runs_the_causal_half_at_its_kernels_rate():
    fw = HPCTRAIN_FW
    arch = LLAMA_8B
    bc = k.block_cost(arch, fw, H100, RATE, 8192, 8192, 1, False, 1, 2, 4)
    flops = 4.0 * 8192 * 8192 * 128 * 32 / 2
    assert bc.attn_fwd == pytest.approx(flops / (0.35 * H100.peak_flops * H100.sustained_clock))
    assert bc.attn_bwd == pytest.approx(2.5 * bc.attn_fwd)
    fa3 = k.block_cost(arch, replace(fw, attention_kernel="fa3"), H100, RATE, 8192, 8192, 1, False, 1, 2, 4)
    assert fa3.attn_fwd == pytest.approx(bc.attn_fwd / 1.5)


def test_unfused_attention_pays_the_score_passes():
    """Megatron-LM 2021: QK^T and AV as batched GEMMs, softmax and dropout over a*s scores per token."""
    fw = FRAMEWORKS["megatron-lm-2021"]
    bc = k.block_cost(GPT_22B, fw, hw.A100_80GB, hw.A100_80GB.mamf_flops, 4 * 2048, 2048, 8, False, 1, 2, 2)
    scores = 4 * 2048 * (64 // 8) * 2048
    passes = scores * (2 * 2 + 2 * 2 + 1) / hw.A100_80GB.hbm_effective  # softmax, then dropout with its mask
    assert bc.attn_fwd > passes
    no_drop = k.block_cost(GPT_22B, replace(fw, dropout=False), hw.A100_80GB, hw.A100_80GB.mamf_flops,
                           4 * 2048, 2048, 8, False, 1, 2, 2)
    assert bc.attn_fwd - no_drop.attn_fwd == pytest.approx(scores * 5 / hw.A100_80GB.hbm_effective)


# -- memory-bound passes per code -------------------------------------------------------------
def test_eager_code_pays_more_passes_than_fused():
    arch = LLAMA_8B
    args = (H100, RATE, 16384, 8192, 1, False, 1, 2, 4)
    eager, fused = k.block_cost(arch, HPCTRAIN_FW, *args), k.block_cost(arch, HPCTRAIN_COMPILED, *args)
    assert eager.pointwise_fwd > 2 * fused.pointwise_fwd
    assert eager.fwd - eager.pointwise_fwd == pytest.approx(fused.fwd - fused.pointwise_fwd)  # same GEMMs
    titan = k.block_cost(arch, FRAMEWORKS["torchtitan-eager"], H100, RATE, 16384, 8192, 1, False, 1, 2, 2)
    assert titan.pointwise_fwd > k.block_cost(arch, FRAMEWORKS["torchtitan-compiled"], H100, RATE, 16384, 8192,
                                              1, False, 1, 2, 2).pointwise_fwd


def test_recompute_modes():
    arch = LLAMA_8B
    bc = k.block_cost(arch, FRAMEWORKS["torchtitan-eager"], H100, RATE, 16384, 8192, 1, False, 1, 2, 2)
    assert bc.recompute("full", "attention") == bc.fwd and bc.recompute("none", "op") == 0
    assert bc.recompute("selective", "attention") == bc.attn_fwd
    # torchtitan's per-op policy: every second matmul (wk, wo, w3) and the pointwise kernels again
    assert bc.recompute("selective", "op") == pytest.approx(
        bc.pointwise_fwd + bc.gemm["k"][0] + bc.gemm["proj"][0] + bc.gemm["up"][0])


def test_float8_gemms_are_faster_with_their_casts():
    arch = LLAMA_70B
    fw = FRAMEWORKS["torchtitan-compiled"]
    bf16 = k.block_cost(arch, fw, H100, RATE, 16 * 8192, 8192, 8, True, 1, 2, 2)
    fp8 = k.block_cost(arch, fw, H100, RATE, 16 * 8192, 8192, 8, True, 1, 2, 2, fp8=True)
    gemms = lambda bc: sum(f + dg + wg for f, dg, wg in bc.gemm.values())  # noqa: E731
    assert gemms(fp8) < gemms(bf16) / 1.5 and fp8.pointwise_fwd > bf16.pointwise_fwd
    assert k.FP8_CAST == 5


def test_optimizer_step_bytes():
    assert k.optimizer_bytes(HPCTRAIN_FW, 1e9, 1e9) == pytest.approx(1e9 * (92 + 12))
    megatron = FRAMEWORKS["megatron-core-2024"]
    assert k.optimizer_bytes(megatron, 1e9, 1e9 / 8) == pytest.approx(1e9 / 8 * 38 + 1e9 * 4)


# -- tensor-parallel overlap ----------------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["none", "backward", "full"])
def test_tp_overlap_hides_what_the_code_hides(overlap):
    arch = LLAMA_70B
    cluster = _cluster(gpus=64)
    fw = replace(FRAMEWORKS["megatron-core-2024"], tp_overlap=overlap)
    work = Workload(64, 8192, "bf16", fw.states, framework=fw)
    e = estimate(arch, Layout(tp=8, cp=1, ep=1, dp=8, pp=1, micro_batch=1, zero=1), work, cluster)
    wire = e.comm_time["tp"]
    if overlap == "none":
        assert e.time.exposed["tp"] == pytest.approx(wire)
    elif overlap == "backward":  # forward and the row-parallel backward gathers wait: 6 of 10 collectives
        assert 0.3 * wire < e.time.exposed["tp"] < wire
    else:
        assert e.time.exposed["tp"] < 0.2 * wire


def test_hpctrain_plans_its_own_code_and_compile():
    assert for_config(SimpleNamespace(trainer=SimpleNamespace(compile=False))) is HPCTRAIN_FW
    assert for_config(SimpleNamespace(trainer=SimpleNamespace(compile=True))) is HPCTRAIN_COMPILED
    from hpctrain.planner.plan import plan_inputs

    work = plan_inputs(["model=tiny", "cluster=h100-80gb", "trainer.compile=true"])[1]
    assert work.framework is HPCTRAIN_COMPILED and work.state_bytes == HPCTRAIN


def test_cpu_runs_keep_the_flops_model():
    """fp32 (or an accelerator without figures): GEMM FLOPs at the matmul rate, nothing else, as before."""
    arch = Arch.from_shape(ModelShape(1024, 64, 2, 4, 4, 128, False))
    cluster = _cluster(name="cpu", peak=0.1)
    e = estimate(arch, Layout(1, 1, 1, 1, 1, 2), Workload(4, 32, "fp32", HPCTRAIN), cluster)
    block = 64 * arch.layer_forward_flops_per_token(32) / cluster.matmul_flops
    head = 64 * arch.head_forward_flops_per_token() / cluster.matmul_flops
    assert e.time.optimizer == 0 and e.time.compute == pytest.approx(2 * (2 * 3 * block + 3 * head))


def test_hpctrains_context_parallel_attention_runs_in_fp32_blocks():
    """hpctrain's ring attention computes each block pair in fp32 with its scores materialised on a GPU
    (plugins/hpctrain_cp/blocks.py): far slower than a flash kernel, which codes with a fused ring have."""
    args = (H100, RATE, 8192 // 8, 8192, 1, False, 8, 2, 4)
    ours = k.block_cost(LLAMA_8B, HPCTRAIN_FW, *args)
    fused = k.block_cost(LLAMA_8B, FRAMEWORKS["torchtitan-compiled"], *args)
    scores = 32 * 1024 * 8192 / 2
    assert ours.attn_fwd > 4 * scores * 128 / (H100.fp32_flops * H100.sustained_clock)
    assert ours.attn_fwd > 5 * fused.attn_fwd
    assert k.block_cost(LLAMA_8B, HPCTRAIN_FW, H100, RATE, 8192, 8192, 1, False, 1, 2, 4).attn_fwd < ours.attn_fwd * 8


def _moe(first_dense: int = 0, mtp: int = 0) -> Arch:
    arch = Arch.from_shape(ModelShape(32000, 1024, 4, 8, 8, 4096, False), num_experts=8, top_k=2)
    return replace(arch, first_dense_blocks=first_dense, mtp_depth=mtp, moe_ffn_hidden=512)


def test_an_moe_models_dense_blocks_and_mtp_modules_are_timed_as_what_they_are():
    """DeepSeek-style models: the first_dense_blocks run the dense SwiGLU (ffn_hidden), not the routed
    experts, and each MTP module adds a block, eh_proj and the shared head on the last stage."""
    cluster, lay = _cluster(gpus=1), Layout(1, 1, 1, 1, 1, 1)
    work = Workload(2, 2048, "bf16", HPCTRAIN)
    tokens = 2048
    moe, dense = _moe(), replace(_moe(), num_experts=1, top_k=1)
    per_block = {name: k.block_cost(a, HPCTRAIN_FW, H100, RATE, tokens, 2048, 1, False, 1, 2.0, 4.0)
                 for name, a in (("moe", moe), ("dense", dense))}
    base = estimate(moe, lay, work, cluster).time.compute
    two_dense = estimate(_moe(first_dense=2), lay, work, cluster).time.compute
    swap = sum(per_block["dense"].fwd + per_block["dense"].bwd - per_block["moe"].fwd - per_block["moe"].bwd
               for _ in range(2))
    # m = 2 micro-batches; the 1e-5 left is hpctrain's per-parameter weight casts, which follow the
    # blocks' parameter counts (kernels.param_pass_bytes)
    assert two_dense - base == pytest.approx(2 * swap, rel=1e-4)
    head_f, head_b, _ = k.head_cost(moe, HPCTRAIN_FW, H100, RATE, tokens, 1, False, 2.0, 4.0)
    mtp = estimate(_moe(mtp=1), lay, work, cluster).time.compute - base
    block = per_block["moe"].fwd + per_block["moe"].bwd  # the last block is MoE, so is the module's
    assert mtp > 2 * (block + head_f + head_b)  # and eh_proj's GEMMs
    assert mtp < 2 * 1.2 * (block + head_f + head_b)
