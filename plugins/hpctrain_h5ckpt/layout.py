"""Which datasets a checkpoint holds, which rank holds which hyperslab, and
who writes (or checks) each one.

A checkpoint is a set of datasets, each in its *logical* (unsharded) shape.
Every rank declares the datasets it holds (``DatasetDecl``) and, for each,
the boxes of it it holds (a box is a hyperslab: one ``(start, stop)`` per
dimension; ``()`` for a scalar). ``build_plan`` merges every rank's
declaration (one allgather) into a ``Plan``:

- the union of datasets, sorted by path: every rank creates the same
  datasets in the same order with the same metadata, as parallel HDF5
  requires;
- for each dataset, its distinct boxes and exactly one *owner* per box. A
  box held by several ranks (a replicated tensor, or a slice replicated over
  some axes) is written by one of them only. Owners are chosen greedily by
  bytes (largest boxes first, to the holder with the least so far), so with
  pure data parallelism, where every tensor is replicated, the writes still
  spread over the ranks instead of all landing on rank 0. The choice is a
  pure function of the gathered declarations, so every rank agrees on it
  without further messages.

Nothing here knows about axes: a rank's boxes are the pieces of its
ShardSpecs (``ShardSpec.pieces``: TP/CP/EP splits of any dims, fused
blocks, replicated pieces, padding left out, flat ZeRO ranges as lists of
boxes), and a pipeline stage simply does not declare the tensors it does
not hold. So later parallel axes need no format change: the file always
stores the logical tensor.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from hpctrain.boxes import (  # noqa: F401
    Box,
    box_from_slices,
    box_inside,
    box_shape,
    box_volume,
    boxes_overlap,
    flat_range_boxes,
    full_box,
)

FORMAT_NAME = "hpctrain-h5ckpt"
FORMAT_VERSION = 1
"""Bumped when a reader of the previous version could misread a new file."""

# Above this many distinct boxes per dataset the pairwise overlap check is
# skipped (it is quadratic); the volume check still runs.
_MAX_PAIRWISE = 512


@dataclass(frozen=True)
class DatasetDecl:
    """A dataset as every holder declares it: identical on all of them."""

    path: str
    shape: Tuple[int, ...]
    dtype: str
    """numpy dtype string of the stored elements ('<f4', '<u2' for bfloat16, '|S12')."""
    attrs: Tuple[Tuple[str, str], ...] = ()
    """String attributes written on the dataset (logical name, splits, torch dtype, ...)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def attr(self, key: str, default: str = "") -> str:
        return dict(self.attrs).get(key, default)


@dataclass
class Plan:
    """The merged view of every rank's declaration (identical on all ranks)."""

    datasets: List[DatasetDecl]
    owners: Dict[str, List[Tuple[Box, int]]]
    """path -> [(box, owner rank)] over the distinct boxes of that dataset."""
    covered: Dict[str, bool] = field(default_factory=dict)
    """path -> whether the distinct boxes tile the whole dataset."""
    meta: Dict[str, Any] = field(default_factory=dict)
    """Rank 0's scalar metadata (step, cursor, ...), checked equal everywhere."""

    def owned_by(self, rank: int) -> Dict[str, List[Box]]:
        out: Dict[str, List[Box]] = {}
        for path, pairs in self.owners.items():
            mine = [b for b, r in pairs if r == rank]
            if mine:
                out[path] = mine
        return out

    def rounds(self, path: str) -> int:
        """Largest number of boxes of ``path`` one rank owns: the number of
        collective calls every rank makes on it (empty ones included)."""
        counts: Dict[int, int] = {}
        for _, r in self.owners.get(path, []):
            counts[r] = counts.get(r, 0) + 1
        return max(counts.values(), default=0)

    def bytes_by_rank(self) -> Dict[int, int]:
        itemsize = {d.path: np.dtype(d.dtype).itemsize for d in self.datasets}
        out: Dict[int, int] = {}
        for path, pairs in self.owners.items():
            for b, r in pairs:
                out[r] = out.get(r, 0) + box_volume(b) * itemsize[path]
        return out


class PlanError(ValueError):
    """Ranks declared datasets that cannot form one consistent file."""


