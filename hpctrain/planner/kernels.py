"""The compute model: what one micro-batch costs a GPU, kernel by kernel.

A block's forward and backward are lists of kernels of three kinds, each timed
on the accelerator's figures (``hardware.GpuKind``, every constant cited there):

- GEMMs (the projections; without flash attention also QK^T and AV): time =
  max(2 m n k / (MAMF x wave efficiency), bytes / effective HBM bandwidth),
  a roofline whose compute roof is the measured maximum achievable matmul rate
  and whose efficiency falls with tile and wave quantization of the output
  (NVIDIA's "Matrix Multiplication Background User's Guide", sections 3.1-3.2:
  small or skinny GEMMs from tensor-parallel splits lose here, and a GEMM of
  low arithmetic intensity, such as a tp-split key/value projection, is timed
  by its bytes). A backward GEMM pair is the input-gradient GEMM (m x k output,
  inner n) and the weight-gradient GEMM (n x k output, inner m).
- fused attention (FlashAttention-2/3, cuDNN): the FLOPs it executes (causal:
  half the s x s products; backward 2.5 x forward, the FlashAttention papers'
  count) at the published fraction of peak for that kernel and GPU.
- memory-bound passes (norms, residual adds, activations, rotary embedding,
  softmax and dropout over s x s scores, casts, the loss, the optimizer step):
  bytes read + written / effective HBM bandwidth. The bytes are counted from
  the code each framework runs (``frameworks``): fused kernels read their
  inputs and write their outputs once; eager torch code pays every op.

Nothing here is fitted: the only numbers are the hardware's (``hardware``) and
byte counts read off the code. Kernel launch gaps, host overhead and the
slow-down a concurrent collective causes to a GEMM are not modelled
(docs/planner.md says what that leaves out).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Tuple

from hpctrain.planner.arch import Arch
from hpctrain.planner.frameworks import Framework
from hpctrain.planner.hardware import GpuKind, wave_efficiency

if TYPE_CHECKING:
    from hpctrain.planner.lora import LoraPlan

FLASH_BACKWARD_FACTOR = 2.5
"""Backward / forward FLOPs of flash attention (Dao 2023: 5 matmuls backward against 2 forward)."""


@dataclass(frozen=True)
class Gemm:
    """``count`` independent m x n x k products (a batched GEMM), ``e`` bytes per element."""

    m: float
    n: float
    k: float
    count: float = 1.0
    e: float = 2.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def bytes(self) -> float:
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.count * self.e


def gemm_time(g: Gemm, gpu: GpuKind, rate: float) -> float:
    """Roofline time of one (batched) GEMM at matmul rate ``rate`` (the MAMF, or a calibrated one)."""
    if g.flops <= 0:
        return 0.0
    eff = wave_efficiency(g.m, g.n, gpu.sms, g.count)
    return max(g.flops / (rate * eff), g.bytes / gpu.hbm_effective)


def pass_time(nbytes: float, gpu: GpuKind) -> float:
    return nbytes / gpu.hbm_effective


@dataclass
class BlockCost:
    """Seconds one GPU spends on one block for one micro-batch (its share of the tensor-parallel work)."""

    fwd: float = 0.0
    bwd: float = 0.0
    wgrad: float = 0.0
    """The weight-gradient GEMMs inside ``bwd`` (ZB-H1's deferrable part)."""
    attn_fwd: float = 0.0
    """The attention core's forward (what ring attention's traffic hides behind; selective recompute)."""
    attn_bwd: float = 0.0
    pointwise_fwd: float = 0.0
    """Memory-bound kernels inside ``fwd`` (per-op selective checkpointing recomputes them)."""
    gemm: Dict[str, Tuple[float, float, float]] = field(default_factory=dict)
    """Per projection: (forward, input-gradient, weight-gradient) GEMM seconds."""
    op_recompute: float = 0.0
    """What torchtitan's per-op policy recomputes: every second matmul and the pointwise kernels."""

    def recompute(self, mode: str, selective: str) -> float:
        """Extra forward work in the backward for ``model.recompute=mode``."""
        if mode == "full":
            return self.fwd
        if mode == "selective":
            return self.op_recompute if selective == "op" else self.attn_fwd
        return 0.0


@dataclass(frozen=True)
class Dims:
    """One GPU's share of a block: tokens and widths after tensor and sequence parallelism."""

    tokens: float
    """Tokens a projection sees per micro-batch (the sequence gathered under sequence parallelism)."""
    rep_tokens: float
    """Tokens of the residual stream on this GPU (1/tp of them under sequence parallelism)."""
    seq: int
    cp: int
    h: int
    hq: int
    kv: int
    f: int
    heads: int
    head_dim: int


def dims(arch: Arch, tokens: float, seq: int, tp: int, sp: bool, cp: int) -> Dims:
    heads = max(1, arch.n_heads // tp)
    f = arch.moe_token_ffn if arch.is_moe else arch.ffn_hidden // tp
    return Dims(tokens, tokens / tp if sp else tokens, seq, cp, arch.d_model, heads * arch.head_dim,
                arch.kv_dim_per_rank(tp), f, heads, arch.head_dim)


def _projections(arch: Arch, fw: Framework, d: Dims) -> List[Tuple[str, int, int]]:
    """(name, output width, input width) of the block's GEMMs on one tensor-parallel rank, as the
    framework issues them (Megatron fuses Q/K/V into one GEMM; hpctrain and torchtitan run three)."""
    h = d.h
    fused_qkv = not (fw.ours or fw.key.startswith("torchtitan"))
    attn = ([("qkv", d.hq + 2 * d.kv, h)] if fused_qkv else [("q", d.hq, h), ("k", d.kv, h), ("v", d.kv, h)])
    attn.append(("proj", h, d.hq))
    if arch.family == "llama":
        up = [("gate_up", 2 * d.f, h)] if fused_qkv else [("gate", d.f, h), ("up", d.f, h)]
    else:
        up = [("fc1", d.f, h)]
    return attn + up + [("fc2", h, d.f)]


MM_RECOMPUTED_BY_OP_SAC = ("k", "proj", "up")
"""torchtitan's per-op policy saves every odd-numbered mm of a block's forward (wq, wv, w1, w2) and
recomputes the even ones (wk, wo, w3): parallelize_llama.py's ``_custom_policy`` at 9dec370."""


def _pointwise(arch: Arch, fw: Framework, d: Dims, e: float, r: float) -> Tuple[float, float]:
    """(forward, backward) bytes of the block's memory-bound kernels for one micro-batch.

    ``e``: bytes of an activation element, ``r``: of the residual stream (hpctrain keeps it in fp32).
    Token counts: ``rep`` kernels run on the residual stream (split by sequence parallelism),
    ``full`` ones on the projections' tokens. Per element, read + write (docs/planner.md, "Kernels")."""
    rep, full, h = d.rep_tokens, d.tokens, d.h
    rope = d.hq + d.kv if arch.family != "gpt" else 0
    mask = 1.0 if fw.dropout else 0.0
    fwd = bwd = 0.0
    if fw.pointwise == "eager" and arch.family == "llama":  # hpctrain/model/transformer.py, op by op
        fwd += rep * h * 2 * 7 * r                    # two RMSNorms: pow, mean, x*rsqrt, *weight (fp32 stream)
        bwd += rep * h * 2 * 13 * r
        fwd += full * h * 5 * (r + e)                 # autocast casts the norm output for wq, wk, wv, w1, w3
        bwd += full * h * (5 * (e + r) + 3 * 3 * r)   # ... their gradients cast back and summed
        fwd += full * rope * (44 + 2 * e)             # apply_rope: float, 4 half-products, sub, add, stack, cast
        bwd += full * rope * (48 + 2 * e)
        fwd += full * d.hq * 2 * e                    # out.transpose(1, 2).reshape: a copy
        bwd += full * d.hq * 2 * e
        fwd += rep * h * 2 * (e + 2 * r)              # residual adds (bf16 branch into the fp32 stream)
        bwd += rep * h * 2 * (3 * r + r + e)          # gradient sums into the stream, cast to the branch
        fwd += full * d.f * 5 * e                     # silu(gate) * up
        bwd += full * d.f * 9 * e
    elif fw.pointwise == "torchtitan-eager":          # torchtitan/models/llama/model.py at 9dec370, op by op
        fwd += rep * h * 2 * 36                       # RMSNorm: float, pow, mean, *rsqrt, type_as, *weight
        bwd += rep * h * 2 * 56
        fwd += full * rope * 20                       # float, complex multiply, type_as
        bwd += full * rope * 20
        fwd += full * d.hq * 4                        # output.transpose(1, 2).contiguous()
        bwd += full * d.hq * 4
        fwd += rep * h * 2 * 6                        # residual adds
        bwd += rep * h * 2 * 6
        fwd += full * d.f * 10                        # silu(w1 x) * w3 x
        bwd += full * d.f * 18
    else:  # fused kernels: each region reads its inputs and writes its outputs once
        fwd += rep * h * 2 * (r + e)                  # two norms (x in, y out)
        bwd += rep * h * 2 * (2 * r + e)              # x and dy in, dx out
        fwd += rep * h * 2 * (e + 2 * r + mask)       # residual add (+ bias + dropout, Megatron's fused bda)
        bwd += rep * h * 2 * (3 * r + (2 * e + mask if fw.dropout else 0.0))  # stream gradient sums (+ dropout)
        fwd += full * rope * 2 * e                    # fused rotary embedding on q and k
        bwd += full * rope * 2 * e
        if arch.family == "llama":
            fwd += full * d.f * 3 * e                 # swiglu: gate, up in, product out
            bwd += full * d.f * 5 * e
        else:
            fwd += full * d.f * 2 * e                 # bias-gelu (Megatron) or squared ReLU (Nemotron)
            bwd += full * d.f * 3 * e
        if fw.ours or fw.key.startswith("torchtitan"):  # attention output re-laid out for the projection
            fwd += full * d.hq * 2 * e
            bwd += full * d.hq * 2 * e
    if arch.family == "gpt":  # bias gradients: one read of each biased projection's output gradient
        bwd += (full * (d.hq + 2 * d.kv + d.f) + rep * 2 * h) * e
    if fw.attention == "unfused":
        fwd += full * d.hq * 2 * e                    # context permute(...).contiguous()
        bwd += full * d.hq * 2 * e
    return fwd, bwd


def _score_passes(fw: Framework, d: Dims, e: float) -> Tuple[float, float]:
    """(forward, backward) bytes of the unfused attention's kernels over the s x s scores: Megatron's
    fused scale-mask-softmax (read, write; backward reads y and dy, writes dx) and the attention dropout
    (a 1-byte mask written forward and read backward)."""
    scores = d.tokens * d.heads * d.seq  # a*s scores per query token
    drop = (2 * e + 1) if fw.dropout else 0.0
    return scores * (2 * e + drop), scores * (3 * e + drop)


FP8_CAST = 2 * 2 + 1
"""Bytes per element of a dynamic tensorwise float8 cast of a bf16 tensor: the amax reads it, the scaled
cast reads it again and writes one byte (torchao ``hp_tensor_to_float8_dynamic``, which torchtitan's
float8 linears call for the input, the weight and the output gradient)."""


def _fp8_casts(m: float, n_out: float, n_in: float) -> Tuple[float, float]:
    """(forward, backward) bytes of the float8 casts around one linear (torchao Float8Linear, dynamic
    tensorwise): forward the input and the weight; backward the output gradient in both layouts its
    two GEMMs read, the weight transposed and the saved float8 input transposed."""
    fwd = m * n_in * FP8_CAST + n_in * n_out * FP8_CAST
    bwd = 2 * m * n_out * FP8_CAST + n_in * n_out * FP8_CAST + m * n_in * 2
    return fwd, bwd


def block_cost(arch: Arch, fw: Framework, gpu: GpuKind, rate: float, tokens: float, seq: int, tp: int, sp: bool,
               cp: int, e: float, r: float, fp8: bool = False) -> BlockCost:
    """One block, one micro-batch of ``tokens`` tokens per GPU (after cp and ep splits), on ``gpu``.
    ``fp8``: the projections run as float8 GEMMs (at the float8 MAMF, scaled as ``rate`` is) with their
    casts; attention and everything else stay 16-bit."""
    d = dims(arch, tokens, seq, tp, sp, cp)
    out = BlockCost()
    gemm_rate, ge = rate, e
    cast_f = cast_b = 0.0
    if fp8:
        if not gpu.fp8_mamf_flops:
            raise ValueError(f"{gpu.name}: no float8 matmul figure")
        gemm_rate, ge = rate * gpu.fp8_mamf_flops / gpu.mamf_flops, 1.0
    for name, n_out, n_in in _projections(arch, fw, d):
        f_t = gemm_time(Gemm(d.tokens, n_out, n_in, e=ge), gpu, gemm_rate)
        dgrad = gemm_time(Gemm(d.tokens, n_in, n_out, e=ge), gpu, gemm_rate)
        wgrad = gemm_time(Gemm(n_out, n_in, d.tokens, e=ge), gpu, gemm_rate)
        if fp8:
            c_f, c_b = _fp8_casts(d.tokens, n_out, n_in)
            cast_f, cast_b = cast_f + c_f, cast_b + c_b
        out.gemm[name] = (f_t, dgrad, wgrad)
        out.fwd += f_t
        out.bwd += dgrad + wgrad
        out.wgrad += wgrad
    sequences = d.tokens / (d.seq / d.cp)  # sequences (or sequence chunks) in the micro-batch
    if fw.ours and cp > 1 and gpu.fp32_flops:
        out.attn_fwd, out.attn_bwd = _hpctrain_cp_attention(d, sequences, gpu)
    elif fw.attention == "flash":
        # each rank's queries (s/cp of them, zigzag-balanced) against the whole causal sequence
        flops = 4.0 * (d.seq / d.cp) * d.seq * d.head_dim * d.heads * sequences / 2.0
        rate_attn = gpu.attention_flops(fw.attention_kernel)
        out.attn_fwd = flops / rate_attn
        out.attn_bwd = FLASH_BACKWARD_FACTOR * flops / rate_attn
    else:
        s, hd, count = d.seq, d.head_dim, sequences * d.heads
        score_f, score_b = _score_passes(fw, d, e)
        out.attn_fwd = (gemm_time(Gemm(s, s, hd, count, e), gpu, rate)       # QK^T
                        + gemm_time(Gemm(s, hd, s, count, e), gpu, rate)     # AV
                        + pass_time(score_f, gpu))
        out.attn_bwd = (gemm_time(Gemm(s, s, hd, count, e), gpu, rate)       # dP = dO V^T
                        + 3 * gemm_time(Gemm(s, hd, s, count, e), gpu, rate)  # dV, dQ, dK
                        + pass_time(score_b, gpu))
    out.fwd += out.attn_fwd
    out.bwd += out.attn_bwd
    pw_f, pw_b = _pointwise(arch, fw, d, e, r)
    pw_f, pw_b = pw_f + cast_f, pw_b + cast_b
    out.pointwise_fwd = pass_time(pw_f, gpu)
    out.fwd += out.pointwise_fwd
    out.bwd += pass_time(pw_b, gpu)
    out.op_recompute = out.pointwise_fwd + sum(out.gemm[n][0] for n in MM_RECOMPUTED_BY_OP_SAC if n in out.gemm)
    return out


def adapter_cost(arch: Arch, lora: "LoraPlan", gpu: GpuKind, rate: float, tokens: float, tp: int, e: float
                 ) -> Tuple[float, float]:
    """(forward, backward) seconds of one block's LoRA adapters for one micro-batch (``planner.lora``): per
    adapter a down (in -> r) and an up (r -> out) product forward; backward each one's input-gradient and
    weight-gradient product. With r << in, out they are skinny GEMMs the roofline times by their bytes."""
    from hpctrain.planner.lora import adapter_gemms  # (the planner's LoRA module imports arch only)

    fwd = bwd = 0.0
    for n_in, n_out in adapter_gemms(arch, lora, tp, moe_block=arch.is_moe):
        fwd += gemm_time(Gemm(tokens, n_out, n_in, e=e), gpu, rate)
        bwd += (gemm_time(Gemm(tokens, n_in, n_out, e=e), gpu, rate)
                + gemm_time(Gemm(n_out, n_in, tokens, e=e), gpu, rate))
    return fwd, bwd


CP_BLOCK_PASSES = (5 * 4, 6 * 4)
"""Bytes per score element of hpctrain's context-parallel attention blocks beyond their matmuls
(plugins/hpctrain_cp/blocks.py ``block_forward`` on a GPU: the fp32 scores masked, their max, exp(s - m),
its sum; backward the scores again, exp(s - lse), dP, dS = P (dP - D) and its reads)."""


def _hpctrain_cp_attention(d: Dims, sequences: float, gpu: GpuKind) -> Tuple[float, float]:
    """(forward, backward) of hpctrain's ring / all-gather attention on a GPU: block by block in fp32
    (q, k, v cast with ``.float()``, keys and values expanded to every query head, scores materialised),
    its matmuls at the non-tensor FP32 rate (no TF32) and its score passes on HBM. Each rank's s/c queries
    meet the causal half of the sequence's keys."""
    scores = sequences * d.heads * (d.seq / d.cp) * d.seq / 2.0
    rate = gpu.fp32_flops * gpu.sustained_clock
    fwd = 4.0 * scores * d.head_dim / rate + pass_time(scores * CP_BLOCK_PASSES[0], gpu)
    bwd = 10.0 * scores * d.head_dim / rate + pass_time(scores * CP_BLOCK_PASSES[1], gpu)
    # every key/value block expanded to the query heads in fp32 (expand_kv), once forward, twice backward
    expand = sequences * 2.0 * d.seq * d.heads * d.head_dim * 4.0
    return fwd + pass_time(expand, gpu), bwd + pass_time(2 * expand, gpu)


def head_cost(arch: Arch, fw: Framework, gpu: GpuKind, rate: float, tokens: float, tp: int, sp: bool,
              e: float, r: float) -> Tuple[float, float, float]:
    """(forward, backward, weight-gradient) seconds of the final norm, output projection and loss for
    one micro-batch on the last pipeline stage (vocabulary split over tp)."""
    h = arch.d_model
    vocab = arch.padded_vocab(tp) / tp
    rep = tokens / tp if sp else tokens
    f_t = gemm_time(Gemm(tokens, vocab, h, e=e), gpu, rate)
    dgrad = gemm_time(Gemm(tokens, h, vocab, e=e), gpu, rate)
    wgrad = gemm_time(Gemm(vocab, h, tokens, e=e), gpu, rate)
    logits = tokens * vocab
    if fw.ours or fw.pointwise == "torchtitan-eager" or fw.key.startswith("torchtitan"):
        # F.cross_entropy(logits.float()): cast, log_softmax (max, sum, write); backward: nll, softmax, cast
        loss_f, loss_b = logits * (e + 4 + 16), logits * (26 + e)
    else:
        # Megatron's vocab-parallel cross-entropy on .float() logits: cast, max, sub, exp, sum, div (in place)
        loss_f, loss_b = logits * (e + 4 + 4 + 8 + 8 + 4 + 8), logits * (8 + 4 + e)
    norm_f, norm_b = rep * h * (r + e), rep * h * (2 * r + e)
    fwd = f_t + pass_time(loss_f + norm_f, gpu)
    bwd = dgrad + wgrad + pass_time(loss_b + norm_b, gpu)
    return fwd, bwd, wgrad


def embedding_cost(arch: Arch, gpu: GpuKind, tokens: float, tp: int, sp: bool, e: float) -> Tuple[float, float]:
    """(forward, backward) seconds of the input embedding (and learned positions) for one micro-batch:
    a gather of rows forward, a scatter-add into the fp32 gradient backward."""
    rep = tokens / tp if sp else tokens
    tables = 2 if arch.positions else 1
    return (pass_time(tables * tokens * arch.d_model * 2 * e, gpu),
            pass_time(tables * tokens * arch.d_model * (e + 8) + rep * 0, gpu))


def param_pass_bytes(fw: Framework, precision: str, shards: int) -> float:
    """Bytes moved per local parameter per micro-batch outside the GEMMs: hpctrain's autocast weight
    casts and fp32 gradient accumulation; an unfused 16-bit gradient accumulation (Megatron-LM fp16);
    FSDP2's bf16 copy of the shard before its gather and the fp32 cast of the gradient it reduces."""
    if fw.ours:
        return (6.0 + 6.0 + 12.0) if precision in ("bf16", "fp16") else 12.0
    if fw.key.startswith("torchtitan"):
        return 6.0 + 6.0 / max(1, shards)
    if not fw.grad_accum_fusion:
        return 3.0 * fw.states.grads
    return 0.0


def optimizer_bytes(fw: Framework, local_params: float, shard_params: float) -> float:
    """Bytes the optimizer step moves on one GPU: AdamW over the parameters this GPU updates
    (``shard_params``), gradient clipping's norm, and per framework the copies around it."""
    if fw.optimizer == "foreach-adam":
        # torch.optim.adam._multi_tensor_adam: mul_, lerp_, mul_, mul, addcmul_, sqrt, div_, add_, addcdiv_
        adam = 92.0
        clip = 4.0 + 8.0  # the norm reads the gradients, the scale rewrites them
        return shard_params * (adam + clip)
    # apex / TE fused multi-tensor Adam: read p, g, m, v, write p, m, v (fp32); Megatron then copies the
    # fp32 masters into the 16-bit model parameters, and zeroes the whole local gradient buffer
    return shard_params * (28.0 + 4.0 + 6.0) + local_params * fw.states.grads
