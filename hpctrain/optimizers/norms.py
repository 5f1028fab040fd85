"""Per-tensor norms of logical tensors whose pieces several ranks hold.

``TensorNorms`` is made once over the ordered list of every tensor's
ShardSpec on this rank's pipeline stage (the same list, in the same order,
on every rank of the stage: a ZeRO rank lists the shards it holds no element
of too). ``squares`` takes, per tensor, a few local tensors shaped like the
rank's piece of it (the weight, its update, its gradient) and returns each
logical tensor's squared norms:

- each rank adds the squares of the logical elements it holds
  (``ShardSpec.pieces``: padding left out), each divided by the number of
  ranks *on the axes that split the tensor* holding the same element (a
  key/value head replicated over tp, a hierarchical ZeRO range replicated
  over nodes), so a replica counts once;
- the sums are then all-reduced over exactly the axes each tensor is split
  on, one axis at a time (a sum over tp x dp is a sum over tp of sums over
  dp): one all-reduce per axis of size > 1, carrying the tensors split on
  that axis only. A tensor replicated on an axis (a norm weight over tp,
  every tensor over plain data parallelism) is not reduced over it: each
  replica computes the same norm from the same elements.

The single-axis groups are the mesh's standard ones (created up front).
Pipeline stages never split a tensor (``held_on``), so ``pp`` is never
reduced over; tied embeddings on two stages each compute the same norm.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.mesh import Mesh
from hpctrain.optimizers.base import ShardedOptimizer
from hpctrain.optimizers.kinds import adapted
from hpctrain.shard import Piece, ShardSpec


class TensorNorms:
    """Squared norms of logical tensors (module docstring); collective in ``squares``."""

    def __init__(self, specs: Sequence[ShardSpec], mesh: Mesh):
        self.specs = list(specs)
        self.mesh = mesh
        coords, sizes = mesh.coords, mesh.sizes
        self.pieces: List[List[Piece]] = [s.pieces(coords, sizes) for s in self.specs]
        # ranks of the splitting axes holding the same element: the world's replicas over the others'
        self.replicas: List[List[int]] = [[pc.replicas // s.replicas_off_split(sizes) for pc in pieces]
                                          for s, pieces in zip(self.specs, self.pieces)]
        self.axes: Dict[str, torch.Tensor] = {}
        for axis in mesh.order:
            if axis == "pp" or sizes[axis] == 1:
                continue
            slots = [i for i, s in enumerate(self.specs) if axis in s.split_axes]
            if slots:
                self.axes[axis] = torch.tensor(slots, dtype=torch.long)
                mesh.group(axis)  # standard group; named here so it exists before the mesh is sealed

    def local(self, values: Sequence[Optional[Sequence[torch.Tensor]]], k: int,
              device: torch.device) -> torch.Tensor:
        """This rank's (len(specs), k) float64 share of the squared norms, on ``device``."""
        out = torch.zeros(len(self.specs), k, dtype=torch.float64, device=device)
        for i, tensors in enumerate(values):
            if tensors is None:
                continue
            for j, t in enumerate(tensors):
                total = torch.zeros((), dtype=torch.float64, device=t.device)
                for piece, rep in zip(self.pieces[i], self.replicas[i]):
                    part = piece.take(t.detach()).double().pow(2).sum()
                    total = total + (part / rep if rep > 1 else part)
                out[i, j] = total
        return out

    def squares(self, values: Sequence[Optional[Sequence[torch.Tensor]]], k: int,
                device: torch.device) -> torch.Tensor:
        """Squared norms (len(specs), k), float64: ``values[i]`` holds ``k``
        local tensors of tensor ``i``, or None where this rank holds none of it;
        ``device``: where the collectives run (the model's device)."""
        sums = self.local(values, k, device)
        for axis, slots in self.axes.items():
            idx = slots.to(sums.device)
            part = sums.index_select(0, idx).contiguous()
            self.mesh.group(axis).communicator().all_reduce(part, ReduceOp.SUM)
            sums.index_copy_(0, idx, part)
        return sums


class TrustRatioOptimizer(ShardedOptimizer):
    """The base of LAMB and LARS: the logical tensors' norms (``TensorNorms``) and, per tensor, whether its
    kind takes a trust ratio (``optim.exclude_from_adaptation``)."""

    def __init__(self, tensors: Sequence[torch.nn.Parameter], optim: Any, mesh: Mesh,
                 specs: Optional[Sequence[ShardSpec]] = None):
        super().__init__(tensors, optim, mesh, specs)
        self.norms = TensorNorms(self.specs, mesh)
        self.adapt = [adapted(s, optim.exclude_from_adaptation) for s in self.specs]
