"""Activation memory: the tensors autograd saves for backward, per block.

Method (Korthikanti et al. 2022, section 4): walk the block's forward, list
every tensor kept for the backward pass with its size per token, and note
which ones tensor parallelism splits. A block's bytes for one micro-batch are
``tokens x sum(entry bytes)``. The same machinery serves both families:

GPT block (the paper's; 16-bit activations, 1-byte dropout masks), per token:
  LayerNorm inputs 2h+2h, QKV input 2h, Q and K 4h, softmax 2as, its dropout
  mask as and output 2as, V 2h, projection input 2h, dropout mask h, MLP input
  2h, GeLU input 8h and output 8h, dropout mask h. Sum: h(34 + 5as/h); the
  10h of LayerNorm/dropout/block inputs is replicated under tensor
  parallelism (sequence parallelism splits it too), the rest is split.
  Selective recompute drops the 5as attention-core terms; full recompute keeps
  only the block input (2h). These reproduce the paper's five formulas.

OUR block (Llama-style, measured with torch saved-tensor hooks on torch 2.13),
per token, r = residual bytes (4: the residual stream stays fp32 even under
bf16 autocast), e = activation bytes (4 fp32, 2 bf16):
  attention norm: input x (r h), rsqrt (4), normalised y (r h);
  the norm output as input of the projections (e h, saved once in fp32 but
  three times under autocast: wq, wk and wv each cast it to bf16);
  RoPE'd q (e h) and k (e kv), v (e kv), attention output (e h, also wo's
  input), log-sum-exp (4 a, fp32, flash attention keeps no s x s matrix);
  RoPE itself keeps only its cos/sin tables (per model, not per layer);
  FFN norm: input (r h), rsqrt, y (r h), its output (e h; two autocast casts);
  SwiGLU gate and up outputs (2 e f), silu output (e f), product (e f).
  fp32 total: 8h + 2kv + 4f + a + 2 elements per token.
Selective recompute (``model.recompute=selective``) recomputes the attention
core, as in the paper: its inputs q, k, v stay saved (the checkpoint keeps
them) and its output stays as the output projection's input, so with flash
attention, which keeps no s x s matrix, only the log-sum-exp is dropped.
Full recompute keeps the block input plus, once per stage, one block's
activations while it is recomputed.

Other codes keep other tensors (``profile``, from ``frameworks.Framework.activations``):

- ``megatron``: the GPT table above (16-bit); with flash attention
  (Megatron-Core's Transformer Engine) the three a*s terms become the fp32
  log-sum-exp, and without dropout the masks are not written. Llama-style
  and Nemotron blocks in 16-bit with fused kernels: block input, norm
  statistics and output, q, k, v after RoPE, attention output and
  log-sum-exp, the FFN's residual input, norm output, and the MLP's saved
  inputs (SwiGLU: gate and up, and the product as the down projection's
  input; squared ReLU: its input and output).
- ``torchtitan``: the same bf16 Llama block (FSDP2's bf16 compute: the
  residual stream is bf16 too); its ``selective`` is the per-op policy of
  torchtitan's ``parallelize_llama.py`` at 9dec370: the block input, the
  outputs of every odd-numbered matmul (wq, wv, w1, w2), the attention's
  output and log-sum-exp and, under tensor parallelism, the reduce-scatter
  outputs; everything else is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

from hpctrain.planner.arch import Arch

RECOMPUTE = ("none", "selective", "full")
INT64 = 8


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for backward: elements per token and how it shards."""

    name: str
    elements: float
    """Elements per token (``a*s`` for attention scores: per query token)."""
    dtype: str
    """``act`` (activation dtype), ``resid`` (residual-stream dtype), ``fp32`` or ``mask`` (1 byte)."""
    split: str
    """``rep`` (replicated under TP, split by sequence parallelism), ``split`` (by TP), ``kv`` (k/v heads)."""
    selective_drop: bool = False
    """Recomputed, not stored, under selective recompute."""


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element by role, and how often autocast re-casts a norm output."""

    act: int
    resid: int
    attn_casts: int
    ffn_casts: int

    def size(self, dtype: str) -> int:
        return {"act": self.act, "resid": self.resid, "fp32": 4, "mask": 1}[dtype]


PROFILES = ("hpctrain", "megatron", "torchtitan")


def dtypes_for(arch: Arch, precision: str, profile: str = "hpctrain") -> Dtypes:
    """GPT and the other codes' blocks: 16-bit throughout. Ours: what torch saves (see module doc)."""
    if arch.family in ("gpt", "nemotron") or profile != "hpctrain":
        return Dtypes(2, 2, 1, 1)
    if precision in ("bf16", "fp16"):  # 16-bit autocast either way
        return Dtypes(2, 4, 3, 2)
    return Dtypes(4, 4, 1, 1)


