"""The learning-rate schedule: linear warmup, then cosine down to a floor.
Every optimizer follows it (the trainer sets each step's rate with ``set_lr``);
the optimizers themselves are in ``hpctrain.optimizers``."""
from __future__ import annotations

import math
from typing import Any

import torch


def lr_at(step: int, optim: Any, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup to
    ``lr`` over ``warmup_steps``, then cosine down to ``lr * min_lr_ratio``."""
    peak, floor = optim.lr, optim.lr * optim.min_lr_ratio
    warm = optim.warmup_steps
    if warm > 0 and step < warm:
        return peak * (step + 1) / warm
    span = max(1, total_steps - warm)
    progress = min(1.0, (step - warm) / span)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
