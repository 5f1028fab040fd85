"""Column- and row-parallel versions of the model's sub-layers.

Each wraps the one-process module's own ``nn.Linear`` children (narrowed on
the meta device, their ShardSpecs recording the split), so parameter names
stay the one-process names and checkpoints hold logical tensors:

- attention: ``wq`` column-parallel by whole heads; ``wk``/``wv`` too, or,
  when tp > n_kv_heads, each rank holds the one key/value head its query
  heads use (a replicated piece, ``tp / n_kv_heads`` ranks per head);
  ``wo`` row-parallel;
- SwiGLU: ``w1`` (gate) and ``w3`` (up) column-parallel, ``w2`` row-parallel;
- RMSNorm under sequence parallelism: each rank normalises its own tokens,
  so the weight's gradient is a partial sum over tp; the weight enters the
  region through ``copy_to_region`` (bwd all-reduce over tp) to complete it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.comm.differentiable import copy_to_region
from hpctrain.model.build import narrow_param as narrow  # noqa: F401 (re-exported for the plugin)
from hpctrain.model.transformer import RMSNorm, apply_rope
from hpctrain.shard import get_spec

from hpctrain_tp.regions import Regions


def column_parallel(linear: nn.Linear, mesh: Any, unit: int = 1, pieces: Optional[int] = None) -> None:
    """Output features (weight dim 0) cut over tp in whole ``unit``s (a head's rows)."""
    narrow(linear, "weight", get_spec(linear.weight).split(0, "tp", pieces=pieces, unit=unit), mesh)


def row_parallel(linear: nn.Linear, mesh: Any, unit: int = 1) -> None:
    """Input features (weight dim 1) cut over tp."""
    narrow(linear, "weight", get_spec(linear.weight).split(1, "tp", unit=unit), mesh)


class ParallelAttention(nn.Module):
    """This rank's query heads and the key/value heads they use."""

    def __init__(self, attn: nn.Module, regions: Regions, kv_replicas: Optional[Any]):
        super().__init__()
        self.head_dim = attn.head_dim
        self.wq, self.wk, self.wv, self.wo, self.core = attn.wq, attn.wk, attn.wv, attn.wo, attn.core
        self.regions = regions
        self.kv_replicas = kv_replicas
        """Ranks holding the same key/value head (tp > n_kv_heads), else None."""

    def _kv_weight(self, linear: nn.Linear) -> torch.Tensor:
        # every replica computes its query heads' share of the head's gradient: sum them
        return copy_to_region(linear.weight, self.kv_replicas) if self.kv_replicas is not None else linear.weight

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.regions.columns(x, [self.wq.weight, self._kv_weight(self.wk), self._kv_weight(self.wv)])
        b, t = q.shape[:2]
        q = apply_rope(q.view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rope(k.view(b, t, -1, self.head_dim), cos, sin)
        v = v.view(b, t, -1, self.head_dim)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.regions.exit(self.wo(out.transpose(1, 2).reshape(b, t, -1)))


class ParallelSwiGLU(nn.Module):
    """This rank's columns of the SwiGLU hidden layer."""

    def __init__(self, ffn: nn.Module, regions: Regions):
        super().__init__()
        self.w1, self.w3, self.w2 = ffn.w1, ffn.w3, ffn.w2
        self.regions = regions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.regions.columns(x, [self.w1.weight, self.w3.weight])
        return self.regions.exit(self.w2(F.silu(gate) * up))


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm over this rank's tokens; the weight's gradient summed over tp."""

    def __init__(self, norm: RMSNorm, group: Any):
        nn.Module.__init__(self)
        self.eps = norm.eps
        self.weight = norm.weight
        self.group = group

    def scale(self) -> torch.Tensor:
        return copy_to_region(self.weight, self.group)
