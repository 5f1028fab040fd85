"""How the groups of one partition split into nodes (pure logic, no MPI).

For one group: its ranks on each node (``intra`` lists, world-rank order),
and for each local index ``l`` the ranks at position ``l`` on every node
(``inter`` lists, world-rank order). The two-level algorithms need every
node of a group to hold the same number ``L`` of its ranks ("even"); then
the ``inter`` lists have one rank per node and the group has ``N * L``
ranks.

The verdict is taken for the whole partition, not per group, because
creating sub-communicators is collective over the world: every rank must
make the same sub-groups in the same order, so every rank must reach the
same verdict. Modes:

- ``hier``: every group is even (and at least one spans several nodes with
  several ranks on a node): intra + inter sub-groups;
- ``one-node``: every group lies inside one node: the flat intra backend;
- ``one-per-node``: every group has one rank per node: the flat inter backend;
- ``uneven``: some group holds different numbers of ranks on its nodes.

Lists are in world-rank order so sub-group ranks agree with backends that
order a group by world rank (torch.distributed does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

Ranks = Tuple[int, ...]
Partition = Tuple[Ranks, ...]


@dataclass(frozen=True)
class NodeSplit:
    """One group seen through node membership."""

    ranks: Ranks
    """World ranks of the group, in group order."""
    intra: Partition
    """Per node (order of first appearance in the group): the group's ranks there, sorted."""
    inter: Partition
    """Per local index l (when even): the l-th rank of every node, sorted."""

    @property
    def even(self) -> bool:
        return len({len(on_node) for on_node in self.intra}) == 1

    @property
    def nodes(self) -> int:
        return len(self.intra)

    @property
    def per_node(self) -> Tuple[int, ...]:
        return tuple(len(on_node) for on_node in self.intra)

    def slots(self) -> Tuple[int, ...]:
        """For each group rank g, its slot ``local * N + k`` in the two-level layout:
        ``local`` its index on its node, ``k`` its index in its inter list."""
        where: Dict[int, int] = {}
        for local, across in enumerate(self.inter):
            for k, r in enumerate(across):
                where[r] = local * self.nodes + k
        return tuple(where[r] for r in self.ranks)

    def intra_of(self, rank: int) -> Ranks:
        return next(on_node for on_node in self.intra if rank in on_node)

    def inter_of(self, rank: int) -> Ranks:
        return next(across for across in self.inter if rank in across)


def split_by_node(ranks: Sequence[int], rank_nodes: Sequence[int]) -> NodeSplit:
    """``ranks`` (world ranks, group order) split by ``rank_nodes[r]``."""
    by_node: Dict[int, List[int]] = {}
    for r in ranks:
        by_node.setdefault(rank_nodes[r], []).append(r)
    intra = tuple(tuple(sorted(on_node)) for on_node in by_node.values())
    inter: Partition = ()
    if len({len(on_node) for on_node in intra}) == 1:
        inter = tuple(tuple(sorted(on_node[local] for on_node in intra)) for local in range(len(intra[0])))
    return NodeSplit(ranks=tuple(ranks), intra=intra, inter=inter)


@dataclass(frozen=True)
class PartitionPlan:
    """The verdict for all groups of one partition (identical on every rank)."""

    mode: str  # hier | one-node | one-per-node | uneven
    splits: Tuple[NodeSplit, ...]

    @property
    def intra_partition(self) -> Partition:
        return tuple(on_node for s in self.splits for on_node in s.intra)

    @property
    def inter_partition(self) -> Partition:
        return tuple(across for s in self.splits for across in s.inter)

    def split_of(self, ranks: Ranks) -> NodeSplit:
        return next(s for s in self.splits if s.ranks == tuple(ranks))

    def uneven_example(self) -> str:
        s = next(s for s in self.splits if not s.even)
        return f"ranks {list(s.ranks)} hold {list(s.per_node)} ranks on their {s.nodes} nodes"


def plan_partition(partition: Sequence[Sequence[int]], rank_nodes: Sequence[int]) -> PartitionPlan:
    splits = tuple(split_by_node(g, rank_nodes) for g in partition)
    if all(s.nodes == 1 for s in splits):
        mode = "one-node"
    elif not all(s.even for s in splits):
        mode = "uneven"
    elif all(s.per_node[0] == 1 for s in splits):
        mode = "one-per-node"
    else:
        mode = "hier"
    return PartitionPlan(mode=mode, splits=splits)
