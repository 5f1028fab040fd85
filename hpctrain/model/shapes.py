"""Closed-form shapes and parameter counts of the reference model.

Shared by the model builder (tensor shapes) and the planner (memory, FLOPs),
so the two cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hpctrain.errors import ConfigError


def default_ffn_hidden(d_model: int, multiple_of: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


GPU_SIZED_VOCAB = 4096
"""From this many tokens up, the default vocabulary padding under tensor
parallelism is a multiple of tp x 64 (rows tensor cores like); smaller
(byte-level) vocabularies are padded to a multiple of tp only."""


def vocab_multiple(vocab_size: int, tp: int, pad_to: Optional[int] = None) -> int:
    """What the vocabulary is padded to a multiple of under ``tp``-way tensor
    parallelism (``model.vocab_pad_to``; None: the default rule above)."""
    if pad_to is not None:
        return pad_to
    return tp * 64 if vocab_size >= GPU_SIZED_VOCAB else tp


def padded_vocab(vocab_size: int, tp: int, pad_to: Optional[int] = None) -> int:
    """Rows of the vocab-parallel embedding and output projection over ``tp`` ranks."""
    if tp <= 1:
        return vocab_size
    m = vocab_multiple(vocab_size, tp, pad_to)
    return -(-vocab_size // m) * m


def _key(m: Any, key: str) -> Any:
    """``m.key``, or None for a config without it (a model config of an older checkpoint)."""
    return m.get(key) if hasattr(m, "get") else getattr(m, key, None)


ATTENTION_KINDS = ("gqa", "mla")
"""``model.attention_kind``: grouped-query or multi-head latent attention."""


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention's dimensions (``model.mla``)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, m: Any) -> "MLAShape":
        mla = _key(m, "mla")
        got = {k: _key(mla, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim")}
        for k, v in got.items():
            if not (v is None and k == "q_lora_rank") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"model.mla.{k}={v}: must be {'null or ' if k == 'q_lora_rank' else ''}an "
                                  "integer >= 1")
        if got["qk_rope_head_dim"] % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={got['qk_rope_head_dim']}: must be even (RoPE rotates "
                              "pairs of dims)")
        return cls(**got)


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    tie_embeddings: bool
    explicit_head_dim: Optional[int] = None
    """``model.head_dim`` when set (it may differ from d_model / n_heads); None: d_model / n_heads."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (``model.qkv_bias``)."""
    qk_norm: bool = False
    """RMSNorm weights of size head_dim on the queries and keys (``model.qk_norm``)."""
    mla: Optional[MLAShape] = None
    """Multi-head latent attention's dimensions (``model.attention_kind=mla``); None: grouped-query attention."""

    @property
    def head_dim(self) -> int:
        """A query/key head's size (under MLA: its non-rotary and rotary parts together)."""
        if self.mla is not None:
            return self.mla.qk_head_dim
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates (under MLA only the decoupled rotary part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (and the output projection's input)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, m: Any) -> "ModelShape":
        """From a ModelConfig (dataclass or DictConfig), checking consistency."""
        n_kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
        kind = _key(m, "attention_kind") or "gqa"
        if kind not in ATTENTION_KINDS:
            raise ConfigError(f"model.attention_kind={kind!r} is not one of {', '.join(ATTENTION_KINDS)}")
        if kind == "mla":
            return cls._mla(m, n_kv)
        head_dim = _key(m, "head_dim")
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2
                                     or head_dim % 2):
            raise ConfigError(f"model.head_dim={head_dim}: must be null or an even integer >= 2 (RoPE rotates "
                              "pairs of a head's dims)")
        if head_dim is None and m.d_model % m.n_heads:
            raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
        if m.n_heads % n_kv:
            raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={n_kv}")
        if head_dim is None and (m.d_model // m.n_heads) % 2:
            raise ConfigError(f"head dim d_model/n_heads={m.d_model // m.n_heads} must be even for RoPE")
        ffn: Optional[int] = m.ffn_hidden
        return cls(
            vocab_size=m.vocab_size,
            d_model=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            n_kv_heads=n_kv,
            ffn_hidden=ffn if ffn is not None else default_ffn_hidden(m.d_model, m.ffn_multiple_of),
            tie_embeddings=bool(m.tie_embeddings),
            explicit_head_dim=head_dim,
            qkv_bias=bool(_key(m, "qkv_bias")),
            qk_norm=bool(_key(m, "qk_norm")),
        )

    @classmethod
    def _mla(cls, m: Any, n_kv: int) -> "ModelShape":
        mla = MLAShape.from_config(m)
        clash = [f"model.{k}={_key(m, k)}" for k, bad in (("head_dim", _key(m, "head_dim") is not None),
                                                          ("qkv_bias", bool(_key(m, "qkv_bias"))),
                                                          ("qk_norm", bool(_key(m, "qk_norm"))),
                                                          ("n_kv_heads", n_kv != m.n_heads)) if bad]
        if clash:
            raise ConfigError(f"{', '.join(clash)} with model.attention_kind=mla: latent attention sets its heads "
                              "in model.mla (every head has its own keys and values, no biases or qk-norm); "
                              "leave these at their defaults (null, false)")
        ffn: Optional[int] = m.ffn_hidden
        return cls(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                   n_kv_heads=m.n_heads, ffn_hidden=ffn if ffn is not None else default_ffn_hidden(
                       m.d_model, m.ffn_multiple_of), tie_embeddings=bool(m.tie_embeddings), mla=mla)

    # -- parameter counts (logical, unsharded) ---------------------------
    @property
    def attention_params(self) -> int:
        if self.mla is not None:
            return self.mla_params
        h, q, kv = self.d_model, self.q_dim, self.kv_dim
        out = h * q + 2 * h * kv + q * h  # wq, wk, wv, wo
        if self.qkv_bias:
            out += q + 2 * kv
        if self.qk_norm:
            out += 2 * self.head_dim
        return out

    @property
    def mla_params(self) -> int:
        """Latent attention's weights: the query projection (or its down-projection, norm and up-projection), the
        key/value down-projection with the shared rotary key, its norm, the up-projection and the output."""
        mla, h, a = self.mla, self.d_model, self.n_heads
        assert mla is not None
        r = mla.q_lora_rank
        q = h * a * mla.qk_head_dim if r is None else h * r + r + r * a * mla.qk_head_dim
        kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
        return q + kv + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim) + a * mla.v_head_dim * h

    @property
    def ffn_params(self) -> int:
        return 3 * self.d_model * self.ffn_hidden  # w1 (gate), w3 (up), w2 (down)

    @property
    def block_params(self) -> int:
        return self.attention_params + self.ffn_params + 2 * self.d_model  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def total_params(self) -> int:
        out = 0 if self.tie_embeddings else self.embedding_params
        return self.embedding_params + self.n_layers * self.block_params + self.d_model + out

