"""The planner's formulas against published tables.

Sources (values transcribed from the papers; REFERENCES.md holds the formulas):
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473), Table 1 and abstract.
- Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC'20, arXiv:1910.02054), Table 1.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv:2205.05198), Table 2 formulas, the 175B (GPT-3)
  configuration of its Table 3, and the abstract's "5x".
- Llama 3 team 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4.
"""
from __future__ import annotations

import math

import pytest

from hpctrain.planner import activations as act
from hpctrain.planner.arch import Arch
from hpctrain.planner.compute import gemm_flops_per_iteration, mfu, narayanan_flops_per_iteration
from hpctrain.planner.memory import ZERO_PAPER, model_states, zero_table_gb

# -- Megatron-LM Table 1 (V = 51200, s = 2048, A100 peak 312 TFLOP/s) ---------------
# params (B), heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
V, S, A100_PEAK = 51200, 2048, 312e12


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_megatron_parameter_counts(row):
    billions, a, h, layers = row[:4]
    arch = Arch.gpt(n_layers=layers, d_model=h, n_heads=a, vocab_size=V, seq_len=S)
    paper_formula = 12 * layers * h ** 2 * (1 + 13 / (12 * h) + (V + S) / (12 * layers * h))
    assert arch.total_params == pytest.approx(paper_formula, rel=1e-12)
    # Table 1 prints one decimal: our count rounds to exactly the printed value
    # for all ten rows. Within 0.2% is asked; for the four smallest rows one
    # printed decimal is coarser than 0.2% (1.7B is +-3%), so there the bound
    # is half a unit of that decimal, which is all the printed value says.
    assert round(arch.total_params / 1e9, 1) == billions
    tolerance = max(0.002 * billions, 0.05)
    assert abs(arch.total_params / 1e9 - billions) <= tolerance


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_megatron_flops_per_iteration(row):
    """Summing the planner's per-GEMM counts (forward, recompute, 2x backward;
    the output layer without recompute) gives the paper's closed form."""
    _, a, h, layers, t, p, gpus, batch, tflops = row
    arch = Arch.gpt(n_layers=layers, d_model=h, n_heads=a, vocab_size=V, seq_len=S)
    flops = gemm_flops_per_iteration(arch, batch, S, recompute="full")
    assert flops == pytest.approx(narayanan_flops_per_iteration(batch, S, layers, h, V), rel=1e-12)
    # the layout is a valid factorisation and the reported rate is below peak
    assert gpus % (t * p) == 0 and batch % (gpus // (t * p)) == 0
    assert 0.4 < tflops * 1e12 / A100_PEAK < 0.55


def test_megatron_trillion_aggregate_matches_abstract():
    """Abstract: 502 petaFLOP/s on 3072 GPUs, 52% of peak, for the 1T model.
    Table 1 rounds the per-GPU rate to 163 TFLOP/s, hence 0.5%."""
    *_, gpus, _, tflops = MEGATRON_TABLE_1[-1]
    assert tflops * gpus / 1e3 == pytest.approx(502, rel=0.005)
    assert round(100 * tflops * 1e12 / A100_PEAK) == 52


# -- ZeRO Table 1: per-device model-state GB (1 GB = 1e9 bytes) -----------------
# Nd -> (stage 1, stage 2, stage 3) as printed, for each model size
ZERO_TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}
ZERO_CELLS = [(psi, nd, stage, printed[stage - 1])
              for psi, rows in ZERO_TABLE_1.items() for nd, printed in rows.items() for stage in (1, 2, 3)]


def _printed_resolution(value: float) -> float:
    """Half a unit of the last printed digit (0.12 -> 0.005, 2013 -> 0.5)."""
    text = repr(value)
    decimals = len(text.split(".")[1]) if "." in text and not text.endswith(".0") else 0
    return 0.5 * 10 ** -decimals


@pytest.mark.parametrize("psi,nd,stage,printed", ZERO_CELLS,
                         ids=[f"{c[0] / 1e9:g}B-Nd{c[1]}-stage{c[2]}" for c in ZERO_CELLS])
def test_zero_table_1(psi, nd, stage, printed):
    predicted = zero_table_gb(psi, nd, stage)
    # 0.5% as the issue asks; where the paper's rounding is coarser than that
    # (7.5B at Nd=1024, stage 3: 0.117 printed as 0.12) the bound is half a
    # unit of the last printed digit, which is all the printed value says.
    tolerance = max(0.005 * printed, _printed_resolution(printed))
    assert abs(predicted - printed) <= tolerance


def test_zero_baseline_and_stage_ordering():
    states = [model_states(7.5e9, stage, 64, ZERO_PAPER).total for stage in (0, 1, 2, 3)]
    assert states[0] == 16 * 7.5e9
    assert states == sorted(states, reverse=True)


# -- Korthikanti et al. 2022: GPT-3 175B (a=96, h=12288, L=96, s=2048, t=8, p=8, b=1) --------
K_A, K_H, K_L, K_T, K_P, K_B = 96, 12288, 96, 8, 8, 1
GPT3 = Arch.gpt(n_layers=K_L, d_model=K_H, n_heads=K_A, vocab_size=V, seq_len=S)
KORTHIKANTI_CASES = [  # (sequence parallel, recompute)
    (False, "none"), (True, "none"), (False, "selective"), (True, "selective"), (False, "full")]


