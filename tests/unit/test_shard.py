import itertools
import math

import pytest
import torch

from hpctrain.boxes import box_shape, box_slices
from hpctrain.shard import Block, ShardSpec, get_spec, replicated_spec, set_spec


def test_replicated_spec_covers_whole_tensor():
    s = replicated_spec("w", (4, 6))
    assert s.local_slices({"tp": 1}, {"tp": 2}) == (slice(0, 4), slice(0, 6))
    assert s.is_replicated("tp") and s.split_axes == ()


def test_split_over_one_axis():
    s = replicated_spec("w", (4, 6)).with_split(1, "tp")
    assert s.local_shape({"tp": 0}, {"tp": 3}) == (4, 2)
    assert s.local_slices({"tp": 2}, {"tp": 3}) == (slice(0, 4), slice(4, 6))
    assert not s.is_replicated("tp") and s.is_replicated("dp")


def test_split_over_two_axes_outermost_first():
    s = replicated_spec("w", (8,)).with_split(0, "dp", "tp")
    sizes = {"dp": 2, "tp": 2}
    got = [s.local_slices({"dp": d, "tp": t}, sizes)[0] for d in range(2) for t in range(2)]
    assert got == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]


def test_shards_tile_the_logical_tensor():
    full = torch.arange(24).reshape(4, 6)
    s = replicated_spec("w", (4, 6)).with_split(0, "pp").with_split(1, "tp")
    sizes = {"pp": 2, "tp": 3}
    seen = torch.zeros_like(full)
    for p in range(2):
        for t in range(3):
            sl = s.local_slices({"pp": p, "tp": t}, sizes)
            seen[sl] += 1
    assert torch.all(seen == 1)


def test_indivisible_split_is_an_error():
    s = replicated_spec("w", (5,)).with_split(0, "tp")
    with pytest.raises(ValueError, match="cannot be cut"):
        s.local_slices({"tp": 0}, {"tp": 2})


def test_double_split_of_a_dim_is_an_error():
    with pytest.raises(ValueError, match="already split"):
        replicated_spec("w", (4,)).with_split(0, "tp").with_split(0, "dp")


def test_spec_attaches_to_parameters():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(AttributeError):
        get_spec(p)
    spec = set_spec(p, ShardSpec("x", (2,)))
    assert get_spec(p) is spec


# ---------------------------------------------------------------------------
# Every split kind, every rank simulated in one process.
#
# For a spec and the mesh sizes, ``_simulate`` visits every coordinate of the
# mesh, fills each rank's local tensor through ``Piece.take`` from a logical
# tensor with distinct non-zero values, and checks that
#   - the pieces' boxes tile the logical tensor: every element is held by
#     exactly ``replicas`` ranks, the ``replicas`` of every piece covering it;
#   - a piece's local box has the box's shape and lies in the local tensor,
#     and the pieces of one rank do not overlap locally;
#   - ``take()`` is a view aliasing the local tensor (a write through it lands
#     in the local tensor);
#   - reading the pieces back from all ranks gives the logical tensor, and
#     every local position outside the pieces (padding) is still zero.
# ---------------------------------------------------------------------------
def _mesh_coords(sizes):
    axes = sorted(sizes)
    for values in itertools.product(*(range(sizes[a]) for a in axes)):
        yield dict(zip(axes, values))


def _logical(shape):
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)


