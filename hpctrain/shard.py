"""ShardSpec: how a logical (one-process) tensor is laid out over the mesh.

Every parameter carries one (``param.hpctrain_spec``), set when the model is
built and updated by each plugin that splits it. ``logical_name`` is the
tensor's name in the one-process model; it stays stable when plugins rename
modules, so initialisation, checkpoints and gradient norms are keyed by it.

What a rank holds is described by, in order:

1. ``splits``: dimension splits (``DimSplit``). Dim ``dim`` is cut over
   mesh ``axes`` (several axes: outermost first). The dim is one or more
   ``Block``s laid end to end (a fused weight: Q, K, V or gate, up), each
   cut on its own into ``pieces`` pieces of whole ``unit``s; a rank holds
   its piece of every block, concatenated. Variants:

   - even: ``pieces`` = ranks on the axes (the default);
   - replicated pieces: fewer pieces than ranks; rank ``i`` holds piece
     ``i // (ranks / pieces)`` (the key/value head a rank's queries use when
     tp > n_kv_heads), so each piece has ``ranks / pieces`` replicas;
   - padded: ``padded`` > ``length``: the dim is padded to ``padded``
     (a multiple of ``pieces * unit``) and cut evenly; positions at or past
     ``length`` are padding, held in the local tensor (every rank's local
     tensor has the same shape) but not part of the logical tensor: never
     initialised to anything but zero, saved, or counted in a norm.

2. ``flat`` (``FlatSplit``): ZeRO's flat shards. The tensor as split by
   ``splits`` (its padding included) is flattened row-major and placed at
   ``offset`` in a flat group of ``total`` elements (``total`` None: the
   tensor alone); the group is cut into equal ranges over ``axes`` and a
   rank holds its range's overlap with the tensor, as a 1-D local tensor
   (possibly empty).

3. ``held_on``: axes on which only some coordinates hold the tensor (a
   pipeline stage: ``(("pp", (s,)),)``; tied embeddings on the first and
   last stage: ``(("pp", (0, p - 1)),)``). Every other axis replicates it.

``pieces(coords, sizes)`` lists what the rank at ``coords`` holds as
``Piece``s: a box of the logical tensor, where it sits in the local tensor
(``Piece.take(local)`` is a view) and how many ranks of the world hold the
same box (``replicas``). Initialisation (``model.build.materialize``), the
gradient norm and the checkpoint all go through it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from hpctrain.boxes import Box, box_shape, flat_index, flat_range_boxes, intersect

SPEC_ATTR = "hpctrain_spec"


@dataclass(frozen=True)
class Block:
    """One block of a split dimension."""

    length: int
    """Logical length of the block along the dim."""
    pieces: Optional[int] = None
    """Distinct pieces; None means one per rank of the split's axes. Must divide that number."""
    unit: int = 1
    """Pieces are whole multiples of this many positions (a head's head_dim rows: never cut a head)."""
    padded: Optional[int] = None
    """Padded length (a multiple of pieces * unit), >= length; None means no padding."""


@dataclass(frozen=True)
class DimSplit:
    """Tensor dim ``dim`` cut over mesh ``axes`` (outermost first), block by block."""

    dim: int
    axes: Tuple[str, ...]
    blocks: Tuple[Block, ...] = ()
    """The blocks laid end to end along the dim; () means one block, the whole dim, cut evenly."""


@dataclass(frozen=True)
class FlatSplit:
    """A flat range of the (dim-split) tensor over mesh ``axes``."""

    axes: Tuple[str, ...]
    offset: int = 0
    """Where the tensor starts in its flat group."""
    total: Optional[int] = None
    """Elements of the flat group (cut into equal ranges, the last possibly shorter); None: the tensor alone."""
    pieces: Optional[int] = None
    """Ranges: the group is cut into this many, held by runs of consecutive ranks of the axes in turn
    (rank index i holds range i % pieces; hierarchical sharding: within a node, replicated across
    nodes); None: one range per rank."""


@dataclass(frozen=True)
class Segment:
    """A run of one dim: ``length`` positions from logical ``start``, at ``local`` in the local tensor."""

    start: int
    local: int
    length: int
    replicas: int
    """Ranks on the split's axes holding the same positions."""


