"""Per-step expert statistics: load, drops, and the balance losses' values.

Each MoE layer adds one row per training micro-batch to its ``LayerStats``
(detached, on its device); after the optimizer step the plugin reduces
every layer's row over the world in one all-reduce (``reduce_rows``),
turns them into ``metrics.jsonl`` entries (``step_metrics``) and feeds the
loads to the sigmoid router's bias update. Rows are weighted so that each
token is counted once whatever the layout: tensor-parallel ranks without
sequence parallelism see the same tokens, so only tp rank 0 counts them.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

DROPPED, ASSIGNED, BALANCE, ZLOSS, INSTANCES = range(5)
EXTRA = 5
"""Columns after the E per-expert counts: dropped assignments, all assignments,
the balance statistic's sum, the z-loss's sum, and the micro-batches counted."""


class LayerStats:
    """One MoE layer's sums since the last reduction."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.row: Optional[torch.Tensor] = None  # (E + EXTRA,) float64, made on first use on the layer's device

    def add(self, counts: torch.Tensor, dropped: torch.Tensor, assigned: float, balance: torch.Tensor,
            z: torch.Tensor, count_weight: float, value_weight: float) -> None:
        """One micro-batch: per-expert ``counts`` and ``dropped`` assignments of
        this rank's tokens (times ``count_weight``), the group's ``balance``
        and ``z`` values (times ``value_weight``)."""
        if self.row is None:
            self.row = torch.zeros(self.num_experts + EXTRA, dtype=torch.float64, device=counts.device)
        e = self.num_experts
        self.row[:e] += count_weight * counts.detach().double()
        self.row[e + DROPPED] += count_weight * dropped.detach().double()
        self.row[e + ASSIGNED] += count_weight * assigned
        self.row[e + BALANCE] += value_weight * balance.detach().double()
        self.row[e + ZLOSS] += value_weight * z.detach().double()
        self.row[e + INSTANCES] += value_weight

    def take(self, device: torch.device) -> torch.Tensor:
        """The sums so far (zeros when none), and start over."""
        row = self.row if self.row is not None else torch.zeros(self.num_experts + EXTRA, dtype=torch.float64,
                                                               device=device)
        self.row = None
        return row


def step_metrics(rows: torch.Tensor, num_experts: int) -> Dict[str, float]:
    """``metrics.jsonl`` entries from the reduced rows (one per MoE layer of the model)."""
    e = num_experts
    counts = rows[:, :e]
    instances = float(rows[:, e + INSTANCES].sum())
    assigned = float(rows[:, e + ASSIGNED].sum())
    mean = float(counts.mean())
    peak = float(counts.max())
    return {
        "moe.aux_loss": float(rows[:, e + BALANCE].sum()) / max(instances, 1.0),
        "moe.z_loss": float(rows[:, e + ZLOSS].sum()) / max(instances, 1.0),
        "moe.tokens_per_expert_max": peak,
        "moe.tokens_per_expert_mean": mean,
        "moe.load_max_over_mean": peak / mean if mean > 0 else 0.0,
        "moe.dropped_fraction": float(rows[:, e + DROPPED].sum()) / assigned if assigned > 0 else 0.0,
    }


def loads(rows: torch.Tensor, num_experts: int) -> Sequence[torch.Tensor]:
    """Per layer, the step's assignments per expert (before drops)."""
    return [r[:num_experts] for r in rows]
