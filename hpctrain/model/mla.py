"""Multi-head latent attention (MLA, DeepSeek-V2/V3; ``model.attention_kind=mla``).

The attention sub-layer of a block when ``model.attention_kind=mla``, with ``Attention``'s forward signature
and seams, computing what transformers' ``DeepseekV3Attention`` computes:

- queries: ``wq`` (d_model -> heads x qk_head_dim) when ``model.mla.q_lora_rank`` is null (DeepSeek-V2-Lite),
  else the down-projection ``wq_a`` (d_model -> q_lora_rank), its RMSNorm ``q_norm`` and the up-projection
  ``wq_b`` (q_lora_rank -> heads x qk_head_dim); each head is ``qk_nope_head_dim`` dims without RoPE, then
  ``qk_rope_head_dim`` with;
- keys and values: the down-projection ``wkv_a`` (d_model -> kv_lora_rank + qk_rope_head_dim) gives the
  latent (normalised by ``kv_norm``) and one rotary key shared by every head; the up-projection ``wkv_b``
  (kv_lora_rank -> heads x (qk_nope_head_dim + v_head_dim)) gives each head's non-rotary key and its value;
- RoPE on the rotary parts only (interleaved pairs: DeepSeek's weights are laid out so, transformers'
  ``rope_interleave``), tables of ``qk_rope_head_dim`` dims (the Transformer builds them from
  ``ModelShape.rope_dim``, with yarn's attention factor);
- the softmax scale 1/sqrt(qk_head_dim) times yarn's ``softmax_factor`` (1 without yarn's mscale_all_dim),
  applied to the queries before the core, so any core (sdpa, ring, all-gather) keeps its own 1/sqrt(d);
- the core sees v heads of ``v_head_dim`` dims, other than the q/k heads' (``hpctrain_cp`` handles that);
- ``wo`` (heads x v_head_dim -> d_model) back.

The latent RMSNorms use epsilon 1e-6 whatever ``model.norm_eps`` is: transformers' and DeepSeek's own code
build them with RMSNorm's default.

Seams (``LatentLinears``, like ``Attention.linears``): ``down`` computes the down-projections on the tokens
this rank holds, ``enter`` takes the latents (and the shared rotary key) into the region where heads are
split, ``up`` is a per-head up-projection of an entered latent (``wq_b``, ``wkv_b``), ``columns`` the plain
query projection, ``rows`` the output projection. One process: plain calls, each projection's LoRA adapter
(``hpctrain.finetune.adapter``, ``finetune.lora.targets`` q, q_a, q_b, kv_a, kv_b, o) adding its update.
Tensor parallelism (``hpctrain_tp``) splits the heads: ``wq``/``wq_b`` and ``wkv_b`` column-parallel by whole
heads, ``wo`` row-parallel, the down-projections and latent norms whole on every rank (under sequence
parallelism they run on the rank's sequence shard and their gradients are summed over tp, and ``enter``
all-gathers the latents, far narrower than the hidden states).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from hpctrain.finetune.adapter import adapted
from hpctrain.model.recompute import recomputed
from hpctrain.model.shapes import ModelShape
from hpctrain.model.transformer import Linears, RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6
"""The epsilon of the q and kv latents' RMSNorms (transformers' DeepseekV3RMSNorm default, not rms_norm_eps)."""


class LatentLinears(Linears):
    """How latent attention's projections compute (one process: each ``nn.Linear`` called)."""

    def down(self, x: torch.Tensor, linears: Sequence[nn.Linear]) -> List[torch.Tensor]:
        """The down-projections of the sub-layer input ``x`` (the tokens this rank holds)."""
        return [adapted(linear, x) for linear in linears]

    def enter(self, latent: torch.Tensor) -> torch.Tensor:
        """``latent`` (batch, tokens, width) as the per-head up-projections read it."""
        return latent

    def up(self, latent: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """The per-head up-projection ``linear`` of an entered ``latent``."""
        return adapted(linear, latent)


LOCAL_LATENT = LatentLinears()


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring). ``softmax_factor`` multiplies the softmax
    scale (yarn's ``YarnScaling.softmax_factor``)."""

    param_init: Dict[str, str] = {}

    def __init__(self, shape: ModelShape, core: nn.Module, softmax_factor: float = 1.0):
        super().__init__()
        mla = shape.mla
        assert mla is not None, "MLAttention needs model.attention_kind=mla"
        d, heads = shape.d_model, shape.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        q_rank = mla.q_lora_rank
        self.wq: Optional[nn.Linear] = nn.Linear(d, heads * mla.qk_head_dim, bias=False) if q_rank is None else None
        """The query projection (q_lora_rank null); None: the low-rank pair below."""
        self.wq_a: Optional[nn.Linear] = nn.Linear(d, q_rank, bias=False) if q_rank is not None else None
        """The query's down-projection (None without q_lora_rank)."""
        self.q_norm: Optional[RMSNorm] = RMSNorm(q_rank, LATENT_NORM_EPS) if q_rank is not None else None
        """The query latent's RMSNorm (None without q_lora_rank)."""
        self.wq_b: Optional[nn.Linear] = \
            nn.Linear(q_rank, heads * mla.qk_head_dim, bias=False) if q_rank is not None else None
        """The query's up-projection, per head (None without q_lora_rank)."""
        self.wkv_a = nn.Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * mla.v_head_dim, d, bias=False)
        cast(Any, self.wo).param_init = {"weight": "normal_scaled"}  # (as Attention's wo)
        self.softmax_factor = float(softmax_factor)
        self.core = core
        self.linears: LatentLinears = LOCAL_LATENT
        """The projections' seam (see ``LatentLinears``)."""
        self.recompute_core = False
        """Selective recomputation: the core keeps only q, k, v for backward."""

    def _latents(self, x: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(query latent or None, key/value latent, shared rotary key) of the tokens ``x``, entered into the
        heads' region in one piece."""
        if self.wq_a is not None and self.q_norm is not None:
            q_lat, kv = self.linears.down(x, [self.wq_a, self.wkv_a])
            q_lat = self.q_norm(q_lat)
        else:
            q_lat, (kv,) = None, self.linears.down(x, [self.wkv_a])
        kv_lat, k_rope = kv.split([self.kv_rank, self.rope_dim], dim=-1)
        parts = ([] if q_lat is None else [q_lat]) + [self.kv_norm(kv_lat), k_rope]
        entered = self.linears.enter(torch.cat(parts, dim=-1)).split([p.shape[-1] for p in parts], dim=-1)
        return (entered[0] if q_lat is not None else None), entered[-2], entered[-1]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As ``Attention.forward``: ``segments`` (batch, seq), document masking's per-token document index."""
        q_lat, kv_lat, k_rope = self._latents(x)
        if q_lat is not None:
            assert self.wq_b is not None  # (set with wq_a)
            q = self.linears.up(q_lat, self.wq_b)
        else:
            assert self.wq is not None
            (q,) = self.linears.columns(x, [self.wq])
        kv = self.linears.up(kv_lat, self.wkv_b)
        b, t = kv.shape[:2]  # t: the tokens the heads see (sequence parallelism gathers them)
        q_nope, q_rope = q.view(b, t, -1, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], -1)
        k_nope, v = kv.view(b, t, -1, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        heads = q_nope.shape[2]
        k_rope = apply_rope(k_rope.view(b, t, 1, self.rope_dim), cos, sin).expand(b, t, heads, self.rope_dim)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        k = torch.cat([k_nope, k_rope], dim=-1)
        args: Tuple[torch.Tensor, ...] = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if segments is not None:
            args += (segments,)
        out = recomputed(self.core, *args) if self.recompute_core else self.core(*args)
        return self.linears.rows(out.transpose(1, 2).reshape(b, t, -1), self.wo)
