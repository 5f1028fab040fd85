"""Where the tensor-parallel region starts and ends, with and without
sequence parallelism.

A tensor-parallel sub-layer (attention or the feed-forward block) takes the
residual stream in, runs column-parallel projections on this rank's heads or
columns and a row-parallel projection back to the hidden size, whose
outputs are partial sums over tp. ``TensorParallelRegions`` names the two boundaries:

- without sequence parallelism the stream is whole on every rank:
  ``columns`` enters through ``copy_to_region`` (fwd identity, bwd
  all-reduce) and ``exit`` is ``reduce_from_region`` (fwd all-reduce, bwd
  identity);
- with it, the stream between sub-layers holds 1/tp of the sequence (dim 1)
  on each rank: ``columns`` all-gathers the sequence (bwd: gathers it again,
  then reduce-scatters the input gradient; ``columns.py``) and ``exit``
  reduce-scatters it (bwd all-gather). The norms and residual adds work on
  1/tp of the tokens and only shards are kept for backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch
import torch.nn.functional as F

from hpctrain.comm.differentiable import (
    copy_to_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
)
from hpctrain.mesh import Group

from hpctrain_tp.columns import SEQUENCE_DIM, sequence_parallel_columns


@dataclass(frozen=True)
class TensorParallelRegions:
    group: Group
    """The tp group."""
    sequence_parallel: bool

    def columns(self, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Column-parallel projections of the sub-layer input ``x`` by each of
        ``weights`` (this rank's rows), entering the region once."""
        if self.sequence_parallel:
            return sequence_parallel_columns(x, self.group, weights)
        x = copy_to_region(x, self.group)
        return [F.linear(x, w) for w in weights]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as every rank's column-parallel computation reads it (a narrow tensor, such as latent
        attention's latents, that is not worth keeping only as a shard): the whole sequence, gathered under
        sequence parallelism (bwd reduce-scatter), entered with ``copy_to_region`` (bwd all-reduce) without."""
        if self.sequence_parallel:
            return gather_from_sequence_region(x, self.group, SEQUENCE_DIM)
        return copy_to_region(x, self.group)

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        """After a row-parallel projection (partial sums over tp): sum them,
        leaving this rank's sequence shard under sequence parallelism."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(y, self.group, SEQUENCE_DIM)
        return reduce_from_region(y, self.group)
