"""How tensor parallelism changes the model's sub-layers: it cuts their
weights and fills the core model's seams, never replacing a block's forward
(so recomputation, MoE and context parallelism work under it unchanged).

The one-process ``nn.Linear`` children are narrowed on the meta device,
their ShardSpecs recording the split, so parameter names stay the
one-process names and checkpoints hold logical tensors:

- attention: ``wq`` column-parallel by whole heads; ``wk``/``wv`` too, or,
  when tp > n_kv_heads, each rank holds the one key/value head its query
  heads use (a replicated piece, ``tp / n_kv_heads`` ranks per head, whose
  gradient those ranks sum); ``wo`` row-parallel. Biases on q/k/v
  (``model.qkv_bias``) are cut and replicated with their weights' rows;
  qk-norm weights (size head_dim, ``model.qk_norm``) are whole on every
  rank, and since each rank normalises its own heads, their gradient is
  summed over tp through the norm's weight seam (``SumOverTensorParallel``),
  with or without sequence parallelism;
- SwiGLU: ``w1`` (gate) and ``w3`` (up) column-parallel, ``w2`` row-parallel;
- LoRA adapters (``hpctrain.finetune.adapter``) with their base: a column-parallel
  projection's B cut by rows (replicated with them), its A whole with the
  gradient summed over tp; a row-parallel projection's A cut by columns, its
  B whole with the gradient summed over tp;
- the projections' seam (``Linears``) becomes ``TensorParallelLinears``:
  enter the region for the column-parallel projections, leave it after the
  row-parallel one (``regions``);
- RMSNorm under sequence parallelism: each rank normalises its own tokens,
  so the weight's gradient is a partial sum over tp; the norm's weight seam
  routes it through ``copy_to_region`` (bwd all-reduce over tp).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.comm.differentiable import copy_to_region
from hpctrain.finetune.adapter import adapter_of
from hpctrain.mesh import Group, Mesh
from hpctrain.model.build import narrow_param
from hpctrain.model.transformer import Linears
from hpctrain.shard import get_spec

from hpctrain_tp.regions import TensorParallelRegions


def column_parallel(linear: nn.Linear, mesh: Mesh, unit: int = 1, pieces: Optional[int] = None) -> None:
    """Output features (weight dim 0, and the bias with them) cut over tp in whole ``unit``s (a head's rows);
    a LoRA adapter's B (out x r) with them, its A whole."""
    narrow_param(linear, "weight", get_spec(linear.weight).split(0, "tp", pieces=pieces, unit=unit), mesh)
    if linear.bias is not None:
        narrow_param(linear, "bias", get_spec(linear.bias).split(0, "tp", pieces=pieces, unit=unit), mesh)
    adapter = adapter_of(linear)
    if adapter is not None:
        narrow_param(adapter, "B", get_spec(adapter.B).split(0, "tp", pieces=pieces, unit=unit), mesh)


def row_parallel(linear: nn.Linear, mesh: Mesh, unit: int = 1) -> None:
    """Input features (weight dim 1) cut over tp; a LoRA adapter's A (r x in) with them, its B whole."""
    narrow_param(linear, "weight", get_spec(linear.weight).split(1, "tp", unit=unit), mesh)
    adapter = adapter_of(linear)
    if adapter is not None:
        narrow_param(adapter, "A", get_spec(adapter.A).split(1, "tp", unit=unit), mesh)


class TensorParallelLinears(Linears):
    """Column-parallel projections in, a row-parallel projection out.

    ``replicated``: the indices of ``columns``' weights that several tp ranks
    hold whole (a key/value head shared by their query heads) and the group
    of those ranks, which sum the weight's gradient."""

    def __init__(self, regions: TensorParallelRegions, replicated: Sequence[int] = (),
                 replicas: Optional[Group] = None):
        self.regions = regions
        self.replicated = tuple(replicated) if replicas is not None else ()
        self.replicas = replicas

    def columns(self, x: torch.Tensor, linears: Sequence[nn.Linear]) -> List[torch.Tensor]:
        replicas = self.replicas

        def view(i: int, t: torch.Tensor) -> torch.Tensor:
            return copy_to_region(t, replicas) if replicas is not None and i in self.replicated else t

        weights = [view(i, m.weight) for i, m in enumerate(linears)]
        adapters = []  # (a loop: dynamo cannot trace a walrus inside a comprehension, a graph break per block)
        for i, m in enumerate(linears):
            a = adapter_of(m)
            if a is not None:
                adapters.append((i, a))
        # LoRA's A is whole on every rank, each rank's B rows giving it a partial gradient: summed over tp
        downs = [copy_to_region(a.A, self.regions.group) for _, a in adapters]
        dropped = any(not isinstance(a.dropout, nn.Identity) for _, a in adapters)
        outs = self.regions.columns(x, weights + ([] if dropped else downs))
        hidden = (outs[len(linears):] if not dropped else  # (dropout: a mask per adapter, as one process)
                  [self.regions.columns(a.dropout(x), [d])[0] for (_, a), d in zip(adapters, downs)])
        outs = outs[:len(linears)]
        for (i, a), h in zip(adapters, hidden):
            outs[i] = outs[i] + a.up(h, view(i, a.B))  # B cut with the base's rows (and replicated with them)
        # a bias (q/k/v, model.qkv_bias) is cut with its weight's rows and added to this rank's columns, whose
        # tokens are the whole sequence under sequence parallelism too: its gradient is this rank's whole one
        return [y if m.bias is None else y + view(i, m.bias) for i, (y, m) in enumerate(zip(outs, linears))]

    def rows(self, y: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        out = F.linear(y, linear.weight)
        adapter = adapter_of(linear)
        if adapter is not None:  # A cut with the base's columns: B A_r y_r is a partial sum, as W_r y_r is;
            # B is whole on every rank with a partial gradient each: summed over tp
            out = out + adapter.up(adapter.down(y), copy_to_region(adapter.B, self.regions.group))
        return self.regions.exit(out)


class SumOverTensorParallel:
    """The sequence-parallel norm's weight seam: identity forward, gradient summed over tp."""

    def __init__(self, group: Group):
        self.group = group

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return copy_to_region(weight, self.group)
