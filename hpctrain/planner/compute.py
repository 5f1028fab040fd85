"""FLOPs and compute time.

Two countings, kept apart on purpose:

- Hardware FLOPs: what the GPUs execute. Per micro-batch a block costs its
  forward F, a backward of 2F, plus the recomputed part (F under full
  recompute, the attention core under selective recompute, as Korthikanti
  et al. and ``model.recompute=selective`` define it). The
  output projection runs forward + backward only. For the GPT family with full
  recompute this sums to Narayanan et al. 2021's
  F_iter = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), which ``gemm_flops_per_iteration``
  reproduces from the individual matrix multiplies.
- Model FLOPs (for MFU): PaLM's 6N + 12 l h s per token (appendix B), which
  does not credit recomputation. MFU = model FLOP/s / peak.

Compute time is FLOPs / achieved matmul FLOP/s (a measured value from
calibration, or the datasheet peak times an assumed efficiency).
"""
from __future__ import annotations

from hpctrain.planner.arch import Arch


def narayanan_flops_per_iteration(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. for F: GEMM FLOPs of one iteration with full recompute."""
    return 96.0 * batch * seq_len * layers * hidden ** 2 * (
        1.0 + seq_len / (6.0 * hidden) + vocab / (16.0 * layers * hidden))


def recompute_flops_per_token(arch: Arch, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token per block that the recompute mode redoes."""
    if recompute == "full":
        return arch.layer_forward_flops_per_token(seq_len)
    if recompute == "selective":
        return arch.attention_core_flops_per_token(seq_len)
    return 0.0


def training_flops_per_token(arch: Arch, seq_len: int, recompute: str, layers: int = -1,
                             with_head: bool = True) -> float:
    """Hardware FLOPs per token for forward + backward (+ recompute) over
    ``layers`` blocks (all by default) and, optionally, the output projection."""
    layers = arch.n_layers if layers < 0 else layers
    block = 3.0 * arch.layer_forward_flops_per_token(seq_len) + recompute_flops_per_token(arch, seq_len, recompute)
    head = 3.0 * arch.head_forward_flops_per_token() if with_head else 0.0
    return layers * block + head


def gemm_flops_per_iteration(arch: Arch, batch: int, seq_len: int, recompute: str = "full") -> float:
    """Hardware FLOPs of one iteration of ``batch`` sequences, from the matrix multiplies."""
    return batch * seq_len * training_flops_per_token(arch, seq_len, recompute)


def model_flops_per_token(arch: Arch, seq_len: int) -> float:
    """PaLM appendix B: 6N + 12 l h s (N: parameters in matrix multiplies, active ones for MoE); the
    attention term is 3 x the QK^T and AV FLOPs of every block (MTP modules' included), 12 l h s when
    n_heads x head_dim = h."""
    blocks = arch.n_layers + arch.mtp_depth
    return 6.0 * arch.matmul_params + 3.0 * blocks * arch.attention_core_flops_per_token(seq_len)


def lora_model_flops_per_token(arch: Arch, seq_len: int) -> float:
    """A LoRA step's model FLOPs: 4N + the attention term, forward and input gradients with no weight
    gradients for the frozen base (``planner.lora``; the adapters' own products are under 1% at r << h)."""
    return model_flops_per_token(arch, seq_len) - 2.0 * arch.matmul_params


def mfu(model_flops_per_s_per_gpu: float, peak_flops: float) -> float:
    """Model FLOPs utilisation."""
    return model_flops_per_s_per_gpu / peak_flops
