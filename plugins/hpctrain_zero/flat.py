"""A flat group: one unit's parameters (those reduced over one group) laid
out end to end in one flat buffer, padded to a multiple of the shard group
size; rank r of the group holds elements ``[r * chunk, (r + 1) * chunk)``.

The layout is what the gradient-sync engine reduce-scatters (the group is
one of its buckets), what stage 3 all-gathers, and what each parameter's
flat ShardSpec (``ShardSpec.flat_split(axes, offset, total)``) describes to
materialisation, the gradient norm and the checkpoint. A parameter's local
numel is its numel before the flat split (after any tensor-parallel split).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from hpctrain.mesh import Group
from hpctrain.shard import ShardSpec, get_spec


class FlatGroup:
    """``group``: the ranks the chunks are cut over. ``replicas``: with
    hierarchical sharding, the ranks holding the same chunk on the other
    nodes (``group`` is then the node-local part of the data group)."""

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], group: Group,
                 numels: Sequence[int] = (), replicas: Optional[Group] = None):
        self.name = name
        self.params = list(params)
        self.group = group
        self.replicas = replicas
        self.specs: List[ShardSpec] = [get_spec(p) for p in self.params]
        self.numels = list(numels) or [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        size = group.size
        self.total = -(-self.numel // size) * size
        self.chunk = self.total // size
        self.lo, self.hi = group.rank * self.chunk, (group.rank + 1) * self.chunk

    @property
    def axes(self) -> Tuple[str, ...]:
        """The group's mesh axes, outermost first (a flat split's convention:
        its range index is then the group rank)."""
        return tuple(reversed(self.group.axes))

    def held(self, i: int) -> Tuple[int, int]:
        """Parameter ``i``'s elements this rank holds, relative to its start: [a, b) (a == b: none)."""
        start = self.offsets[i]
        a, b = max(self.lo, start), min(self.hi, start + self.numels[i])
        return (a - start, b - start) if a < b else (0, 0)

    def shard_slice(self, i: int) -> slice:
        """Where parameter ``i``'s held elements sit in this rank's chunk."""
        a, b = self.held(i)
        start = self.offsets[i] + a - self.lo
        return slice(start, start + (b - a))

    def flat_spec(self, i: int) -> ShardSpec:
        """Parameter ``i``'s ShardSpec once it is held as this flat shard (with
        replicas: the chunks cut over runs of ``group.size`` ranks of the axes)."""
        pieces = self.group.size if self.replicas is not None and self.replicas.size > 1 else None
        return self.specs[i].flat_split(self.axes, offset=self.offsets[i], total=self.total, pieces=pieces)

    def nbytes(self, element_size: int) -> int:
        return self.chunk * element_size

    def __repr__(self) -> str:
        return f"FlatGroup({self.name}, {len(self.params)} params, {self.numel} -> {self.total} over {self.group.name})"


def padded(numel: int, size: int) -> int:
    return -(-numel // size) * size