@dataclass(frozen=True)
class Piece:
    """A box of the logical tensor held by a rank (see ``ShardSpec.pieces``)."""

    box: Box
    """Where it is in the logical tensor."""
    local_box: Box
    """Where it is in the local tensor; for a flat split, in ``flat_shape``."""
    flat: Optional[Tuple[int, int, Tuple[int, ...]]] = None
    """Flat split: (start, stop, shape): the local tensor's ``[start:stop]`` viewed as ``shape``, then ``local_box``."""
    replicas: int = 1
    """World ranks holding this box (for norms: count it once)."""

    @property
    def slices(self) -> Tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.box)

    def take(self, local: torch.Tensor) -> torch.Tensor:
        """The piece as a view of ``local`` (the rank's tensor, or anything shaped like it)."""
        if self.flat is not None:
            a, b, shape = self.flat
            local = local.view(-1)[a:b].view(shape)
        return local[tuple(slice(a, b) for a, b in self.local_box)]


@dataclass(frozen=True)
class ShardSpec:
    logical_name: str
    global_shape: Tuple[int, ...]
    splits: Tuple[DimSplit, ...] = ()
    init: str = "normal"
    """How the logical tensor is initialised: normal, normal_scaled (residual
    output projections), ones, zeros."""
    flat: Optional[FlatSplit] = None
    held_on: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()
    """Axes where only the listed coordinates hold the tensor (pipeline stages)."""

    # -- building ----------------------------------------------------------
    @property
    def split_axes(self) -> Tuple[str, ...]:
        axes = tuple(a for s in self.splits for a in s.axes)
        return axes + (self.flat.axes if self.flat is not None else ())

    def is_replicated(self, axis: str) -> bool:
        return axis not in self.split_axes

    def split(self, dim: int, axes: "str | Sequence[str]", pieces: Optional[int] = None, unit: int = 1,
              padded: Optional[int] = None) -> "ShardSpec":
        """Cut dim ``dim`` over ``axes`` (see the module docstring)."""
        if not 0 <= dim < len(self.global_shape):
            raise ValueError(f"{self.logical_name}: no dim {dim} in shape {self.global_shape}")
        return self.split_blocks(dim, axes, [Block(self.global_shape[dim], pieces, unit, padded)])

    def split_blocks(self, dim: int, axes: "str | Sequence[str]", blocks: Iterable[Block]) -> "ShardSpec":
        """Cut dim ``dim``, made of ``blocks`` end to end (a fused weight), over ``axes``."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        blocks = tuple(blocks)
        if self.flat is not None:
            raise ValueError(f"{self.logical_name}: split dims before the flat split")
        if not 0 <= dim < len(self.global_shape):
            raise ValueError(f"{self.logical_name}: no dim {dim} in shape {self.global_shape}")
        if any(s.dim == dim for s in self.splits):
            raise ValueError(f"{self.logical_name}: dim {dim} is already split")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{self.logical_name}: axis repeated in {axes}")
        if set(axes) & set(self.split_axes):
            raise ValueError(f"{self.logical_name}: an axis of {axes} already splits another dim")
        if sum(b.length for b in blocks) != self.global_shape[dim]:
            raise ValueError(f"{self.logical_name}: blocks {[b.length for b in blocks]} do not add up to dim {dim} "
                             f"of size {self.global_shape[dim]}")
        return replace(self, splits=self.splits + (DimSplit(dim, axes, blocks),))

    def with_split(self, dim: int, *axes: str) -> "ShardSpec":
        """An even split of ``dim`` over ``axes`` (``split(dim, axes)``)."""
        return self.split(dim, axes)

    def flat_split(self, axes: "str | Sequence[str]", offset: int = 0, total: Optional[int] = None,
                   pieces: Optional[int] = None) -> "ShardSpec":
        """A flat range over ``axes`` (ZeRO), after the dim splits."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if self.flat is not None:
            raise ValueError(f"{self.logical_name}: already has a flat split")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{self.logical_name}: axis repeated in {axes}")
        if set(axes) & set(self.split_axes):
            raise ValueError(f"{self.logical_name}: an axis of {axes} already splits a dim")
        return replace(self, flat=FlatSplit(axes, offset, total, pieces))

    def on(self, axis: str, coords: Sequence[int]) -> "ShardSpec":
        """Held only by these coordinates of ``axis`` (a pipeline stage)."""
        held = tuple((a, c) for a, c in self.held_on if a != axis)
        return replace(self, held_on=held + ((axis, tuple(sorted(set(coords)))),))

    # -- layout ------------------------------------------------------------
    def _blocks(self, s: DimSplit) -> Tuple[Block, ...]:
        return s.blocks or (Block(self.global_shape[s.dim]),)

    def dim_local_shape(self, sizes: Mapping[str, int]) -> Tuple[int, ...]:
        """The local shape after the dim splits (padding included; the same on every rank)."""
        shape = list(self.global_shape)
        for s in self.splits:
            n = math.prod(sizes[a] for a in s.axes)
            shape[s.dim] = sum(self._piece_length(s, b, n) for b in self._blocks(s))
        return tuple(shape)

    def local_shape(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[int, ...]:
        if self.flat is None:
            return self.dim_local_shape(sizes)
        a, b = self._flat_range(coords, sizes)
        return (b - a,)

    def _piece_length(self, s: DimSplit, b: Block, n: int) -> int:
        pieces = b.pieces or n
        where = f"{self.logical_name}: dim {s.dim} (size {self.global_shape[s.dim]}) over {'*'.join(s.axes)}={n}"
        if pieces < 1 or n % pieces:
            raise ValueError(f"{where}: {pieces} pieces do not divide the {n} ranks")
        padded = b.padded if b.padded is not None else b.length
        if padded < b.length:
            raise ValueError(f"{where}: padded length {padded} is shorter than the block's {b.length}")
        if padded % (pieces * b.unit):
            what = f"{padded // b.unit} units of {b.unit}" if b.unit > 1 else f"block of {padded}"
            raise ValueError(f"{where}: the {what} cannot be cut into {pieces} equal pieces; "
                             "pad it (ShardSpec.split(..., padded=)) or use fewer pieces")
        return padded // pieces

    def segments(self, s: DimSplit, coords: Mapping[str, int], sizes: Mapping[str, int]) -> List[Segment]:
        """The runs of dim ``s.dim`` held at ``coords``, block by block (padding left out)."""
        n, idx = 1, 0
        for a in s.axes:
            idx = idx * sizes[a] + coords[a]
            n *= sizes[a]
        out, logical, local = [], 0, 0
        for b in self._blocks(s):
            piece_len = self._piece_length(s, b, n)
            pieces = b.pieces or n
            which = idx // (n // pieces)
            start = which * piece_len
            real = max(0, min(piece_len, b.length - start))
            if real:
                out.append(Segment(logical + start, local, real, n // pieces))
            logical += b.length
            local += piece_len
        return out

    def _flat_range(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[int, int]:
        """The part of the dim-split tensor's flattening held at ``coords``: [a, b)."""
        f = self.flat
        assert f is not None
        numel = math.prod(self.dim_local_shape(sizes))
        total = f.total if f.total is not None else numel
        if f.offset < 0 or f.offset + numel > total:
            raise ValueError(f"{self.logical_name}: at offset {f.offset}, {numel} elements overflow "
                             f"a flat group of {total}")
        n, idx = self._flat_index(coords, sizes)
        chunk = -(-total // n)
        lo, hi = idx * chunk, min(total, (idx + 1) * chunk)
        a, b = max(lo, f.offset), min(hi, f.offset + numel)
        return (a - f.offset, b - f.offset) if a < b else (0, 0)

    def _flat_index(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[int, int]:
        """(ranges, this rank's range) of the flat split."""
        f = self.flat
        assert f is not None, "called for specs with a flat split only"
        n, idx = 1, 0
        for a in f.axes:
            idx = idx * sizes[a] + coords[a]
            n *= sizes[a]
        if f.pieces is not None:
            if f.pieces < 1 or n % f.pieces:
                raise ValueError(f"{self.logical_name}: {f.pieces} flat ranges do not divide the {n} ranks of "
                                 f"{'*'.join(f.axes)}")
            return f.pieces, idx % f.pieces
        return n, idx

    def flat_replicas(self, sizes: Mapping[str, int]) -> int:
        """Ranks of the flat split's axes holding the same range."""
        if self.flat is None or self.flat.pieces is None:
            return 1
        return math.prod(sizes[a] for a in self.flat.axes) // self.flat.pieces

    def replicas_off_split(self, sizes: Mapping[str, int]) -> int:
        """Ranks holding the same box along the axes that do not split the tensor."""
        held = dict(self.held_on)
        split = set(self.split_axes)
        return math.prod(len(held[a]) if a in held else sizes[a] for a in sizes if a not in split)

    def pieces(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> List[Piece]:
        """What the rank at ``coords`` holds (see the module docstring)."""
        return list(_pieces(self, tuple(sorted(coords.items())), tuple(sorted(sizes.items()))))

    def local_slices(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[slice, ...]:
        """The one logical hyperslab held at ``coords``, for specs that hold
        exactly one box with no padding and no flat split (an even split)."""
        found = self.pieces(coords, sizes)
        if len(found) != 1 or self.flat is not None or box_shape(found[0].box) != self.local_shape(coords, sizes):
            raise ValueError(f"{self.logical_name}: this rank holds {len(found)} boxes (or padding); use pieces()")
        return found[0].slices


@lru_cache(maxsize=65536)
def _pieces(spec: ShardSpec, coords: Tuple[Tuple[str, int], ...],
            sizes: Tuple[Tuple[str, int], ...]) -> Tuple[Piece, ...]:
    c, n = dict(coords), dict(sizes)
    base = spec.replicas_off_split(n)
    per_dim: List[List[Tuple[int, int, int, int]]] = [[(0, 0, length, 1)] for length in spec.global_shape]
    for s in spec.splits:
        per_dim[s.dim] = [(g.start, g.local, g.length, g.replicas) for g in spec.segments(s, c, n)]
    boxes: List[Tuple[Box, Box, int]] = [((), (), base)]
    for runs in per_dim:  # cartesian product of the dims' runs
        boxes = [(lb + ((start, start + length),), ob + ((local, local + length),), rep * r)
                 for lb, ob, rep in boxes for start, local, length, r in runs]
    if spec.flat is None:
        return tuple(Piece(lb, ob, None, rep) for lb, ob, rep in boxes)
    boxes = [(lb, ob, rep * spec.flat_replicas(n)) for lb, ob, rep in boxes]
    shape = spec.dim_local_shape(n)
    a, b = spec._flat_range(c, n)
    out = []
    for run in flat_range_boxes(shape, a, b):  # contiguous runs of the flattening
        start = flat_index(shape, [lo for lo, _ in run])
        stop = start + math.prod(box_shape(run))
        for lb, ob, rep in boxes:
            common = intersect(run, ob)
            if common is None:
                continue
            logical = tuple((l0 + (x0 - o0), l0 + (x1 - o0)) for (l0, _), (o0, _), (x0, x1) in zip(lb, ob, common))
            inside = tuple((x0 - r0, x1 - r0) for (x0, x1), (r0, _) in zip(common, run))
            out.append(Piece(logical, inside, (start - a, stop - a, box_shape(run)), rep))
    return tuple(out)


def set_spec(param: torch.Tensor, spec: ShardSpec) -> ShardSpec:
    setattr(param, SPEC_ATTR, spec)
    return spec


def get_spec(param: torch.Tensor) -> ShardSpec:
    spec: Optional[ShardSpec] = getattr(param, SPEC_ATTR, None)
    if spec is None:
        raise AttributeError("parameter has no ShardSpec; every parameter must get one when the model is built")
    return spec


def replicated_spec(name: str, shape: Tuple[int, ...], init: str = "normal") -> ShardSpec:
    return ShardSpec(logical_name=name, global_shape=tuple(shape), init=init)
