"""A LoRA adapter and how a projection applies it (``hpctrain.finetune.lora`` puts them on a model).

An adapted projection ``W`` computes ``W x + (alpha / r) * B A dropout(x)``, A (r x in), B (out x r), as PEFT's
``lora.Linear``. The adapter is a child of the projection (``<projection>.lora``: ``layers.0.attn.wq.lora.A``);
the model's projection seam (``Linears``) adds its term: ``adapted`` in one process, tensor parallelism's seam
with ``down``/``up`` and its own views of A and B.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER = "lora"
"""The adapter's attribute on its projection (and the part of its parameters' names)."""


class LoraAdapter(nn.Module):
    """The low-rank update of one projection: ``scaling * B A dropout(x)``."""

    param_init = {"A": "kaiming_uniform", "B": "zeros"}

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def down(self, x: torch.Tensor, a: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``A dropout(x)``; ``a``: A as forward uses it (tensor parallelism's view), default A."""
        return F.linear(self.dropout(x), self.A if a is None else a)

    def up(self, h: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``scaling * B h``; ``b``: B as forward uses it, default B."""
        return F.linear(h, self.B if b is None else b) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def adapter_of(linear: nn.Module) -> Optional[LoraAdapter]:
    """The projection's adapter, or None."""
    found = getattr(linear, ADAPTER, None)
    return found if isinstance(found, LoraAdapter) else None


def adapted(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The projection of ``x`` with its adapter's update, if it has one (the one-process seam)."""
    adapter = adapter_of(linear)
    return linear(x) if adapter is None else linear(x) + adapter(x)


def is_adapter_name(logical_name: str) -> bool:
    """Whether a logical tensor name is an adapter's (``...wq.lora.A``)."""
    return f".{ADAPTER}." in logical_name
