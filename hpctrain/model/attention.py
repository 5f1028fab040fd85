"""Core attention: the one function every attention layer calls.

``Attention.core`` is a module with ``forward(q, k, v) -> out`` on tensors of
shape (batch, heads, seq, head_dim), causal. Context parallelism replaces it
(ring attention) through ``hpctrain_make_module("attention", name, ...)``
without touching the projections around it.

Document masking: a core that supports it takes a fourth argument,
``forward(q, k, v, segments)``, ``segments`` (batch, seq) the index of each
token's document in its sample; a query then attends only to earlier keys
of its own document (causal AND same segment). Without document masking
the core is called with q, k, v alone, so a core that does not support it
works as before.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def document_mask(q_segments: torch.Tensor, k_segments: torch.Tensor) -> torch.Tensor:
    """(batch, 1, tq, tk) boolean, True where query i and key j are in the same
    document (``q_segments`` (batch, tq), ``k_segments`` (batch, tk))."""
    return (q_segments[:, :, None] == k_segments[:, None, :]).unsqueeze(1)


class SdpaAttention(nn.Module):
    """Causal softmax attention via torch's scaled_dot_product_attention;
    grouped-query attention when k/v have fewer heads than q. With
    ``segments``, the causal mask AND the same-document mask (every query
    sees at least itself, so no row is empty)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if segments is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
        mask = document_mask(segments, segments) & causal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
