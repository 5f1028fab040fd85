"""Our logical tensor names and Hugging Face's (Llama/Mistral/Qwen2/Qwen3 and Mixtral naming).

``tok_embeddings`` <-> ``model.embed_tokens``; per layer ``attn.w{q,k,v,o}``
<-> ``self_attn.{q,k,v,o}_proj`` (Qwen2's ``attn.w{q,k,v}.bias`` <->
``self_attn.{q,k,v}_proj.bias``), Qwen3's ``attn.{q,k}_norm`` <->
``self_attn.{q,k}_norm``, ``ffn.w1/w3/w2`` <-> ``mlp.gate/up/down_proj``,
``attn_norm`` / ``ffn_norm`` <-> ``input_layernorm`` / ``post_attention_layernorm``;
Mixtral's ``ffn.router`` <-> ``block_sparse_moe.gate`` and our stacked
``ffn.experts.w{1,3,2}`` (E, ...) <-> one tensor per expert,
``block_sparse_moe.experts.<e>.w{1,3,2}.weight`` (the same gate/up/down
letters); Qwen3-MoE's (``MOE_FAMILIES``) ``mlp.gate`` and
``mlp.experts.<e>.{gate,up,down}_proj.weight`` (transformers 5 fuses them
in memory, but writes and reads this layout); ``norm`` <-> ``model.norm``;
``output`` <-> ``lm_head`` (absent when the embeddings are tied). Linear weights are (out, in) in both: no transposes.

DeepSeek-V3's multi-token prediction modules (``model.mtp_depth``, ``hpctrain.model.mtp``) are extra decoder
layers after the main model's, as DeepSeek's published checkpoint stores them (``model.layers.61.*`` of the
61-layer model, ``num_nextn_predict_layers`` in config.json) and transformers' ``MtpModel`` reads them: our
``mtp.layers.<n_layers + k>.`` <-> ``model.layers.<n_layers + k>.``, the module's ``enorm``, ``hnorm`` and
``eh_proj`` under their own names, its output norm ``norm`` as ``shared_head.norm``, its block's tensors as a
decoder layer's (``block.attn.wq_a.weight`` -> ``self_attn.q_a_proj.weight``, the MoE block's experts, router
and shared experts alike). The layer also holds copies of the shared embedding and head
(``embed_tokens.weight``, ``shared_head.head.weight``, ``MTP_SHARED``): written on export, not read (ours are
the main model's).

RoPE: our ``apply_rope`` rotates interleaved pairs (dims 2i, 2i+1 of a head
share frequency i); Hugging Face's ``rotate_half`` rotates dims i and
i + d/2. Ordering the rows of each head of ``q_proj`` and ``k_proj`` as
``[0, 2, 4, ..., d-2, 1, 3, ..., d-1]`` of ours turns one into the other:
the rotated q and k come out permuted the same way within each head, and
the scores q.k are unchanged (transformers' forward checks it:
tests/unit/hf/test_hf_logits.py). What acts on those rows elementwise goes
with them: the q/k biases are permuted as the rows, and the qk-norm
weights (one head's dims) as the rows of one head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import numpy as np

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PER_LAYER = {
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.bias": "self_attn.q_proj.bias", "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias", "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
_QUERY_ROWS = ("attn.wq.weight", "attn.wq.bias")
_KEY_ROWS = ("attn.wk.weight", "attn.wk.bias")
_ONE_HEAD = ("attn.q_norm.weight", "attn.k_norm.weight")
MOE_FAMILIES = {
    "mixtral": ("block_sparse_moe", {"ffn.experts.w1": "w1", "ffn.experts.w3": "w3", "ffn.experts.w2": "w2"}),
    "qwen3_moe": ("mlp", {"ffn.experts.w1": "gate_proj", "ffn.experts.w3": "up_proj", "ffn.experts.w2": "down_proj"}),
    "deepseek_v3": ("mlp", {"ffn.experts.w1": "gate_proj", "ffn.experts.w3": "up_proj", "ffn.experts.w2": "down_proj"}),
}
"""Where each MoE architecture keeps a block's router and experts: (module, our expert tensor -> its name)."""
MLA_FAMILY = "deepseek_v3"
"""The family of a model with latent attention (``model.attention_kind=mla``): DeepseekV3ForCausalLM's names.
Its dense layers use ``_PER_LAYER``'s, its MoE layers ``MOE_FAMILIES``' experts and router, ``_DEEPSEEK_MOE``."""
_DEEPSEEK_MOE = {
    "ffn.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
"""DeepSeek-V3's MoE block beside its experts and router: the sigmoid router's selection bias (a buffer both
sides) and the shared experts (one SwiGLU of n_shared_experts x moe_intermediate_size)."""
_MLA_PER_LAYER = {
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
}
"""Latent attention's tensors (``hpctrain.model.mla``) <-> DeepseekV3Attention's. No row permutation: DeepSeek
lays its rotary dims out in interleaved pairs (``rope_interleave``), as our ``apply_rope`` rotates them."""
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "norm.weight": "shared_head.norm.weight"}
"""An MTP module's own tensors (``hpctrain.model.mtp.MTPModule``) <-> DeepSeek-V3's names in its layer."""
MTP_SHARED = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
"""The shared embedding and head, of which DeepSeek-V3's checkpoint keeps a copy in every MTP layer."""
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class HfTensor:
    """Where one logical tensor lives in a Hugging Face checkpoint."""

    names: List[str]
    """The Hugging Face tensor(s): one, or one per expert (stacked on our dim 0)."""
    rope_heads: Optional[int] = None
    """q_proj / k_proj (weight and bias): the heads whose rows are in rotate_half order there
    (``rope_row_permutation``); 1 for the qk-norm weights (one head's dims)."""