def _simulate(spec, sizes):
    """{rank coords tuple: (local tensor, pieces)}; asserts the invariants above."""
    full = _logical(spec.global_shape)
    held = torch.zeros(spec.global_shape, dtype=torch.int64)
    rebuilt = torch.zeros_like(full)
    out = {}
    for coords in _mesh_coords(sizes):
        shape = spec.local_shape(coords, sizes)
        local = torch.zeros(shape, dtype=torch.float64)
        pieces = spec.pieces(coords, sizes)
        covered = torch.zeros(local.numel(), dtype=torch.int64)
        for piece in pieces:
            if piece.flat is None:
                assert box_shape(piece.local_box) == box_shape(piece.box)
            else:
                assert box_shape(piece.local_box) == box_shape(piece.box) and len(piece.flat[2]) == len(piece.box)
            view = piece.take(local)
            assert tuple(view.shape) == box_shape(piece.box), (coords, piece)
            # a view of the local tensor, not a copy
            assert view.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            view.copy_(full[box_slices(piece.box)])
            assert torch.equal(piece.take(local), full[box_slices(piece.box)])
            # which local positions the piece occupies (through the same view)
            index = torch.arange(local.numel()).reshape(local.shape)
            covered[piece.take(index).reshape(-1)] += 1
            held[box_slices(piece.box)] += 1
        assert covered.numel() == 0 or int(covered.max()) <= 1, f"{coords}: pieces overlap in the local tensor"
        # padding (positions no piece covers) stays zero; real positions are filled
        flat_local = local.reshape(-1)
        assert torch.all(flat_local[covered == 0] == 0)
        assert torch.all(flat_local[covered == 1] != 0)
        out[tuple(sorted(coords.items()))] = (local, pieces)
    # every element held by exactly `replicas` ranks, as every covering piece says
    for local, pieces in out.values():
        for piece in pieces:
            counts = held[box_slices(piece.box)]
            assert torch.all(counts == piece.replicas), (piece, counts.unique())
            rebuilt[box_slices(piece.box)] = piece.take(local)
    assert torch.all(held >= 1), "some logical elements are held by no rank"
    assert torch.equal(rebuilt, full)
    return out


def _at(out, **coords):
    return out[tuple(sorted(coords.items()))]


def _same_local_shape(spec, sizes):
    shapes = {spec.local_shape(c, sizes) for c in _mesh_coords(sizes)}
    assert len(shapes) == 1, shapes
    return shapes.pop()


def test_even_split_tiles_with_one_replica_per_other_axis():
    spec = replicated_spec("w", (8, 6)).split(1, "tp")
    sizes = {"tp": 3, "dp": 2}
    out = _simulate(spec, sizes)
    assert _same_local_shape(spec, sizes) == (8, 2)
    local, pieces = _at(out, tp=1, dp=1)
    assert [p.box for p in pieces] == [((0, 8), (2, 4))]
    assert [p.replicas for p in pieces] == [2]  # the two dp ranks


def test_several_axes_outermost_first():
    spec = replicated_spec("w", (8, 4, 6)).split(0, ("dp", "tp")).split(2, "pp")
    sizes = {"dp": 2, "tp": 2, "pp": 3}
    out = _simulate(spec, sizes)
    assert _same_local_shape(spec, sizes) == (2, 4, 2)
    for d, t, p in itertools.product(range(2), range(2), range(3)):
        (piece,) = _at(out, dp=d, tp=t, pp=p)[1]
        row = 2 * (2 * d + t)  # dp outermost: its index counts in units of tp
        assert piece.box == ((row, row + 2), (0, 4), (2 * p, 2 * p + 2))
        assert piece.replicas == 1


def test_replicated_pieces_and_their_replication_factor():
    # 2 key/value heads of 3 rows over tp=4: rank i holds head i // 2
    spec = replicated_spec("wk", (6, 5)).split(0, "tp", pieces=2, unit=3)
    sizes = {"tp": 4, "dp": 3}
    out = _simulate(spec, sizes)
    assert _same_local_shape(spec, sizes) == (3, 5)
    for t in range(4):
        (piece,) = _at(out, tp=t, dp=0)[1]
        head = t // 2
        assert piece.box == ((3 * head, 3 * head + 3), (0, 5))
        assert piece.replicas == 2 * 3  # 2 tp ranks per head, times the 3 dp replicas


def test_replicated_pieces_with_one_piece_is_replicated_on_the_axis():
    spec = replicated_spec("wk", (4,)).split(0, "tp", pieces=1)
    out = _simulate(spec, {"tp": 4})
    for t in range(4):
        (piece,) = _at(out, tp=t)[1]
        assert piece.box == ((0, 4),) and piece.replicas == 4


