"""All-gather context parallelism (Llama 3's): every layer all-gathers the
keys and values over the cp ranks, and each rank attends with its own
queries; the key/value gradients are reduce-scattered back.

The gathered keys are in cp-rank order, each rank's chunks in its layout
(zigzag), so the causal mask is built from true positions: a query at
position p sees the keys at positions <= p.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.comm.differentiable import gather_from_sequence_region


class AllGatherAttention(nn.Module):
    """Core attention (``forward(q, k, v)``, (batch, heads, tokens, head_dim),
    causal) for a rank holding the tokens at ``positions`` of the sequence
    split over ``group``; ``all_positions`` are every rank's, in rank order."""

    def __init__(self, group: Any, positions: torch.Tensor, all_positions: torch.Tensor):
        super().__init__()
        self.group = group
        # True where attention is allowed: key position <= query position
        self.register_buffer("allowed", all_positions[None, :] <= positions[:, None], persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all = gather_from_sequence_region(k.contiguous(), self.group, dim=2)  # bwd: reduce-scatter dK
        v_all = gather_from_sequence_region(v.contiguous(), self.group, dim=2)
        mask = self.allowed.to(q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
