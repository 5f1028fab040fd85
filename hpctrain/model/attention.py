"""Core attention: the one function every attention layer calls.

``Attention.core`` is a module with ``forward(q, k, v) -> out`` on tensors of
shape (batch, heads, seq, head_dim), causal. Context parallelism replaces it
(ring attention) through ``hpctrain_make_module("attention", name, ...)``
without touching the projections around it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SdpaAttention(nn.Module):
    """Causal softmax attention via torch's scaled_dot_product_attention;
    grouped-query attention when k/v have fewer heads than q."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
