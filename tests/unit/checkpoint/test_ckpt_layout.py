"""Boxes, the write plan and the layout-independent checksum (pure logic)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hpctrain.shard import DimSplit, ShardSpec

from hpctrain_h5ckpt import checksum
from hpctrain_h5ckpt.layout import (
    DatasetDecl,
    PlanError,
    box_from_slices,
    box_volume,
    boxes_overlap,
    build_plan,
    flat_range_boxes,
    full_box,
)


def _slab(a: np.ndarray, box) -> np.ndarray:
    return a[tuple(slice(x, y) for x, y in box)]


@pytest.mark.parametrize("shape", [(7,), (4, 6), (3, 4, 5), (2, 3, 2, 4)])
def test_flat_range_boxes_tile_the_range_in_order(shape):
    total = math.prod(shape)
    flat = np.arange(total).reshape(shape)
    for start, stop in itertools.combinations(range(0, total + 1, max(1, total // 9)), 2):
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= 2 * len(shape) - 1
        got = np.concatenate([_slab(flat, b).reshape(-1) for b in boxes])
        np.testing.assert_array_equal(got, np.arange(start, stop))


def test_shardspec_slices_become_boxes():
    spec = ShardSpec("w", (8, 6), (DimSplit(0, ("tp",)),))
    boxes = [box_from_slices(spec.local_slices({"tp": r}, {"tp": 2}), spec.global_shape) for r in range(2)]
    assert boxes == [((0, 4), (0, 6)), ((4, 8), (0, 6))]
    assert not boxes_overlap(*boxes) and sum(map(box_volume, boxes)) == 48


def _decl(path, shape, dtype="<f4"):
    return DatasetDecl(path, shape, dtype, (("kind", "param"),))


def test_replicated_tensors_get_one_writer_each_and_writes_spread_over_ranks():
    decls = [_decl(f"/model/w{i}", (16, 16)) for i in range(4)]
    everyone = {d.path: [full_box(d.shape)] for d in decls}
    plan = build_plan([(decls, everyone, {"step": 3})] * 2)
    assert [len(plan.owners[d.path]) for d in decls] == [1, 1, 1, 1]
    assert plan.bytes_by_rank() == {0: 2 * 1024, 1: 2 * 1024}  # balanced, not all on rank 0
    assert plan.rounds("/model/w0") == 1 and plan.meta == {"step": 3}


def test_sharded_tensor_each_rank_writes_its_own_slab():
    d = _decl("/model/w", (8, 4))
    per_rank = [([d], {d.path: [((4 * r, 4 * r + 4), (0, 4))]}, {}) for r in range(2)]
    plan = build_plan(per_rank)
    assert plan.owned_by(0) == {d.path: [((0, 4), (0, 4))]}
    assert plan.owned_by(1) == {d.path: [((4, 8), (0, 4))]}


def test_inconsistent_declarations_are_rejected():
    d = _decl("/model/w", (8, 4))
    gap = [([d], {d.path: [((0, 4), (0, 4))]}, {})]
    with pytest.raises(PlanError, match="do not tile"):
        build_plan(gap)
    assert build_plan(gap, require_cover=False).covered[d.path] is False
    with pytest.raises(PlanError, match="declares"):
        build_plan([([d], {}, {}), ([_decl("/model/w", (8, 5))], {}, {})])
    with pytest.raises(PlanError, match="same step"):
        build_plan([([d], {d.path: [full_box((8, 4))]}, {"step": 1}), ([d], {}, {"step": 2})])


def _naive(a: np.ndarray) -> np.ndarray:
    """The definition, directly: 32-bit words (8-byte elements as two, smaller ones
    widened) at their flat index, s1 = sum w, s2 = sum (i+1) w, modulo 2**32."""
    if a.itemsize == 8:
        w = a.reshape(-1).view(np.uint32).astype(np.uint64)
    else:
        w = a.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.itemsize]).astype(np.uint64)
    i = np.arange(1, w.size + 1, dtype=np.uint64)
    return np.array([w.sum() % 2**32, (w * i % 2**32).sum() % 2**32], dtype=np.uint32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.uint8])
def test_checksum_is_the_same_for_any_split(dtype):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((6, 8, 10)) * 1000).astype(dtype)
    want = _naive(a)
    np.testing.assert_array_equal(checksum.whole(a), want)
    splits = [
        [((0, 3), (0, 8), (0, 10)), ((3, 6), (0, 8), (0, 10))],                       # dim 0 (pipeline / ZeRO rows)
        [((0, 6), (0, 8), (0, 5)), ((0, 6), (0, 8), (5, 10))],                        # last dim (row-parallel TP)
        [b for s, e in [(0, 77), (77, 300), (300, 480)] for b in flat_range_boxes(a.shape, s, e)],  # flat ZeRO
    ]
    for boxes in splits:
        acc = checksum.zero()
        for b in boxes:
            acc = checksum.add(acc, checksum.partial(_slab(a, b), a.shape, b))
        np.testing.assert_array_equal(acc, want)


def test_checksum_detects_a_flipped_bit_and_moved_elements():
    a = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)
    base = checksum.whole(a)
    for byte in (0, 1001, a.nbytes - 1):
        b = a.copy()
        b.view(np.uint8).reshape(-1)[byte] ^= 0x10
        assert not np.array_equal(checksum.whole(b), base)
    swapped = a.copy()
    swapped[:, [3, 4]] = swapped[:, [4, 3]]
    assert not np.array_equal(checksum.whole(swapped), base)


def test_checksum_of_scalars_and_text():
    assert checksum.whole(np.array(3.0, np.float32)).tolist() == [0x40400000, 0x40400000]
    lo, hi = np.array(3.0, np.float64).reshape(1).view(np.uint32).tolist()  # 8 bytes: two words
    assert checksum.whole(np.array(3.0, np.float64)).tolist() == [lo + hi, lo + 2 * hi]
    t = np.array(b"ab", dtype="S2")
    assert checksum.whole(t).tolist() == [ord("a") + ord("b"), ord("a") + 2 * ord("b")]
