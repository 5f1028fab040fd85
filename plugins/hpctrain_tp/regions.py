"""Where the tensor-parallel region starts and ends, with and without
sequence parallelism.

A tensor-parallel sub-layer (attention or the feed-forward block) takes the
residual stream in, runs column-parallel projections on this rank's heads or
columns and a row-parallel projection back to the hidden size, whose
outputs are partial sums over tp. ``Regions`` names the two boundaries:

- without sequence parallelism the stream is whole on every rank: ``enter``
  is ``copy_to_region`` (fwd identity, bwd all-reduce) and ``exit`` is
  ``reduce_from_region`` (fwd all-reduce, bwd identity);
- with it, the stream between sub-layers holds 1/tp of the sequence (dim 1)
  on each rank: ``enter`` all-gathers the sequence (bwd reduce-scatter) and
  ``exit`` reduce-scatters it (bwd all-gather). Same bytes on the wire as one
  all-reduce, and the norms and residual adds work on 1/tp of the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.comm.differentiable import (
    copy_to_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
)

SEQUENCE_DIM = 1
"""Activations are (batch, sequence, hidden)."""


@dataclass(frozen=True)
class Regions:
    group: Any
    """The tp group."""
    sequence_parallel: bool

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Before column-parallel projections: every rank needs the whole sequence."""
        if self.sequence_parallel:
            return gather_from_sequence_region(x, self.group, SEQUENCE_DIM)
        return copy_to_region(x, self.group)

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        """After a row-parallel projection (partial sums over tp): sum them,
        leaving this rank's sequence shard under sequence parallelism."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(y, self.group, SEQUENCE_DIM)
        return reduce_from_region(y, self.group)
