"""What the planner knows about a model: parameter counts and FLOPs per token.

Two families, because the published tables we validate against describe a
different block from ours:

- ``llama`` is OUR model (``hpctrain.model``): RMSNorm, no biases, SwiGLU with
  three matrices, grouped-query attention, RoPE, optionally tied embeddings.
  Every count is read from ``hpctrain.model.shapes.ModelShape`` so the planner
  and the model builder cannot disagree. A mixture-of-experts variant
  replaces the SwiGLU of every ``moe_every``-th block by ``num_experts``
  copies plus an ``h x E`` router (and ``shared_experts`` more copies every
  token uses), as the MoE plugin builds it: experts split over ep and
  replicated over tp (the MoE block is not tensor-parallel).
- ``gpt`` is the GPT of Megatron-LM (Narayanan et al. 2021, Table 1): 4h GeLU
  MLP, biases, LayerNorm, learned positions, output tied to the input
  embedding (or not: the Megatron-Core table's models). Its total follows
  the paper's formula exactly,
  P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)) = 12lh^2 + 13lh + (V+s)h,
  which leaves out the final LayerNorm (2h); we do the same so the rows
  compare like with like. GPT-3 and BLOOM are this family (BLOOM's ALiBi
  has no position table).
- ``nemotron`` is Nemotron-4's block (NVIDIA 2024; transformers'
  ``NemotronConfig``): LayerNorm (with bias), grouped-query attention with
  RoPE, a two-matrix squared-ReLU MLP, no linear biases, untied embeddings.

FLOPs count matrix multiplications only (2 per multiply-add) and credit the
full s x s attention (no causal halving), the convention of Narayanan et al.
and of PaLM's MFU, so our MFU compares with theirs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.model.shapes import ModelShape, padded_vocab


@dataclass(frozen=True)
class Arch:
    """Model dimensions plus the closed-form counts derived from them."""

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    tie_embeddings: bool
    positions: int = 0
    """Learned position-embedding rows (gpt: the sequence length; llama: 0, RoPE)."""
    num_experts: int = 1
    """Experts per MoE layer (1 = dense)."""
    top_k: int = 1
    """Experts each token is routed to."""
    moe_every: int = 1
    """MoE in blocks i with (i + 1) % moe_every == 0; the others dense."""
    shared_experts: int = 0
    """Experts every token passes through besides its routed ones (MoE blocks only)."""
    name: str = "model"
    vocab_pad_to: Optional[int] = None
    """``model.vocab_pad_to`` (None: the default padding rule)."""
    moe_ffn_hidden: Optional[int] = None
    """Width of each routed and shared expert (``model.moe.ffn_hidden``); None: ``ffn_hidden``."""
    first_dense_blocks: int = 0
    """Leading blocks that keep the dense SwiGLU (``model.moe.first_dense_blocks``)."""
    mtp_depth: int = 0
    """Multi-token prediction modules after the last block (``model.mtp_depth``)."""
    shape: Optional[ModelShape] = None
    """Our model's full shape (head_dim, qk-norm, biases, MLA) when built from a config; None: the plain
    shape of the fields above."""

    # -- construction ----------------------------------------------------
    @classmethod
    def from_model_config(cls, m: Any, num_experts: Optional[int] = None, top_k: Optional[int] = None) -> "Arch":
        """OUR model from a ModelConfig, through ModelShape (the one source of
        truth); an MoE model's settings from its ``model.moe`` section
        (``num_experts``/``top_k`` given here override them)."""
        shape = ModelShape.from_config(m)
        e, k, every, shared = moe_settings(m)
        arch = cls.from_shape(shape, name=str(getattr(m, "name", "model")),
                              num_experts=num_experts if num_experts is not None else e,
                              top_k=top_k if top_k is not None else k, moe_every=every, shared_experts=shared)
        expert_ffn, first_dense = moe_widths(m)
        pad_to = getattr(m, "vocab_pad_to", None)
        return replace(arch, vocab_pad_to=None if pad_to is None else int(pad_to), moe_ffn_hidden=expert_ffn,
                       first_dense_blocks=first_dense, mtp_depth=int(getattr(m, "mtp_depth", 0) or 0))

    @classmethod
    def from_shape(cls, shape: ModelShape, name: str = "model", num_experts: int = 1, top_k: int = 1,
                   moe_every: int = 1, shared_experts: int = 0) -> "Arch":
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ConfigError(f"MoE needs num_experts >= 1 and 1 <= top_k <= num_experts (got {num_experts}, {top_k})")
        if moe_every < 1 or shared_experts < 0:
            raise ConfigError(f"MoE needs every >= 1 and shared_experts >= 0 (got {moe_every}, {shared_experts})")
        return cls("llama", shape.vocab_size, shape.d_model, shape.n_layers, shape.n_heads, shape.n_kv_heads,
                   shape.ffn_hidden, shape.tie_embeddings, 0, num_experts, top_k, moe_every, shared_experts, name,
                   shape=shape)

    @classmethod
    def gpt(cls, n_layers: int, d_model: int, n_heads: int, vocab_size: int, seq_len: int, name: str = "gpt",
            tie_embeddings: bool = True) -> "Arch":
        """A Megatron-LM GPT (MLP width 4h, learned positions; ``seq_len`` 0 for none, as ALiBi)."""
        return cls("gpt", vocab_size, d_model, n_layers, n_heads, n_heads, 4 * d_model, tie_embeddings, seq_len, 1,
                   1, 1, 0, name)

    @classmethod
    def nemotron(cls, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, ffn_hidden: int,
                 vocab_size: int, name: str = "nemotron") -> "Arch":
        """A Nemotron-4 block stack (LayerNorm, GQA + RoPE, squared-ReLU MLP, no biases, untied)."""
        return cls("nemotron", vocab_size, d_model, n_layers, n_heads, n_kv_heads, ffn_hidden, False, 0, 1, 1, 1, 0,
                   name)

    # -- shapes ----------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self._shape.head_dim  # one definition: the model's own shape

    @property
    def kv_dim(self) -> int:
        return self._shape.kv_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` holds experts (the MoE plugin's rule, ``model.moe.every``)."""
        return self.is_moe and i >= self.first_dense_blocks and (i + 1) % self.moe_every == 0

    @property
    def expert_ffn(self) -> int:
        """One expert's SwiGLU width (dense blocks use ``ffn_hidden``)."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn_hidden

    @property
    def moe_token_ffn(self) -> int:
        """SwiGLU width a token passes through in an MoE block: its top_k routed experts and the shared ones."""
        return self.expert_ffn * (self.top_k + self.shared_experts)

    def moe_layers_in(self, first: int, stop: int) -> int:
        """MoE blocks among blocks ``first .. stop - 1``."""
        return sum(1 for i in range(first, stop) if self.is_moe_layer(i))

    @property
    def n_moe_layers(self) -> int:
        return self.moe_layers_in(0, self.n_layers)

    @cached_property
    def _shape(self) -> ModelShape:
        if self.shape is not None:
            return self.shape
        return ModelShape(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.n_kv_heads,
                          self.ffn_hidden, self.tie_embeddings)

    def kv_dim_per_rank(self, tp: int) -> int:
        """K/V width on one tensor-parallel rank: heads are split, or replicated
        (one head per rank) when tp exceeds the number of kv heads."""
        return max(self.kv_dim // tp, self.head_dim) if tp > 1 else self.kv_dim

    # -- parameters (logical) --------------------------------------------
    @cached_property
    def attention_params(self) -> int:
        if self.family == "gpt":
            return 4 * self.d_model ** 2 + 4 * self.d_model  # QKV + proj, with biases
        if self.family == "nemotron":
            return 2 * self.d_model * self.d_model + 2 * self.d_model * self.kv_dim  # q, o; k, v (no biases)
        return self._shape.attention_params

    @cached_property
    def expert_params(self) -> int:
        """One feed-forward block (one expert)."""
        if self.family == "gpt":
            return 8 * self.d_model ** 2 + 5 * self.d_model  # h->4h->h with biases
        if self.family == "nemotron":
            return 2 * self.d_model * self.ffn_hidden  # up, down (squared ReLU, no biases)
        return 3 * self.d_model * self.expert_ffn

    @property
    def router_params(self) -> int:
        return self.d_model * self.num_experts if self.is_moe else 0

    @property
    def norm_params(self) -> int:
        """Norm weights per block (replicated under tensor parallelism)."""
        return 4 * self.d_model if self.family in ("gpt", "nemotron") else 2 * self.d_model

    @cached_property
    def layer_params(self) -> int:
        """One MoE block (a dense one when the model has no experts)."""
        if self.family == "llama" and not self.is_moe:
            return self._shape.block_params
        return (self.attention_params + (self.num_experts + self.shared_experts) * self.expert_params
                + self.router_params + self.norm_params)

    @cached_property
    def dense_layer_params(self) -> int:
        """One block without experts."""
        if self.family == "llama":
            return self._shape.block_params
        return self.attention_params + self.expert_params + self.norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.positions * self.d_model

    @property
    def output_params(self) -> int:
        """The output projection when it is not tied to the input embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * self.d_model

    @property
    def final_norm_params(self) -> int:
        if self.family == "nemotron":
            return 2 * self.d_model  # LayerNorm weight and bias
        return 0 if self.family == "gpt" else self.d_model  # the paper's formula omits GPT's final LayerNorm

    @property
    def mtp_is_moe(self) -> bool:
        """An MTP module's block is of the kind of the model's last block (``hpctrain.model.mtp``)."""
        return self.is_moe_layer(self.n_layers - 1)

    @property
    def mtp_module_params(self) -> int:
        """One multi-token prediction module: ``eh_proj`` (2h x h), three RMSNorms and one block (the embedding
        and head are the model's)."""
        block = self.layer_params if self.mtp_is_moe else self.dense_layer_params
        return 2 * self.d_model * self.d_model + 3 * self.d_model + block

    @cached_property
    def total_params(self) -> int:
        mtp = self.mtp_depth * self.mtp_module_params
        if self.family == "llama" and not self.is_moe:
            return self._shape.total_params + mtp
        blocks = self.n_moe_layers * self.layer_params + (self.n_layers - self.n_moe_layers) * self.dense_layer_params
        return self.embedding_params + blocks + self.final_norm_params + self.output_params + mtp

    @property
    def muon_share(self) -> float:
        """Fraction of the parameters in hidden matrices (Muon's; the rest, the
        embedding, head and norms, take AdamW's step)."""
        norms = self.n_layers * self.norm_params + self.final_norm_params
        return (self.total_params - self.embedding_params - self.output_params - norms) / self.total_params

    @cached_property
    def active_params(self) -> int:
        """Parameters a token passes through (MoE: top_k experts of E)."""
        moe_blocks = self.n_moe_layers + (self.mtp_depth if self.mtp_is_moe else 0)
        inactive = (self.num_experts - self.top_k) * self.expert_params * moe_blocks
        return self.total_params - inactive

    @cached_property
    def matmul_params(self) -> int:
        """N in PaLM's 6N: active parameters used in matrix multiplications.
        The input embedding (a lookup) and learned positions are left out; a
        tied table still counts once, as the output projection."""
        lookup = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.active_params - lookup - self.positions * self.d_model

    # -- per tensor-parallel rank ------------------------------------------
    def layer_params_per_rank(self, tp: int, ep: int = 1, moe: bool = True) -> int:
        """One block's parameters on one (tp, ep) rank (``moe``: an MoE block
        when the model has experts). Attention matrices and a dense block's
        SwiGLU are split by tp (kv heads replicated when tp > n_kv_heads);
        norms are replicated; an MoE block's routed experts are split by ep,
        and its experts, shared experts and router are replicated over tp."""
        h = self.d_model
        if self.family == "gpt":
            # column-parallel weights and biases split (12h^2 + 7h); the two
            # row-parallel biases and both LayerNorms replicated (6h)
            return (12 * h * h + 7 * h) // tp + 6 * h
        attention = self.attention_params_per_rank(tp)
        if self.family == "nemotron":
            return attention + 2 * h * (self.ffn_hidden // tp) + self.norm_params
        if not (moe and self.is_moe):
            return attention + 3 * h * (self.ffn_hidden // tp) + self.norm_params
        experts = (self.num_experts // ep) * self.expert_params
        shared = self.shared_experts * self.expert_params
        return attention + experts + shared + self.router_params + self.norm_params

    def attention_params_per_rank(self, tp: int) -> int:
        """One block's attention on one tp rank: the per-head matrices split (kv heads replicated when tp
        exceeds them); under MLA the down-projections and their norms replicated, as transformers' and
        Megatron's tensor-parallel plans keep them."""
        h, sh = self.d_model, self._shape
        if self.family == "llama" and sh.mla is not None:
            mla, a = sh.mla, self.n_heads // tp
            r = mla.q_lora_rank
            q = h * a * mla.qk_head_dim if r is None else h * r + r + r * a * mla.qk_head_dim
            kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
            return q + kv + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim) + a * mla.v_head_dim * h
        q, kv = (sh.q_dim, self.kv_dim_per_rank(tp)) if self.family == "llama" else (h, self.kv_dim_per_rank(tp))
        out = 2 * h * (q // tp) + 2 * h * kv
        if self.family == "llama":
            out += (q // tp + 2 * kv if sh.qkv_bias else 0) + (2 * self.head_dim if sh.qk_norm else 0)
        return out

    def expert_params_per_rank(self, ep: int = 1) -> int:
        """One MoE block's routed-expert parameters on one ep rank (reduced over cp x dp only)."""
        return (self.num_experts // ep) * self.expert_params if self.is_moe else 0

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows per the vocab-parallel embedding's rule (``model.shapes.padded_vocab``)."""
        return padded_vocab(self.vocab_size, tp, self.vocab_pad_to)

    def param_tensors_per_layer(self, ep: int = 1, moe: bool = True) -> int:
        """Parameter tensors per block (torch's AdamW keeps one step counter
        each). An MoE block stacks its experts into three [experts, ...]
        tensors, plus the router and three for the shared experts."""
        if self.family == "gpt":
            return 12  # 4 weights + 4 biases + 2 x (LayerNorm weight, bias)
        if self.family == "nemotron":
            return 4 + 2 + 4  # q, k, v, o; up, down; 2 x (LayerNorm weight, bias)
        if not (moe and self.is_moe):
            return 4 + 3 + 2
        return 4 + 3 + 1 + (3 if self.shared_experts else 0) + 2

    # -- FLOPs -----------------------------------------------------------
    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """Matrix-multiply FLOPs of one block's forward, per token (full s x s attention)."""
        h = self.d_model
        if self.family == "gpt":
            return 24.0 * h * h + 4.0 * seq_len * h
        if self.family == "nemotron":
            projections = 2.0 * (2 * h * h + 2 * h * self.kv_dim)
            ffn = 4.0 * h * self.ffn_hidden
        else:  # an MoE block (every block of a dense model): a token's experts, the shared ones, the router
            projections = 2.0 * self.attention_params
            ffn = 6.0 * h * (self.moe_token_ffn if self.is_moe else self.ffn_hidden) + 2.0 * self.router_params
        return projections + ffn + self.attention_core_flops_per_token(seq_len)

    def attention_core_flops_per_token(self, seq_len: int) -> float:
        """The QK^T and AV part of the block forward (what selective recompute redoes); MLA's v heads may
        differ in size from its q/k heads."""
        if self.family != "llama":
            return 4.0 * seq_len * self.n_heads * self.head_dim
        return 2.0 * seq_len * self.n_heads * (self.head_dim + self._shape.v_head_dim)

    def head_forward_flops_per_token(self) -> float:
        """The output projection to the vocabulary."""
        return 2.0 * self.d_model * self.vocab_size


def moe_widths(model_cfg: Any) -> "tuple[Optional[int], int]":
    """(expert width or None for ``model.ffn_hidden``, first_dense_blocks) of an MoE model's ``model.moe``."""
    moe = _moe_section(model_cfg)
    if moe is None:
        return None, 0
    width = getattr(moe, "ffn_hidden", None)
    return (None if width is None else int(width)), int(getattr(moe, "first_dense_blocks", 0) or 0)


def _moe_section(model_cfg: Any) -> Any:
    if str(getattr(model_cfg, "ffn", "swiglu")) != "moe":
        return None
    try:
        return model_cfg.get("moe") if hasattr(model_cfg, "get") else getattr(model_cfg, "moe", None)
    except Exception:  # noqa: BLE001 - a structured config without the key
        return None


def moe_settings(model_cfg: Any) -> "tuple[int, int, int, int]":
    """(num_experts, top_k, every, shared_experts) of a model with
    ``model.ffn=moe`` and its ``model.moe`` section (the MoE plugin's keys),
    else a dense model's (1, 1, 1, 0)."""
    dense = (1, 1, 1, 0)
    moe = _moe_section(model_cfg)
    if moe is None:
        return dense
    return (int(getattr(moe, "num_experts", 1) or 1), int(getattr(moe, "top_k", 1) or 1),
            int(getattr(moe, "every", 1) or 1), int(getattr(moe, "shared_experts", 0) or 0))
