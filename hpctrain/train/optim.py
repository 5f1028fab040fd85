"""The core optimizer: AdamW with decoupled decay on matrices only, and the
warmup + cosine learning-rate schedule. ZeRO plugins replace the optimizer
through ``hpctrain_make_optimizer``; the schedule stays the same."""
from __future__ import annotations

import math
from typing import Any, Iterable, List

import torch

from hpctrain.shard import SPEC_ATTR


def logical_dim(p: torch.Tensor) -> int:
    """Dims of the logical tensor ``p`` holds part of (its ShardSpec's), or its own."""
    spec = getattr(p, SPEC_ATTR, None)
    return len(spec.global_shape) if spec is not None else p.dim()


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> List[dict]:
    """Decay tensors of rank >= 2 (matrices, embeddings); not norms or biases.
    Decided from the logical shape, so a flat shard of a matrix still decays."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if logical_dim(p) >= 2]
    no_decay = [p for p in params if logical_dim(p) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(params: Iterable[torch.nn.Parameter], optim: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(params, optim.weight_decay),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        foreach=True,
    )


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
