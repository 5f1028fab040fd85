"""Boxes: hyperslabs of a tensor, ``(start, stop)`` per dimension.

A ShardSpec describes what a rank holds of a logical tensor as boxes, and
the checkpoint writes and reads boxes of logical datasets, so both use this
one representation. ``()`` is the whole of a scalar.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

Box = Tuple[Tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_from_slices(slices: Sequence[slice], shape: Sequence[int]) -> Box:
    """Slices with step 1 -> Box."""
    out = []
    for sl, n in zip(slices, shape):
        start, stop, step = sl.indices(int(n))
        if step != 1:
            raise ValueError(f"hyperslab {sl} has step {step}; only contiguous slices are stored")
        out.append((start, stop))
    return tuple(out)


def box_slices(box: Box) -> Tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def box_shape(box: Box) -> Tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_volume(box: Box) -> int:
    return math.prod(box_shape(box))


def boxes_overlap(a: Box, b: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def box_inside(box: Box, shape: Sequence[int]) -> bool:
    return len(box) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(box, shape))


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes of the same tensor, or None when empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(x < y for x, y in out) or not out else None


def flat_index(shape: Sequence[int], point: Sequence[int]) -> int:
    """Row-major offset of ``point`` in a tensor of ``shape``."""
    idx = 0
    for n, i in zip(shape, point):
        idx = idx * int(n) + int(i)
    return idx


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """The elements ``[start, stop)`` of the row-major flattening of ``shape``
    as at most ``2 * ndim - 1`` boxes, in flat order. Each box is itself one
    contiguous run of the flattening (its inner dimensions are whole)."""
    shape = tuple(int(n) for n in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [()]
    if len(shape) == 1:
        return [((start, stop),)]
    inner = math.prod(shape[1:])
    r0, off0 = divmod(start, inner)
    r1, off1 = divmod(stop, inner)
    if r0 == r1:  # inside one row
        return [((r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], off0, off1)]
    out: List[Box] = []
    if off0:  # partial first row
        out += [((r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], off0, inner)]
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(((r0, r1),) + full_box(shape[1:]))
    if off1:  # partial last row
        out += [((r1, r1 + 1),) + b for b in flat_range_boxes(shape[1:], 0, off1)]
    return out
