"""Tensor parallelism of multi-head latent attention (``hpctrain.model.mla``): its heads split over tp.

- ``wq`` (no q_lora_rank) or ``wq_b``, and ``wkv_b``: column-parallel by whole heads (a head's
  qk_nope + qk_rope rows, its qk_nope + v rows); ``wo`` row-parallel by value heads;
- the down-projections ``wq_a``, ``wkv_a`` and the latent norms ``q_norm``, ``kv_norm``: whole on every rank.
  The latents (and the rotary key every head shares) enter the heads' region once (``regions.enter``): with
  sequence parallelism each rank projects only its sequence shard and the latents, narrower than the hidden
  states, are all-gathered, so these weights' gradients are partial sums over tp and are summed (through
  ``copy_to_region`` on the weights, and the norms' weight seam); without it every rank projects every token
  and the latents' gradient, all-reduced on the way out of the region, is already whole.

LoRA adapters (``finetune.lora.targets`` q_a, kv_a, q_b, kv_b, q, o) go with their base: a down-projection's
A and B whole on every rank like its weight (under sequence parallelism each rank adapts its own tokens and
their gradients are summed over tp; without it every rank computes the same update and gets the whole
gradient); an up-projection's (``up``) B cut with the heads' rows, A whole with its gradient summed over tp,
as for any column-parallel projection (``TensorParallelLinears``).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.comm.differentiable import copy_to_region
from hpctrain.finetune.adapter import adapter_of
from hpctrain.mesh import Mesh
from hpctrain.model.mla import LatentLinears, MLAttention

from hpctrain_tp.layers import SumOverTensorParallel, TensorParallelLinears, column_parallel, row_parallel
from hpctrain_tp.regions import TensorParallelRegions


class TensorParallelLatentLinears(TensorParallelLinears, LatentLinears):
    """Latent attention's seam under tp (``hpctrain.model.mla.LatentLinears``)."""

    def down(self, x: torch.Tensor, linears: Sequence[nn.Linear]) -> List[torch.Tensor]:
        group = self.regions.group

        def view(t: torch.Tensor) -> torch.Tensor:  # partial gradients (each rank's tokens) summed over tp
            return copy_to_region(t, group) if self.regions.sequence_parallel else t

        outs = []
        for m in linears:
            y = F.linear(x, view(m.weight))
            adapter = adapter_of(m)
            outs.append(y if adapter is None else y + adapter.up(adapter.down(x, view(adapter.A)), view(adapter.B)))
        return outs

    def enter(self, latent: torch.Tensor) -> torch.Tensor:
        return self.regions.enter(latent)

    def up(self, latent: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        y = F.linear(latent, linear.weight)  # this rank's heads' rows
        adapter = adapter_of(linear)
        if adapter is None:
            return y
        # A whole, each rank's B rows giving it a partial gradient: summed over tp
        return y + adapter.up(adapter.down(latent, copy_to_region(adapter.A, self.regions.group)))


def parallelize_latent_attention(attn: MLAttention, mesh: Mesh, regions: TensorParallelRegions) -> None:
    """Cut ``attn``'s heads over tp and fill its seam (see the module docstring)."""
    qk, v = attn.nope_dim + attn.rope_dim, attn.v_dim
    query = attn.wq if attn.wq is not None else attn.wq_b
    assert query is not None  # (one of the two is built)
    column_parallel(query, mesh, unit=qk)
    column_parallel(attn.wkv_b, mesh, unit=attn.nope_dim + v)
    row_parallel(attn.wo, mesh, unit=v)
    attn.linears = TensorParallelLatentLinears(regions)
    if regions.sequence_parallel:
        for norm in (attn.q_norm, attn.kv_norm):
            if norm is not None:
                norm.weight_view = SumOverTensorParallel(regions.group)