def test_padded_split_with_a_piece_that_is_all_padding():
    # length 5 padded to 8 over 4 ranks: [0,2) [2,4) [4,5)+pad, all pad
    spec = replicated_spec("vocab", (5, 3)).split(0, "tp", padded=8)
    sizes = {"tp": 4}
    out = _simulate(spec, sizes)
    assert _same_local_shape(spec, sizes) == (2, 3)
    assert spec.global_shape == (5, 3)  # the logical shape stays unpadded
    assert [p.box for p in _at(out, tp=0)[1]] == [((0, 2), (0, 3))]
    assert [p.box for p in _at(out, tp=2)[1]] == [((4, 5), (0, 3))]
    assert [p.local_box for p in _at(out, tp=2)[1]] == [((0, 1), (0, 3))]
    local, pieces = _at(out, tp=3)
    assert pieces == [] and tuple(local.shape) == (2, 3) and torch.all(local == 0)
    with pytest.raises(ValueError, match="padding"):
        spec.local_slices({"tp": 2}, sizes)


def test_padded_split_with_unit_and_replicated_pieces():
    # 5 rows padded to 6, cut in 2 pieces of 3 rows, each held by 2 of 4 ranks
    spec = replicated_spec("w", (5, 2)).split(0, "tp", pieces=2, padded=6)
    out = _simulate(spec, {"tp": 4})
    assert [p.box for p in _at(out, tp=3)[1]] == [((3, 5), (0, 2))]
    assert [p.replicas for p in _at(out, tp=3)[1]] == [2]


def test_fused_blocks_with_different_pieces_per_block():
    # QKV of 4 query heads and 2 key/value heads of head_dim 2, over tp=4:
    # q cut in 4, k and v each in 2 pieces held by 2 ranks
    hd = 2
    spec = replicated_spec("wqkv", (8 + 4 + 4, 3)).split_blocks(
        0, "tp", [Block(8, None, hd), Block(4, 2, hd), Block(4, 2, hd)])
    sizes = {"tp": 4, "dp": 2}
    out = _simulate(spec, sizes)
    assert _same_local_shape(spec, sizes) == (3 * hd, 3)
    for t in range(4):
        q, k, v = _at(out, tp=t, dp=1)[1]
        kv = t // 2
        assert q.box == ((hd * t, hd * t + hd), (0, 3)) and q.local_box == ((0, 2), (0, 3))
        assert k.box == ((8 + hd * kv, 8 + hd * kv + hd), (0, 3)) and k.local_box == ((2, 4), (0, 3))
        assert v.box == ((12 + hd * kv, 12 + hd * kv + hd), (0, 3)) and v.local_box == ((4, 6), (0, 3))
        assert (q.replicas, k.replicas, v.replicas) == (2, 4, 4)


def test_fused_blocks_with_padding_in_one_block():
    spec = replicated_spec("w", (5 + 4,)).split_blocks(0, "tp", [Block(5, padded=8), Block(4)])
    out = _simulate(spec, {"tp": 4})
    assert [p.box for p in _at(out, tp=3)[1]] == [((8, 9),)]  # its first block's piece is all padding
    assert [p.local_box for p in _at(out, tp=3)[1]] == [((2, 3),)]
    assert [p.box for p in _at(out, tp=2)[1]] == [((4, 5),), ((7, 8),)]


def test_flat_split_alone():
    spec = replicated_spec("w", (3, 5)).flat_split("dp")
    sizes = {"dp": 4, "tp": 2}
    out = _simulate(spec, sizes)
    # 15 elements in ranges of 4: [0,4) [4,8) [8,12) [12,15)
    assert [spec.local_shape({"dp": d, "tp": 0}, sizes) for d in range(4)] == [(4,), (4,), (4,), (3,)]
    pieces = _at(out, dp=1, tp=0)[1]
    assert [p.box for p in pieces] == [((0, 1), (4, 5)), ((1, 2), (0, 3))]
    assert all(p.replicas == 2 for p in pieces)  # the tp replicas


def test_flat_split_of_a_3d_tensor_crossing_rows_and_planes():
    spec = replicated_spec("w", (2, 3, 4)).flat_split("dp")
    out = _simulate(spec, {"dp": 5})  # ranges of 5 elements cut rows and planes
    assert sum(len(p) for _, p in out.values()) > 5


