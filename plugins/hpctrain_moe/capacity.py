"""Expert capacity: which assignments an expert with a capacity keeps.

Priority (documented in ``MoEConfig.capacity_factor``): every token's first
choice comes before any token's second choice, and within one choice rank,
earlier tokens (sample, then position in the micro-batch) come first; an
expert keeps its first ``capacity`` assignments in that order.
"""
from __future__ import annotations

import math

import torch


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """ceil(factor * tokens * top_k / num_experts): assignments one expert takes from a micro-batch."""
    return math.ceil(factor * tokens * top_k / num_experts)


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(N, k) bool: whether each assignment of ``experts`` (N, k) fits its expert's capacity."""
    n, k = experts.shape
    flat = experts.t().reshape(-1)  # choice-major, token order within a choice: the priority order
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (slot < capacity).view(k, n).t()