def saved_tensors(arch: Arch, precision: str, seq_len: int, profile: str = "hpctrain", flash: bool = False,
                  dropout: bool = True) -> List[SavedTensor]:
    """The per-token table of one block (see the module docstring)."""
    h, a, s = arch.d_model, arch.n_heads, seq_len
    if arch.family == "gpt" and (flash or not dropout):
        table = [e for e in saved_tensors(arch, precision, seq_len) if dropout or e.dtype != "mask"]
        if flash:
            table = [e for e in table if not e.selective_drop]
            table.insert(3, SavedTensor("attn_logsumexp", a, "fp32", "split", True))
        return table
    if arch.family == "nemotron" or (profile != "hpctrain" and arch.family == "llama"):
        return _fused_block(arch, profile)
    if arch.family == "gpt":
        return [
            SavedTensor("ln1_input", h, "act", "rep"),
            SavedTensor("qkv_input", h, "act", "rep"),
            SavedTensor("q_k", 2 * h, "act", "split"),
            SavedTensor("softmax_output", a * s, "act", "split", True),
            SavedTensor("attn_dropout_mask", a * s, "mask", "split", True),
            SavedTensor("attn_dropout_output", a * s, "act", "split", True),
            SavedTensor("v", h, "act", "split"),
            SavedTensor("proj_input", h, "act", "split"),
            SavedTensor("proj_dropout_mask", h, "mask", "rep"),
            SavedTensor("ln2_input", h, "act", "rep"),
            SavedTensor("fc1_input", h, "act", "rep"),
            SavedTensor("gelu_input", 4 * h, "act", "split"),
            SavedTensor("gelu_output", 4 * h, "act", "split"),
            SavedTensor("mlp_dropout_mask", h, "mask", "rep"),
        ]
    d = dtypes_for(arch, precision)
    kv, f = arch.kv_dim, (arch.moe_token_ffn if arch.is_moe else arch.ffn_hidden)
    table = [
        SavedTensor("block_input", h, "resid", "rep"),
        SavedTensor("attn_norm_rsqrt", 1, "fp32", "rep"),
        SavedTensor("attn_norm_scaled", h, "resid", "rep"),
        SavedTensor("qkv_input", h * d.attn_casts, "act", "rep"),
        SavedTensor("q_rope", h, "act", "split"),
        SavedTensor("k_rope", kv, "act", "kv"),
        SavedTensor("v", kv, "act", "kv"),
        SavedTensor("attn_logsumexp", a, "fp32", "split", True),
        SavedTensor("attn_output", h, "act", "split"),
        SavedTensor("ffn_residual_input", h, "resid", "rep"),
        SavedTensor("ffn_norm_rsqrt", 1, "fp32", "rep"),
        SavedTensor("ffn_norm_scaled", h, "resid", "rep"),
        SavedTensor("ffn_input", h * d.ffn_casts, "act", "rep"),
        SavedTensor("gate_output", f, "act", "split"),
        SavedTensor("up_output", f, "act", "split"),
        SavedTensor("silu_output", f, "act", "split"),
        SavedTensor("down_input", f, "act", "split"),
    ]
    if arch.is_moe:
        return table[:12] + _moe_block(arch)
    return table


def _moe_block(arch: Arch) -> List[SavedTensor]:
    """Our MoE feed-forward (``plugins/hpctrain_moe``), per token, after the FFN norm: the fp32 router's
    input, logits and probabilities, the routing (k int64 choices, k fp32 weights, the log-sum-exp), and
    per choice the dispatch's bookkeeping, the row as each expert's gate and up projection cast it, its
    SwiGLU tensors and the expert's output the combine keeps. The experts are replicated over tp: a
    rank's rows are its tokens' (split only by sequence parallelism, ``rep``)."""
    h, k, n = arch.d_model, arch.top_k, arch.num_experts
    f = arch.moe_token_ffn  # the routed experts' and the shared ones' SwiGLU tensors
    return [
        SavedTensor("router_input", h, "resid", "rep"),
        SavedTensor("router_logits_probs", 2 * n, "fp32", "rep"),
        SavedTensor("routing", 2 * k + k + 1, "fp32", "rep"),  # int64 choices as two 4-byte elements each
        SavedTensor("dispatch_plan", 4 * k, "fp32", "rep"),  # per row: int64 index, fp32 weight, masks
        SavedTensor("expert_inputs", 2 * h * k, "act", "rep"),
        SavedTensor("gate_output", f, "act", "rep"),
        SavedTensor("up_output", f, "act", "rep"),
        SavedTensor("silu_output", f, "act", "rep"),
        SavedTensor("down_input", f, "act", "rep"),
        SavedTensor("expert_outputs", h * k, "act", "rep"),
    ]