def test_flat_split_after_a_dim_split():
    spec = replicated_spec("w", (4, 6)).split(1, "tp").flat_split("dp")
    sizes = {"tp": 2, "dp": 3}
    out = _simulate(spec, sizes)
    assert spec.dim_local_shape(sizes) == (4, 3)
    # tp=1's (4, 3) local tensor flattened, dp=1 holds its elements [4, 8)
    local, pieces = _at(out, tp=1, dp=1)
    assert tuple(local.shape) == (4,)
    assert [p.box for p in pieces] == [((1, 2), (4, 6)), ((2, 3), (3, 5))]


def test_flat_split_after_a_padded_split_leaves_padding_out():
    # 5 rows padded to 6 over tp=2: tp=1's (3, 4) local tensor has one padding row
    spec = replicated_spec("w", (5, 4)).split(0, "tp", padded=6).flat_split("dp")
    sizes = {"tp": 2, "dp": 3}
    out = _simulate(spec, sizes)
    local, pieces = _at(out, tp=1, dp=2)  # elements [8, 12): the padding row
    assert tuple(local.shape) == (4,) and pieces == [] and torch.all(local == 0)
    local, pieces = _at(out, tp=1, dp=1)  # elements [4, 8): row 4 of the logical tensor
    assert [p.box for p in pieces] == [((4, 5), (0, 4))]


def test_flat_split_after_replicated_pieces():
    spec = replicated_spec("wk", (4, 3)).split(0, "tp", pieces=2).flat_split("dp")
    _simulate(spec, {"tp": 4, "dp": 2})


def test_flat_group_with_offset_and_total_where_a_rank_holds_nothing():
    # two tensors of 6 in one flat group of 24 over dp=4 (ranges of 6)
    a = replicated_spec("a", (2, 3)).flat_split("dp", offset=0, total=24)
    b = replicated_spec("b", (2, 3)).flat_split("dp", offset=10, total=24)
    sizes = {"dp": 4, "tp": 2}
    assert [a.local_shape({"dp": d, "tp": 0}, sizes) for d in range(4)] == [(6,), (0,), (0,), (0,)]
    assert [b.local_shape({"dp": d, "tp": 0}, sizes) for d in range(4)] == [(0,), (2,), (4,), (0,)]
    out = _simulate(b, sizes)
    assert _at(out, dp=0, tp=0)[1] == [] and _at(out, dp=3, tp=1)[1] == []
    assert [p.box for p in _at(out, dp=1, tp=0)[1]] == [((0, 1), (0, 2))]
    assert [p.box for p in _at(out, dp=2, tp=0)[1]] == [((0, 1), (2, 3)), ((1, 2), (0, 3))]
    _simulate(a, sizes)


def test_flat_group_uneven_last_range():
    # 10 elements in a group of 10 over 4: ranges of 3, the last one 1
    spec = replicated_spec("w", (10,)).flat_split("dp", offset=0, total=10)
    sizes = {"dp": 4}
    assert [spec.local_shape({"dp": d}, sizes) for d in range(4)] == [(3,), (3,), (3,), (1,)]
    _simulate(spec, sizes)


def test_held_on_counts_only_the_holding_stages_as_replicas():
    spec = replicated_spec("emb", (4, 2)).split(0, "tp").on("pp", [0, 3])
    sizes = {"tp": 2, "pp": 4, "dp": 2}
    (piece,) = spec.pieces({"tp": 1, "pp": 0, "dp": 0}, sizes)
    assert piece.box == ((2, 4), (0, 2)) and piece.replicas == 2 * 2  # 2 stages x 2 dp


# -- impossible splits: errors name the problem ---------------------------

def test_error_pieces_not_dividing_the_ranks():
    spec = replicated_spec("wk", (6, 2)).split(0, "tp", pieces=3)
    with pytest.raises(ValueError, match=r"wk: dim 0 .*tp=4.*3 pieces do not divide the 4 ranks"):
        spec.local_shape({"tp": 0}, {"tp": 4})
    with pytest.raises(ValueError, match="3 pieces do not divide the 4 ranks"):
        spec.pieces({"tp": 0}, {"tp": 4})