@pytest.mark.parametrize("sp,recompute", KORTHIKANTI_CASES)
def test_korthikanti_formulas_from_the_saved_tensor_table(sp, recompute):
    """The planner's tensor-by-tensor table of the GPT block, sharded and
    recomputed, reproduces each closed form of the paper's Table 2."""
    paper = act.korthikanti_layer_bytes(S, K_B, K_H, K_A, K_T, sp, recompute)
    ours = act.layer_bytes(GPT3, "bf16", K_B, S, tp=K_T, sp=sp, recompute=recompute)
    assert ours == pytest.approx(paper, rel=0.02)


def test_korthikanti_175b_values():
    """The formulas evaluated for 175B: s*b*h = 25,165,824 elements."""
    sbh = S * K_B * K_H
    per_layer_gb = {case: act.korthikanti_layer_bytes(S, K_B, K_H, K_A, K_T, *case) / 1e9 for case in KORTHIKANTI_CASES}
    assert per_layer_gb[(False, "none")] == pytest.approx(sbh * 23 / 1e9)  # 10 + 24/8 + 5*96*2048/(12288*8)
    assert per_layer_gb[(True, "none")] == pytest.approx(sbh * 114 / 8 / 1e9)
    assert per_layer_gb[(True, "selective")] == pytest.approx(sbh * 34 / 8 / 1e9)
    # the first stage holds L/p layers x p micro-batches under 1F1B: all 96 layers' worth
    first_stage, factor = act.korthikanti_first_stage_bytes(per_layer_gb[(False, "none")], K_L, K_P)
    assert factor == K_P and first_stage == pytest.approx(55.6, rel=0.002)
    # abstract: sequence parallelism + selective recompute cut activation memory 5x
    assert per_layer_gb[(False, "none")] / per_layer_gb[(True, "selective")] >= 5


@pytest.mark.parametrize("sp,recompute,fits",
                         [(False, "none", False), (True, "selective", True), (False, "full", True)])
def test_korthikanti_out_of_memory_verdicts_on_80gb(sp, recompute, fits):
    """Model states (16 bytes/parameter, the first stage's 12 layers and the
    embedding split 8 ways) plus first-stage activations against 80 GB: plain
    tensor parallelism does not fit, the paper's sequence parallel + selective
    recompute ("present work") and full recompute do."""
    stage_params = (K_L // K_P) * GPT3.layer_params_per_rank(K_T) + GPT3.padded_vocab(K_T) // K_T * K_H + S * K_H
    states = model_states(stage_params, 0, 1, ZERO_PAPER).total
    per_layer = act.layer_bytes(GPT3, "bf16", K_B, S, tp=K_T, sp=sp, recompute=recompute)
    activations, _ = act.korthikanti_first_stage_bytes(per_layer, K_L, K_P)
    assert (states + activations <= 80e9) is fits


# -- Llama 3 Table 4 (405B), as printed ------------------------------------------------
# GPUs, TP, CP, PP, DP, seq, batch per DP, tokens per batch ("16M" = 16 * 2^20), TFLOP/s per GPU
LLAMA3_TABLE_4 = [
    (8192, 8, 1, 16, 64, 8192, 32, 16 * 2 ** 20, 430),
    (16384, 8, 1, 16, 128, 8192, 16, 16 * 2 ** 20, 400),
    (16384, 8, 16, 16, 4, 131072, 16, 16 * 2 ** 20, 380),
]
H100_PEAK = 989e12


def llama3_row_problems(row) -> list:
    gpus, tp, cp, pp, dp, seq, per_dp, tokens, _ = row
    problems = []
    if tp * cp * pp * dp != gpus:
        problems.append(f"tp*cp*pp*dp = {tp * cp * pp * dp} != {gpus} GPUs")
    if dp * per_dp * seq != tokens:
        problems.append(f"dp*batch*seq = {dp * per_dp * seq:,} != {tokens:,} tokens")
    return problems


def test_llama3_rows_consistency_is_checked_not_forced():
    verdicts = [llama3_row_problems(row) for row in LLAMA3_TABLE_4]
    assert verdicts[0] == [] and verdicts[1] == []
    # the long-context row as printed fails both checks: DP=4 gives 8192 GPUs
    # and 8M tokens; DP=8 would make both hold, so we flag it rather than fix it
    assert len(verdicts[2]) == 2
    fixed = list(LLAMA3_TABLE_4[2])
    fixed[4] = 8
    assert llama3_row_problems(fixed) == []


def test_llama3_mfu_from_reported_tflops():
    """The paper reports 38-43% BF16 MFU; from the TFLOP/s and the 989 peak."""
    mfus = [mfu(row[-1] * 1e12, H100_PEAK) for row in LLAMA3_TABLE_4]
    assert [round(100 * m, 1) for m in mfus] == [43.5, 40.4, 38.4]
    assert all(0.38 <= m < 0.44 for m in mfus)
    assert math.isclose(mfus[0] / mfus[2], 430 / 380)