def _fused_block(arch: Arch, profile: str) -> List[SavedTensor]:
    """A Llama-style or Nemotron block in 16-bit with fused kernels (module docstring)."""
    h, a, kv, f = arch.d_model, arch.n_heads, arch.kv_dim, (arch.moe_token_ffn if arch.is_moe else arch.ffn_hidden)
    # torchtitan's tensor parallelism (DTensor) saves the all-gathered input of a column-parallel matmul
    gathered = "full" if profile == "torchtitan" else "rep"
    table = [
        SavedTensor("block_input", h, "resid", "rep"),
        SavedTensor("attn_norm_stats", 4 if arch.family == "nemotron" else 2, "fp32", "rep"),
        SavedTensor("qkv_input", h, "act", gathered),
        SavedTensor("q_rope", h, "act", "split"),
        SavedTensor("k_rope", kv, "act", "kv"),
        SavedTensor("v", kv, "act", "kv"),
        SavedTensor("attn_logsumexp", a, "fp32", "split", True),
        SavedTensor("attn_output", h, "act", "split"),
        SavedTensor("ffn_residual_input", h, "resid", "rep"),
        SavedTensor("ffn_norm_stats", 4 if arch.family == "nemotron" else 2, "fp32", "rep"),
        SavedTensor("ffn_input", h, "act", gathered),
    ]
    if arch.family == "nemotron":  # squared ReLU: its input, and its output as fc2's input
        table += [SavedTensor("relu2_input", f, "act", "split"), SavedTensor("fc2_input", f, "act", "split")]
    else:
        table += [SavedTensor("gate_output", f, "act", "split"), SavedTensor("up_output", f, "act", "split"),
                  SavedTensor("down_input", f, "act", "split")]
    return table


def torchtitan_op_sac(arch: Arch, tp: int) -> List[SavedTensor]:
    """What torchtitan's per-op selective checkpointing keeps of one block (module docstring)."""
    h, a, kv, f = arch.d_model, arch.n_heads, arch.kv_dim, (arch.moe_token_ffn if arch.is_moe else arch.ffn_hidden)
    table = [
        SavedTensor("block_input", h, "resid", "rep"),
        SavedTensor("wq_output", h, "act", "split"),
        SavedTensor("wv_output", kv, "act", "kv"),
        SavedTensor("attn_output", h, "act", "split"),
        SavedTensor("attn_logsumexp", a, "fp32", "split"),
        SavedTensor("w1_output", f, "act", "split"),
        SavedTensor("w2_output", h, "act", "full"),  # a partial sum over tp before its reduce-scatter
    ]
    if tp > 1:  # reduce_scatter_tensor is in the save list: the attention's and the MLP's outputs
        table += [SavedTensor("attn_reduce_scatter", h, "act", "rep"), SavedTensor("mlp_reduce_scatter", h, "act",
                                                                                     "rep")]
    return table


def _shard(entry: SavedTensor, arch: Arch, tp: int, sp: bool) -> float:
    if entry.split == "full":
        return entry.elements
    if entry.split == "rep":
        return entry.elements / tp if sp else entry.elements
    if entry.split == "kv":
        return entry.elements * arch.kv_dim_per_rank(tp) / arch.kv_dim
    return entry.elements / tp


