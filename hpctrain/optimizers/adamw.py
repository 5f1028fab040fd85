"""AdamW (torch's, ``foreach``) with decoupled decay on matrices only.

Which tensors decay is decided from the logical shape (the ShardSpec's), so a
flat ZeRO shard of a matrix still decays and a norm's shard does not; ZeRO's
per-shard AdamW uses the same ``param_groups``."""
from __future__ import annotations

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