def test_error_unit_would_be_cut():
    # 2 heads of 6 rows cannot go to 4 ranks without cutting a head
    spec = replicated_spec("wq", (12, 2)).split(0, "tp", unit=6)
    with pytest.raises(ValueError, match=r"wq: dim 0 .*2 units of 6 cannot be cut into 4 equal pieces"):
        spec.local_shape({"tp": 0}, {"tp": 4})
    assert spec.local_shape({"tp": 0}, {"tp": 2}) == (6, 2)


def test_error_padded_shorter_than_length():
    spec = replicated_spec("vocab", (5,)).split(0, "tp", padded=4)
    with pytest.raises(ValueError, match="padded length 4 is shorter than the block's 5"):
        spec.local_shape({"tp": 0}, {"tp": 2})


def test_error_padded_not_a_multiple_of_the_pieces():
    spec = replicated_spec("vocab", (5,)).split(0, "tp", padded=6)
    with pytest.raises(ValueError, match="cannot be cut into 4 equal pieces"):
        spec.local_shape({"tp": 0}, {"tp": 4})


def test_error_dim_split_twice():
    with pytest.raises(ValueError, match="w: dim 1 is already split"):
        replicated_spec("w", (4, 4)).split(1, "tp").split(1, "dp")


def test_error_axis_used_twice():
    with pytest.raises(ValueError, match=r"w: an axis of \('tp',\) already splits another dim"):
        replicated_spec("w", (4, 4)).split(0, "tp").split(1, "tp")
    with pytest.raises(ValueError, match=r"an axis of \('dp', 'tp'\) already splits"):
        replicated_spec("w", (4, 4)).split(0, "tp").split(1, ("dp", "tp"))
    with pytest.raises(ValueError, match="already splits a dim"):
        replicated_spec("w", (4, 4)).split(0, "tp").flat_split("tp")


def test_error_other_impossible_specs():
    with pytest.raises(ValueError, match="split dims before the flat split"):
        replicated_spec("w", (4, 4)).flat_split("dp").split(0, "tp")
    with pytest.raises(ValueError, match="already has a flat split"):
        replicated_spec("w", (4, 4)).flat_split("dp").flat_split("tp")
    with pytest.raises(ValueError, match=r"blocks \[3, 3\] do not add up to dim 0 of size 8"):
        replicated_spec("w", (8,)).split_blocks(0, "tp", [Block(3), Block(3)])
    spec = replicated_spec("w", (4, 4)).flat_split("dp", offset=10, total=20)
    with pytest.raises(ValueError, match="16 elements overflow a flat group of 20"):
        spec.local_shape({"dp": 0}, {"dp": 2})


def test_error_split_of_a_dim_the_tensor_lacks():
    with pytest.raises(ValueError, match=r"w: no dim 2 in shape \(4, 4\)"):
        replicated_spec("w", (4, 4)).split_blocks(2, "tp", [Block(4)])
    with pytest.raises(ValueError, match=r"w: no dim 2 in shape \(4, 4\)"):
        replicated_spec("w", (4, 4)).split(2, "tp")


def test_error_axis_repeated_within_one_split():
    # ("tp", "tp") would index 4 pieces with 2 ranks: elements [2, 6) of 8 held by nobody
    with pytest.raises(ValueError, match="tp"):
        replicated_spec("w", (8,)).split(0, ("tp", "tp"))
    with pytest.raises(ValueError, match="dp"):
        replicated_spec("w", (8,)).flat_split(("dp", "dp"))


def test_flat_split_within_runs_of_ranks_replicated_across_them():
    """Hierarchical sharding: 4 ranks of dp as 2 nodes of 2; the ranges are
    cut over a node's 2 ranks and repeated on the other node."""
    spec = replicated_spec("w", (3, 4)).flat_split("dp", pieces=2)
    sizes = {"dp": 4}
    held = [[(p.box, p.replicas) for p in spec.pieces({"dp": r}, sizes)] for r in range(4)]
    assert held[0] == held[2] and held[1] == held[3] and held[0] != held[1]
    assert all(rep == 2 for rank in held for _, rep in rank)
    assert spec.local_shape({"dp": 1}, sizes) == (6,)
    with pytest.raises(ValueError, match="3 flat ranges do not divide the 4 ranks"):
        replicated_spec("w", (3, 4)).flat_split("dp", pieces=3).pieces({"dp": 0}, sizes)
