"""The device mesh: named axes ``tp cp ep dp pp`` and one ``Group`` per axis.

A rank's coordinate on each axis follows the rank-order string, fastest
varying axis first. With the default ``tp-cp-ep-dp-pp`` consecutive ranks form
a TP group, so TP stays inside a node, and PP varies slowest.

The mesh only computes rank sets. The communicator that serves a group is
attached afterwards by a backend plugin (``hpctrain_make_backend``), because
creating process groups is itself a collective operation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from hpctrain.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.comm.protocol import Communicator

AXES: Tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


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
            raise ConfigError(f"parallel.{a}={out[a]} is invalid: use a positive size" + (" or -1 (the rest)" if a == "dp" else ""))
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
    """One group of ranks along one or more mesh axes, as seen from this rank.

    ``ranks`` are world ranks in group-rank order; ``partition`` holds every
    group of the same axes (all ranks of the world, each exactly once), which
    backends need because creating a torch process group is collective.
    """

    name: str
    ranks: Tuple[int, ...]
    rank: int
    partition: Tuple[Tuple[int, ...], ...]
    comm: Optional["Communicator"] = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def communicator(self) -> "Communicator":
        if self.comm is None:
            raise RuntimeError(f"group {self.name!r} has no communicator yet (backends are attached by Mesh.attach_backends)")
        return self.comm


class Mesh:
    """Named-axis layout of the world.

    ``coords[axis]`` is this rank's index on that axis; ``group(axis)`` its
    Group; ``group(("ep", "dp"))`` a group spanning several axes (for example
    the gradient group of dense layers in an MoE model).
    """

    def __init__(self, sizes: Mapping[str, int], world_rank: int, world_size: int, order: str = DEFAULT_ORDER):
        self.order: Tuple[str, ...] = parse_order(order)
        self.sizes: Dict[str, int] = resolve_sizes(sizes, world_size, order)
        self.world_size = world_size
        self.world_rank = world_rank
        stride = 1
        self.strides: Dict[str, int] = {}
        for a in self.order:
            self.strides[a] = stride
            stride *= self.sizes[a]
        self.coords: Dict[str, int] = self.coords_of(world_rank)
        self._groups: Dict[Tuple[str, ...], Group] = {}
        self._backend_factory: Optional[Callable[[Group], "Communicator"]] = None
        for a in AXES:
            self.group(a)

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

    # -- groups ----------------------------------------------------------
    def _key(self, axes: "str | Iterable[str]") -> Tuple[str, ...]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            if a not in AXES:
                raise ValueError(f"unknown mesh axis {a!r}; axes are {AXES}")
        # canonical order: the mesh's rank order, so ("dp","ep") == ("ep","dp")
        return tuple(a for a in self.order if a in axes)

    def group_ranks(self, axes: "str | Iterable[str]", rank: Optional[int] = None) -> Tuple[int, ...]:
        """World ranks of the group along ``axes`` that contains ``rank``."""
        key = self._key(axes)
        coords = self.coords_of(self.world_rank if rank is None else rank)
        members = [coords]
        for a in key:  # fastest axis first, so group rank order follows world order
            members = [dict(c, **{a: i}) for i in range(self.sizes[a]) for c in members]
        return tuple(sorted(self.rank_of(c) for c in members))

    def partition(self, axes: "str | Iterable[str]") -> Tuple[Tuple[int, ...], ...]:
        key = self._key(axes)
        seen, parts = set(), []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group_ranks(key, r)
                seen.update(g)
                parts.append(g)
        return tuple(parts)

    def group(self, axes: "str | Iterable[str]") -> Group:
        key = self._key(axes)
        if key not in self._groups:
            ranks = self.group_ranks(key)
            self._groups[key] = Group(
                name="+".join(key) if key else "self",
                ranks=ranks,
                rank=ranks.index(self.world_rank),
                partition=self.partition(key),
            )
            if self._backend_factory is not None:
                self._groups[key].comm = self._backend_factory(self._groups[key])
        return self._groups[key]

    def attach_backends(self, factory: Callable[[Group], "Communicator"]) -> None:
        """Give every group its communicator, now and for groups created later.

        Creating a communicator may be collective over the world, so every
        rank must create the same groups in the same order: the single-axis
        groups here, multi-axis ones at the same point of the same code.
        """
        self._backend_factory = factory
        for key in sorted(self._groups, key=lambda k: (len(k), k)):
            self._groups[key].comm = factory(self._groups[key])

    @property
    def groups(self) -> Dict[Tuple[str, ...], Group]:
        return dict(self._groups)

    def describe(self) -> str:
        return " * ".join(f"{a}={self.sizes[a]}" for a in self.order) + f" (order {'-'.join(self.order)})"