@lru_cache(maxsize=1024)
def layer_bytes_per_token(arch: Arch, precision: str, seq_len: int, tp: int = 1, sp: bool = False,
                          recompute: str = "none", profile: str = "hpctrain", flash: bool = False,
                          dropout: bool = True, ring: bool = False) -> float:
    """Bytes one block keeps per token of a micro-batch on one tensor-parallel rank (``profile``,
    ``flash`` and ``dropout``: the code's, module docstring; the defaults are hpctrain's and the papers').
    ``ring``: hpctrain's ring attention (context parallelism) also keeps its merged output in fp32."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if profile not in PROFILES:
        raise ValueError(f"activation profile must be one of {PROFILES}, got {profile!r}")
    d = dtypes_for(arch, precision, profile)
    table = saved_tensors(arch, precision, seq_len, profile, flash, dropout)
    if sp and tp > 1 and profile == "hpctrain" and arch.family == "llama":
        # the tp plugin's sequence-parallel columns save their input shard once, in its own dtype
        # (the residual stream's), where autocast's F.linear would keep one cast per projection
        table = [SavedTensor(e.name, arch.d_model, "resid", "rep") if e.name in ("qkv_input", "ffn_input") else e
                 for e in table]
    if ring and profile == "hpctrain" and arch.family == "llama":
        table = table + [SavedTensor("ring_output_fp32", arch.d_model, "fp32", "split", True)]
    if recompute == "full":
        table = table[:1]  # the block input only
    elif recompute == "selective" and profile == "torchtitan" and arch.family == "llama":
        table = torchtitan_op_sac(arch, tp)
    elif recompute == "selective":
        table = [e for e in table if not e.selective_drop]
    return sum(_shard(e, arch, tp, sp) * d.size(e.dtype) for e in table)


def layer_bytes(arch: Arch, precision: str, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1,
                sp: bool = False, recompute: str = "none", token_split: int = 1, profile: str = "hpctrain",
                flash: bool = False, dropout: bool = True) -> float:
    """One block, one micro-batch, one GPU. Context parallelism (``cp``) and
    an expert-parallel token split (``token_split``) divide the tokens; the
    per-token attention terms keep the full sequence length."""
    tokens = micro_batch * seq_len / (cp * token_split)
    return tokens * layer_bytes_per_token(arch, precision, seq_len, tp, sp, recompute, profile, flash, dropout,
                                          cp > 1)


LOSS_BYTES = {"hpctrain": 4.0, "megatron": 2.0 + 4.0, "torchtitan": 2.0 + 4.0 + 4.0}
"""Bytes per vocabulary entry per token on the last stage at the loss: ours keeps the fp32 log-softmax;
Megatron's vocab-parallel cross-entropy the 16-bit logits and their fp32 copy (turned into the softmax in
place); torchtitan's ``cross_entropy(pred.float())`` the bf16 logits, their fp32 copy and the fp32
log-softmax at once."""
VOCAB_PARALLEL_LOSS_BYTES = 4.0 + 4.0
"""Ours under tensor parallelism (``plugins/hpctrain_tp/vocab.py``): the fp32 shifted logits and their exp."""


def stage_extra_bytes(arch: Arch, precision: str, micro_batch: int, seq_len: int, tp: int, cp: int, sp: bool,
                      first: bool, last: bool, token_split: int = 1, profile: str = "hpctrain") -> float:
    """Per micro-batch bytes outside the blocks: token ids kept by the embedding (int64), the RoPE
    tables, and on the last stage the final norm, the loss's logits (``LOSS_BYTES``) and the int64
    targets. For OUR model's GPT accounting (the published formulas' per-layer terms only) nothing."""
    if profile != "hpctrain":
        tokens = micro_batch * seq_len / (cp * token_split)
        extra = tokens * INT64 if first else 0.0
        if last:
            h = arch.d_model
            extra += tokens * (h * 2 / (tp if sp else 1) + arch.padded_vocab(tp) / tp * LOSS_BYTES[profile] + INT64)
        return extra
    if arch.family == "gpt":
        return 0.0
    d = dtypes_for(arch, precision)
    h = arch.d_model
    tokens = micro_batch * seq_len / (cp * token_split)
    extra = seq_len / cp * arch.head_dim * 4  # cos and sin, each (s, head_dim/2) fp32
    if first:
        extra += tokens * INT64
    if last:
        norm = (h * d.resid * 2 + 4) / (tp if sp else 1) + h * d.act
        loss = VOCAB_PARALLEL_LOSS_BYTES if tp > 1 else LOSS_BYTES["hpctrain"]
        extra += tokens * (norm + arch.padded_vocab(tp) / tp * loss + INT64)
    return extra


def autocast_weight_copy_bytes(params_on_gpu: float, precision: str, saved_params: float = 0.0,
                               in_flight: float = 1.0) -> float:
    """bf16 autocast casts each weight once per forward and keeps the bf16 copy
    for the backward: 2 bytes per (unsharded-by-ZeRO) parameter of the stage.
    Its cache lives for one micro-batch's forward, so under a pipeline every
    micro-batch in flight keeps its own copies of the weights whose casts the
    backward saved (``saved_params``: the ``F.linear`` weights; the sequence-
    parallel column projections save the fp32 weight and cast again), as
    hpctrain-train's dry run counts them (docs/planner.md, "Dry run")."""
    if precision not in ("bf16", "fp16"):
        return 0.0
    return 2.0 * params_on_gpu + 2.0 * saved_params * max(0.0, in_flight - 1.0)


# -- the paper's closed forms (Korthikanti et al. 2022, Table 2) -------------

def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes per transformer layer, exactly as printed in the paper."""
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    if recompute == "selective":
        return 34.0 * sbh / t if sp else sbh * (10.0 + 24.0 / t)
    if t == 1:
        return sbh * (34.0 + 5.0 * a * s / h)
    if sp:
        return sbh / t * (34.0 + 5.0 * a * s / h)
    return sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t))


def korthikanti_first_stage_bytes(per_layer: float, layers: int, pp: int, vpp: int = 1) -> Tuple[float, float]:
    """(bytes, in-flight factor) on the first pipeline stage under 1F1B:
    L/p layers x p micro-batches, times (1 + (p-1)/(p v)) when interleaved."""
    factor = pp * (1.0 + (pp - 1) / (pp * vpp)) if vpp > 1 else float(pp)
    return per_layer * layers / pp * factor, factor
