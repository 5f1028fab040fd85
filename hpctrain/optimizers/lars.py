"""LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"):
SGD with momentum whose step per tensor is scaled by a local learning rate.

Per tensor, with decay wd and trust coefficient eta (``optim.trust_coefficient``):

    d = g + wd * w
    phi = eta * ||w|| / (||g|| + wd * ||w|| + eps)   (1 when either norm is 0)
    buf <- momentum * buf + lr * phi * d;   w <- w - buf

The norms are of the logical tensor (``norms.TensorNorms``), so every layout
takes the step one process takes. Tensors of a kind in
``optim.exclude_from_adaptation`` keep phi = 1 (plain momentum SGD). Decay
follows AdamW's rule (matrices and embeddings). State per tensor, shaped
like it: ``momentum_buffer``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch

from hpctrain.optimizers.norms import TrustRatioOptimizer


class Lars(TrustRatioOptimizer):
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("LARS takes no closure")
        eta, mu, eps = float(self.cfg.trust_coefficient), float(self.cfg.momentum), float(self.cfg.eps)
        work: List[Any] = [None] * len(self.specs)
        values: List[Optional[List[torch.Tensor]]] = [None] * len(self.specs)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    slot = self.slot[id(p)]
                    work[slot] = (p, group)
                    values[slot] = [p, p.grad]
        squares = self.norms.squares(values, 2, self.device).tolist()
        for slot, item in enumerate(work):
            if item is None:
                continue
            p, group = item
            wd, lr = group["weight_decay"], group["lr"]
            w, g = math.sqrt(squares[slot][0]), math.sqrt(squares[slot][1])
            phi = eta * w / (g + wd * w + eps) if self.adapt[slot] and w > 0 and g > 0 else 1.0
            d = p.grad.add(p, alpha=wd) if wd else p.grad.clone()
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = st["momentum_buffer"]
            buf.mul_(mu).add_(d, alpha=lr * phi)
            p.sub_(buf)