def moe_family(model: Any) -> str:
    """The MoE architecture of a model config section (its ``MOE_FAMILIES`` key): Qwen3-MoE, the one
    with qk-norm, or Mixtral (what ``hpctrain.hf.export`` writes, and what an import reads)."""
    if model.get("attention_kind", "gqa") == "mla":
        return MLA_FAMILY
    return "qwen3_moe" if bool(model.get("qk_norm", False)) else "mixtral"


def hf_tensor(logical: str, n_heads: int, n_kv_heads: int, num_experts: int = 0,
              family: str = "mixtral") -> Optional[HfTensor]:
    """The Hugging Face tensor(s) of a logical tensor, or None if it has none (``family``: the MoE
    architecture's names, ``MOE_FAMILIES``)."""
    if logical in _TOP:
        return HfTensor([_TOP[logical]])
    mtp = _MTP_LAYER.match(logical)
    if mtp is not None:
        return _mtp_tensor(int(mtp.group(1)), mtp.group(2), n_heads, n_kv_heads, num_experts, family)
    m = _LAYER.match(logical)
    if m is None:
        return None
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if family == MLA_FAMILY and (rest in _MLA_PER_LAYER or rest in _DEEPSEEK_MOE or rest.startswith("attn.")):
        return _mla_tensor(prefix, rest)
    module, experts = MOE_FAMILIES[family]
    if rest == "ffn.router.weight":
        return HfTensor([f"{prefix}{module}.gate.weight"])
    if rest in experts:
        return HfTensor([f"{prefix}{module}.experts.{e}.{experts[rest]}.weight" for e in range(num_experts)])
    if rest not in _PER_LAYER:
        return None
    heads = n_heads if rest in _QUERY_ROWS else n_kv_heads if rest in _KEY_ROWS else 1 if rest in _ONE_HEAD else None
    return HfTensor([prefix + _PER_LAYER[rest]], heads)


def _mla_tensor(prefix: str, rest: str) -> Optional[HfTensor]:
    """A DeepseekV3 layer's latent attention tensor, or its MoE block's expert bias or shared experts."""
    name = _MLA_PER_LAYER.get(rest) or _DEEPSEEK_MOE.get(rest)
    return HfTensor([prefix + name]) if name is not None else None


def _mtp_tensor(index: int, rest: str, n_heads: int, n_kv_heads: int, num_experts: int,
                family: str) -> Optional[HfTensor]:
    """An MTP module's tensor in DeepSeek-V3's layout (module docstring), or None: only DeepseekV3 has one."""
    if family != MLA_FAMILY:
        return None
    if rest in _MTP_OWN:
        return HfTensor([f"model.layers.{index}.{_MTP_OWN[rest]}"])
    if rest.startswith("block."):
        return hf_tensor(f"layers.{index}.{rest[len('block.'):]}", n_heads, n_kv_heads, num_experts, family)
    return None


def mtp_copies(logical: str, mtp_layers: Sequence[int], tied: bool) -> List[str]:
    """The names under which DeepSeek-V3's checkpoint keeps further copies of the shared embedding or head
    ``logical`` (``MTP_SHARED``) in the MTP layers ``mtp_layers``; with tied embeddings the head's copies are
    the embedding's too."""
    parts = [MTP_SHARED[logical]] if logical in MTP_SHARED else []
    if tied and logical == "tok_embeddings.weight":
        parts.append(MTP_SHARED["output.weight"])
    return [f"model.layers.{i}.{part}" for i in mtp_layers for part in parts]


def hf_name(logical: str) -> Optional[str]:
    """The Hugging Face name of a logical tensor stored as one tensor there (not the experts)."""
    found = hf_tensor(logical, 1, 1)
    return found.names[0] if found is not None and len(found.names) == 1 else None


def rope_row_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order taking an interleaved-RoPE projection to HF's rotate_half convention:
    ``hf = ours[perm]``; its inverse (``np.argsort``) takes HF's rows to ours."""
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