def build_plan(
    per_rank: Sequence[Tuple[Sequence[DatasetDecl], Mapping[str, Sequence[Box]], Mapping[str, Any]]],
    require_cover: bool = True,
) -> Plan:
    """Merge ``[(decls, boxes by path, meta)]`` indexed by rank into a Plan.

    With ``require_cover`` (saving) the distinct boxes of each dataset must
    tile it exactly; otherwise (loading) ``Plan.covered`` records whether they do.
    """
    decls: Dict[str, DatasetDecl] = {}
    holders: Dict[str, Dict[Box, List[int]]] = {}
    for rank, (rank_decls, rank_boxes, _) in enumerate(per_rank):
        for d in rank_decls:
            seen = decls.setdefault(d.path, d)
            if seen != d:
                raise PlanError(f"dataset {d.path}: rank {rank} declares {d.shape} {d.dtype} {dict(d.attrs)} "
                                f"but another rank declared {seen.shape} {seen.dtype} {dict(seen.attrs)}")
        for path, boxes in rank_boxes.items():
            if path not in decls:
                raise PlanError(f"rank {rank} holds boxes of {path} without declaring it")
            for b in boxes:
                if not box_inside(b, decls[path].shape):
                    raise PlanError(f"dataset {path} {decls[path].shape}: rank {rank}'s hyperslab {b} lies outside it")
                holders.setdefault(path, {}).setdefault(tuple(b), []).append(rank)
    meta = dict(per_rank[0][2]) if per_rank else {}
    for rank, (_, _, m) in enumerate(per_rank):
        if dict(m) != meta:
            raise PlanError(f"rank {rank} reports {dict(m)} but rank 0 reports {meta}; ranks must save the same step")
    owners: Dict[str, List[Tuple[Box, int]]] = {}
    covered: Dict[str, bool] = {}
    load: Dict[int, int] = {}
    jobs = []
    for path in sorted(decls):
        d = decls[path]
        boxes = sorted(holders.get(path, {}))
        covered[path] = _tiles(path, d.shape, boxes, strict=require_cover)
        itemsize = np.dtype(d.dtype).itemsize
        jobs += [(box_volume(b) * itemsize, path, b) for b in boxes]
    # Largest first to the least-loaded holder; ties go to the lowest rank.
    for nbytes, path, b in sorted(jobs, key=lambda j: (-j[0], j[1], j[2])):
        ranks = holders[path][b]
        owner = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[owner] = load.get(owner, 0) + nbytes
        owners.setdefault(path, []).append((b, owner))
    for path in owners:
        owners[path].sort()
    return Plan(datasets=[decls[p] for p in sorted(decls)], owners=owners, covered=covered, meta=meta)


def _tiles(path: str, shape: Tuple[int, ...], boxes: List[Box], strict: bool) -> bool:
    total = math.prod(shape)
    volume = sum(box_volume(b) for b in boxes)
    ok = volume == total
    if ok and len(boxes) <= _MAX_PAIRWISE:
        ok = not any(boxes_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if strict and not ok:
        raise PlanError(f"dataset {path} {shape}: the ranks' hyperslabs {boxes} do not tile it exactly "
                        "(a plugin's ShardSpec is inconsistent with the tensors it holds)")
    return ok


def gather_plan(comm: Any, decls: Sequence[DatasetDecl], boxes: Mapping[str, Sequence[Box]],
                meta: Mapping[str, Any], require_cover: bool = True) -> Plan:
    """Allgather the declarations over ``comm`` and build the same Plan on every rank.

    A rank whose declaration is inconsistent makes every rank raise the same
    PlanError, so none is left waiting in a later collective.
    """
    gathered = comm.allgather((list(decls), {p: list(b) for p, b in boxes.items()}, dict(meta)))
    return build_plan(gathered, require_cover=require_cover)


def splits_json(spec: Any) -> str:
    """How the saving layout held a tensor (the dataset's ``splits``
    attribute, JSON, for people and tools): each dim split's axes and blocks,
    and the flat split. Loading never needs it: a load reads by its own specs."""
    out: List[Dict[str, Any]] = []
    for s in spec.splits:
        entry: Dict[str, Any] = {"dim": s.dim, "axes": list(s.axes)}
        if len(s.blocks) > 1 or any((b.pieces, b.unit, b.padded) != (None, 1, None) for b in s.blocks):
            entry["blocks"] = [{"length": b.length, "pieces": b.pieces, "unit": b.unit, "padded": b.padded}
                               for b in s.blocks]
        out.append(entry)
    if spec.flat is not None:
        out.append({"flat": list(spec.flat.axes), "offset": spec.flat.offset, "total": spec.flat.total})
    return json.dumps(out)
