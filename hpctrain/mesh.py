"""The device mesh: named axes ``tp cp ep dp pp``, their groups, and the
data axes every parallel feature shares.

A rank's coordinate on each axis follows the rank-order string, fastest
varying axis first. With the default ``tp-cp-ep-dp-pp`` consecutive ranks form
a TP group, so TP stays inside a node, and PP varies slowest.

Data axes. Samples are split over ``dp x ep`` (expert ranks are
data-parallel for every dense layer) and the sequence over ``cp``; a
gradient is averaged over the data axes its parameter is not split on
(``reduction_axes``): dense weights over ``cp ep dp``, expert weights
(split on ``ep``) over ``cp dp``.

Groups. ``group(axes)`` is the group of ranks that differ only in ``axes``.
Axes of size 1 are dropped from the key, so groups with the same ranks are
one object with one communicator (``("cp", "ep", "dp")`` is the ``dp``
group when ``cp = ep = 1``). Besides the axis groups there are named
subgroups: ``pp_ends`` (the first and last pipeline stage of a pipeline,
for tied embeddings; middle stages are alone in theirs), ``<group>:node``
and ``<group>:across`` (the part of a group on this rank's node, and the
ranks at the same position on every node: hierarchical sharding), and
``replicas(axis, pieces)`` (ranks of an axis holding the same piece when it
is cut into fewer pieces than ranks).

Creating a group's communicator is collective over the world, so the mesh
defines every standard group when it is built and ``attach_backends``
creates them all at once, before the first training collective. A plugin
may define more during set-up (every rank runs the same set-up code);
after ``seal()`` (the trainer seals once the model, optimizer and
checkpointer exist) asking for a group that does not exist is an error
instead of a collective that some ranks might not enter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from hpctrain.comm.counting import CountingCommunicator
from hpctrain.comm.ops import group_key
from hpctrain.comm.watch import OpBoard
from hpctrain.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.comm.protocol import Communicator

AXES: Tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DATA_AXES: Tuple[str, ...] = ("cp", "ep", "dp")
"""Axes over which gradients are averaged (each rank sees different tokens)."""
SAMPLE_AXES: Tuple[str, ...] = ("ep", "dp")
"""Axes over which the samples of a global batch are split."""
SEQUENCE_AXIS = "cp"
"""The axis over which each sample's sequence is split."""


def parse_order(order: str) -> Tuple[str, ...]:
    """``"tp-cp-ep-dp-pp"`` -> ``("tp", "cp", "ep", "dp", "pp")``, checked."""
    axes = tuple(a.strip() for a in order.split("-") if a.strip())
    if sorted(axes) != sorted(AXES):
        raise ConfigError(
            f"parallel.order={order!r} must name each axis of {'-'.join(AXES)} exactly once "
            f"(e.g. parallel.order={DEFAULT_ORDER})"
        )
    return axes


def product_str(sizes: Mapping[str, int], order: Sequence[str]) -> str:
    return " * ".join(f"{a}({sizes[a]})" for a in order)


def resolve_sizes(sizes: Mapping[str, int], world_size: int, order: str = DEFAULT_ORDER) -> Dict[str, int]:
    """Fill in ``dp=-1`` and check the product equals the world size.

    Raises ConfigError with the whole product, e.g.
    ``tp(2) * cp(1) * ep(1) * dp(3) * pp(2) = 12 != world size 8``.
    """
    axes = parse_order(order)
    out = {a: int(sizes.get(a, 1)) for a in AXES}
    for a in AXES:
        if out[a] == 0 or out[a] < -1 or (out[a] == -1 and a != "dp"):
            or_rest = " or -1 (the rest)" if a == "dp" else ""
            raise ConfigError(f"parallel.{a}={out[a]} is invalid: use a positive size{or_rest}")
    if out["dp"] == -1:
        rest = math.prod(out[a] for a in AXES if a != "dp")
        if world_size % rest:
            shown = " * ".join(f"{a}({out[a]})" for a in axes if a != "dp")
            raise ConfigError(
                f"world size {world_size} is not divisible by {shown} = {rest}; "
                f"launch a multiple of {rest} ranks or change the layout"
            )
        out["dp"] = world_size // rest
    total = math.prod(out.values())
    if total != world_size:
        raise ConfigError(
            f"{product_str(out, axes)} = {total} != world size {world_size}; "
            f"launch {total} ranks or set parallel.dp=-1"
        )
    return out


