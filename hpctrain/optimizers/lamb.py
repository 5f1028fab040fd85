"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"):
Adam's direction, scaled per tensor by the trust ratio ||w|| / ||r||.

Per tensor, with bias-corrected moments m, v and decoupled decay wd:

    r = m / (sqrt(v) + eps) + wd * w
    w <- w - lr * phi * r,   phi = ||w|| / ||r||  (1 when either norm is 0)

The norms are of the logical tensor (``norms.TensorNorms``: each element
once, over exactly the axes that split it), so every layout takes the step
one process takes. Tensors of a kind in ``optim.exclude_from_adaptation``
(norms, biases, the embedding by default) keep phi = 1. Weight decay follows
AdamW's rule (matrices and embeddings). State per tensor, shaped like it:
``exp_avg``, ``exp_avg_sq`` and ``step`` (a 0-d tensor), as torch's AdamW.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch

from hpctrain.optimizers.norms import TrustRatioOptimizer


class Lamb(TrustRatioOptimizer):
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("LAMB takes no closure")
        b1, b2, eps = float(self.cfg.beta1), float(self.cfg.beta2), float(self.cfg.eps)
        work: List[Any] = [None] * len(self.specs)
        values: List[Optional[List[torch.Tensor]]] = [None] * len(self.specs)
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                n = float(st["step"])
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** n)).sqrt_().add_(eps)
                r = (st["exp_avg"] / (1 - b1 ** n)).div_(denom)
                if wd:
                    r.add_(p, alpha=wd)
                slot = self.slot[id(p)]
                work[slot] = (p, r, group["lr"])
                values[slot] = [p, r]
        squares = self.norms.squares(values, 2, self.device).tolist()
        for slot, item in enumerate(work):
            if item is None:
                continue
            p, r, lr = item
            w2, r2 = squares[slot]
            phi = math.sqrt(w2) / math.sqrt(r2) if self.adapt[slot] and w2 > 0 and r2 > 0 else 1.0
            p.add_(r, alpha=-lr * phi)