@dataclass
class Group:
    """One group of ranks, as seen from this rank.

    ``ranks`` are world ranks in group-rank order (ascending world rank);
    ``partition`` holds every group of the same kind (all ranks of the
    world, each exactly once), which backends need because creating a
    communicator is collective over the world. ``axes`` are the mesh axes
    the group spans (its backend follows ``comm.per_axis`` of those).
    """

    name: str
    ranks: Tuple[int, ...]
    rank: int
    partition: Tuple[Tuple[int, ...], ...]
    axes: Tuple[str, ...] = ()
    comm: Optional["Communicator"] = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def communicator(self) -> "Communicator":
        if self.comm is None:
            raise RuntimeError(f"group {self.name!r} has no communicator yet "
                               "(backends are attached by Mesh.attach_backends)")
        return self.comm


class Mesh:
    """Named-axis layout of the world (see the module docstring)."""

    def __init__(self, sizes: Mapping[str, int], world_rank: int, world_size: int, order: str = DEFAULT_ORDER,
                 rank_nodes: Optional[Sequence[int]] = None, board: Optional[OpBoard] = None,
                 alone_axes: Sequence[str] = ()):
        self.order: Tuple[str, ...] = parse_order(order)
        self.sizes: Dict[str, int] = resolve_sizes(sizes, world_size, order)
        self.world_size = world_size
        self.world_rank = world_rank
        self.rank_nodes: Tuple[int, ...] = tuple(rank_nodes) if rank_nodes is not None else (0,) * world_size
        if len(self.rank_nodes) != world_size:
            raise ValueError(f"rank_nodes has {len(self.rank_nodes)} entries for a world of {world_size}")
        stride = 1
        self.strides: Dict[str, int] = {}
        for a in self.order:
            self.strides[a] = stride
            stride *= self.sizes[a]
        self.coords: Dict[str, int] = self.coords_of(world_rank)
        self._groups: Dict[str, Group] = {}            # by name (aliases included)
        self._by_partition: Dict[Tuple[Tuple[int, ...], ...], Group] = {}
        self._created: List[Group] = []                # distinct groups, in creation order
        self._offsets_of: Dict[Tuple[str, ...], Tuple[int, ...]] = {}  # group members less the first, by key
        self._backend_factory: Optional[Callable[[Group], "Communicator"]] = None
        self._sealed = False
        self.alone_axes: Tuple[str, ...] = tuple(alone_axes)
        """Data axes whose ranks are replicas training alone between outer steps (DiLoCo's dp,
        ``hpctrain.train.outer.alone_axes``): no gradient is averaged over them, and ranks that differ
        only there need not hold equal weights. Fixed when the mesh is built."""
        self.board = board if board is not None else OpBoard()
        """Numbered collectives and the current wait of this rank (``hpctrain.comm.watch``)."""
        for axes in self.standard_group_keys():
            self.group(axes)
        self.pp_ends()
        for data_axes in ("dp", DATA_AXES):
            self.node_local(data_axes)
            self.across_nodes(data_axes)

    # -- coordinates -----------------------------------------------------
    def coords_of(self, rank: int) -> Dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return {a: (rank // self.strides[a]) % self.sizes[a] for a in AXES}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        return sum(coords.get(a, 0) * self.strides[a] for a in AXES)

    def size(self, axis: str) -> int:
        return self.sizes[axis]

    def rank(self, axis: str) -> int:
        return self.coords[axis]

    # -- data axes ---------------------------------------------------------
    @property
    def sample_size(self) -> int:
        """Ranks that split the samples of a batch (dp x ep)."""
        return math.prod(self.sizes[a] for a in SAMPLE_AXES)

    @property
    def sample_rank(self) -> int:
        """This rank's index among ``sample_size`` (mesh order, fastest axis first)."""
        return self.index_on(SAMPLE_AXES)

    @property
    def data_size(self) -> int:
        """Ranks that see different tokens (cp x ep x dp)."""
        return math.prod(self.sizes[a] for a in DATA_AXES)

    @property
    def averaged_data_size(self) -> int:
        """Ranks a replicated weight's gradient is averaged over: the data axes less ``alone_axes``."""
        return math.prod(self.sizes[a] for a in self.reduction_axes(()))

    def index_on(self, axes: Iterable[str]) -> int:
        """This rank's index in the group spanning ``axes`` (its group rank)."""
        idx, scale = 0, 1
        for a in self.order:
            if a in tuple(axes):
                idx += self.coords[a] * scale
                scale *= self.sizes[a]
        return idx

    def reduction_axes(self, split_axes: Iterable[str]) -> Tuple[str, ...]:
        """Data axes a gradient is averaged over: those its parameter is not
        split on, of size > 1, in mesh order (not ``alone_axes``)."""
        split = set(split_axes) | set(self.alone_axes)
        return tuple(a for a in self.order if a in DATA_AXES and a not in split and self.sizes[a] > 1)

    # -- groups ----------------------------------------------------------
    def canonical(self, axes: "str | Iterable[str]") -> Tuple[str, ...]:
        """Axes of size > 1 among ``axes``, in the mesh's rank order."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            if a not in AXES:
                raise ValueError(f"unknown mesh axis {a!r}; axes are {AXES}")
        return tuple(a for a in self.order if a in axes and self.sizes[a] > 1)

    @staticmethod
    def standard_group_keys() -> Tuple[Tuple[str, ...], ...]:
        """Axis groups every run may use, created up front: each axis, the
        data axes (dense gradients), the sample axes, the data axes without
        ``ep`` (expert gradients) and the world (loss and gradient norm)."""
        return tuple((a,) for a in AXES) + (DATA_AXES, SAMPLE_AXES, ("cp", "dp"), AXES)

    def _offsets(self, key: Tuple[str, ...]) -> Tuple[int, ...]:
        """The members of the group along ``key`` (canonical) less its first rank, ascending."""
        found = self._offsets_of.get(key)
        if found is None:
            offsets = [0]
            for a in key:
                offsets = [o + i * self.strides[a] for i in range(self.sizes[a]) for o in offsets]
            found = self._offsets_of[key] = tuple(sorted(offsets))
        return found

    def group_ranks(self, axes: "str | Iterable[str]", rank: Optional[int] = None) -> Tuple[int, ...]:
        """World ranks of the group along ``axes`` that contains ``rank``."""
        key = self.canonical(axes)
        r = self.world_rank if rank is None else rank
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} outside world of size {self.world_size}")
        base = r - sum((r // self.strides[a]) % self.sizes[a] * self.strides[a] for a in key)
        return tuple(base + o for o in self._offsets(key))

    def partition(self, axes: "str | Iterable[str]") -> Tuple[Tuple[int, ...], ...]:
        """Every group along ``axes``, in the order of their first ranks (O(world size): a dry run
        builds the mesh of a whole job)."""
        key = self.canonical(axes)
        offsets = self._offsets(key)
        starts = [r for r in range(self.world_size)
                  if all((r // self.strides[a]) % self.sizes[a] == 0 for a in key)]
        return tuple(tuple(b + o for o in offsets) for b in starts)

    def _by_node(self, key: Tuple[str, ...]) -> List[List[List[int]]]:
        """Per group along ``key``: its ranks on each of its nodes (nodes in order of first rank)."""
        out = []
        for ranks in self.partition(key):
            nodes: Dict[int, List[int]] = {}
            for x in ranks:
                nodes.setdefault(self.rank_nodes[x], []).append(x)
            out.append(list(nodes.values()))
        return out

    @staticmethod
    def _ordered(groups: Iterable[Sequence[int]]) -> Tuple[Tuple[int, ...], ...]:
        """A partition as ``_partition`` orders it: each group ascending, groups by first rank."""
        return tuple(sorted((tuple(sorted(g)) for g in groups), key=lambda g: g[0]))

    def _partition(self, members_of: Callable[[int], Tuple[int, ...]]) -> Tuple[Tuple[int, ...], ...]:
        seen: Set[int] = set()
        parts = []
        for r in range(self.world_size):
            if r not in seen:
                g = tuple(sorted(members_of(r)))
                if r not in g or seen.intersection(g):
                    raise ValueError(f"group membership is not a partition of the world at rank {r}: {g}")
                seen.update(g)
                parts.append(g)
        return tuple(parts)

    def _define(self, name: str, axes: Tuple[str, ...], members_of: Optional[Callable[[int], Tuple[int, ...]]],
                parts: Optional[Callable[[], Tuple[Tuple[int, ...], ...]]] = None) -> Group:
        """The group called ``name`` (created if new; the same object as an
        existing group with the same partition), from each rank's members or
        from ``parts``, the whole partition at once."""
        if name in self._groups:
            return self._groups[name]
        if parts is not None:
            part = parts()
        else:
            assert members_of is not None  # (one of the two is given)
            part = self._partition(members_of)
        found = self._by_partition.get(part)
        if found is None:
            if self._sealed:
                raise RuntimeError(
                    f"group {name!r} was not created at set-up: every group must exist before training starts "
                    "(define it while building the model: in hpctrain_parallelize or its handle's after_materialize)")
            ranks = next(g for g in part if self.world_rank in g)
            found = Group(name=name, ranks=ranks, rank=ranks.index(self.world_rank), partition=part, axes=axes)
            self._by_partition[part] = found
            self._created.append(found)
            if self._backend_factory is not None:
                found.comm = self._backend_factory(found)
        self._groups[name] = found
        return found

    def group(self, axes: "str | Iterable[str]") -> Group:
        """The group of ranks that differ only on ``axes``."""
        key = self.canonical(axes)
        return self._define("+".join(key) if key else "self", key, None, lambda: self.partition(key))

    def pp_ends(self) -> Group:
        """The first and last stage of this rank's pipeline (tied embeddings).
        A middle stage is alone in its group; with pp = 1 every rank is."""
        last = self.sizes["pp"] - 1

        def members(r: int) -> Tuple[int, ...]:
            if self.coords_of(r)["pp"] not in (0, last):
                return (r,)
            return tuple(x for x in self.group_ranks("pp", r) if self.coords_of(x)["pp"] in (0, last))

        return self._define("pp_ends", ("pp",) if last > 0 else (), members)

    def node_local(self, axes: "str | Iterable[str]") -> Group:
        """The ranks of the group along ``axes`` that share this rank's node."""
        key = self.canonical(axes)
        return self._define(f"{'+'.join(key) or 'self'}:node", key, None,
                            lambda: self._ordered(on for group in self._by_node(key) for on in group))

    def across_nodes(self, axes: "str | Iterable[str]") -> Group:
        """The ranks of the group along ``axes`` at this rank's position on
        every node (its index among the group's ranks on its node)."""
        key = self.canonical(axes)

        def parts() -> Tuple[Tuple[int, ...], ...]:
            out = []
            for nodes in self._by_node(key):
                for position in range(max(len(on) for on in nodes)):
                    out.append([on[position] for on in nodes if position < len(on)])
            return self._ordered(out)

        return self._define(f"{'+'.join(key) or 'self'}:across", key, None, parts)

    def replicas(self, axis: str, pieces: int) -> Group:
        """Ranks of ``axis`` holding the same piece when the axis is cut into
        ``pieces`` (< its size) contiguous runs of ranks: ``coord // (size / pieces)``.
        For example the tp ranks sharing a key/value head when tp > n_kv_heads."""
        n = self.sizes[axis]
        if pieces < 1 or n % pieces:
            raise ValueError(f"cannot cut axis {axis} of size {n} into {pieces} equal runs of ranks")
        per = n // pieces

        def members(r: int) -> Tuple[int, ...]:
            mine = self.coords_of(r)[axis] // per
            return tuple(x for x in self.group_ranks(axis, r) if self.coords_of(x)[axis] // per == mine)

        return self._define(f"{axis}/{pieces}", (axis,) if per > 1 else (), members)

    def attach_backends(self, factory: Callable[[Group], "Communicator"]) -> None:
        """Give every group its communicator, now and for groups defined later.

        Creating a communicator may be collective over the world; every rank
        creates the same groups in the same order (their definition order).
        Groups of more than one rank get a ``CountingCommunicator`` around the
        backend's, so bytes on the wire are counted for every backend and
        every collective is numbered on ``self.board`` (the hang watchdog's
        view of this rank).
        """

        def counted(group: Group) -> "Communicator":
            comm = factory(group)
            group_key(group)  # registered for the collective operators (hpctrain.comm.ops) before any tracing
            return CountingCommunicator(comm, self.board, group.name, group.ranks) if group.size > 1 else comm

        self._backend_factory = counted
        for g in self._created:
            if g.comm is None:
                g.comm = counted(g)

    def seal(self) -> None:
        """No new groups from now on (see the module docstring)."""
        self._sealed = True

    @property
    def groups(self) -> Dict[str, Group]:
        """Every group by name (names of the same group included)."""
        return dict(self._groups)

    @property
    def distinct_groups(self) -> Tuple[Group, ...]:
        """Every group once, in creation order."""
        return tuple(self._created)

    def describe(self) -> str:
        return " * ".join(f"{a}={self.sizes[a]}" for a in self.order) + f" (order {'-'.join(self.order)})"
