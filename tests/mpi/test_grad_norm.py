"""The global gradient norm equals the one-process norm of the logical
gradient, whatever the split kind, and every rank enters its one collective.

Each test builds a logical gradient G (known on every rank), gives each rank
exactly what its ShardSpec says it holds (``Piece.take`` on a local tensor;
padding filled with garbage that must not count), and compares
``reduce_step`` with ``torch.linalg.norm(G)`` computed in one process.
fp32 gradients, float64 sums: relative 1e-6 covers the reassociation.
"""
from __future__ import annotations

import pytest
import torch

from hpctrain.shard import Block, replicated_spec
from hpctrain.train.grad_norm import local_square_sum, reduce_step

RTOL = 1e-6


def _mesh(world, make_config, pm, **sizes):
    from hpctrain.bootstrap import with_device
    from hpctrain.run import build_mesh

    overrides = [f"parallel.{a}={n}" for a, n in sizes.items()] + ["trainer.device=cpu"]
    return build_mesh(make_config(*overrides), with_device("cpu"), pm)


def _logical(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _local(spec, mesh, logical, garbage=1e6):
    """This rank's local gradient for ``spec``: its pieces of ``logical``, garbage elsewhere (padding)."""
    local = torch.full(spec.local_shape(mesh.coords, mesh.sizes), garbage)
    for piece in spec.pieces(mesh.coords, mesh.sizes):
        piece.take(local).copy_(logical[piece.slices])
    return local


def _norm(mesh, pairs, loss=0.0, tokens=0):
    norm, _ = reduce_step(pairs, torch.tensor(loss), tokens, mesh, torch.device("cpu"))
    return float(norm)


def _check(mesh, spec, logical):
    got = _norm(mesh, [(_local(spec, mesh, logical), spec)])
    want = float(torch.linalg.norm(logical.double()))
    assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_replicated(world, make_config, pm):
    mesh = _mesh(world, make_config, pm, dp=-1)  # every rank holds all of it
    _check(mesh, replicated_spec("w", (8, 6)), _logical((8, 6)))


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_split(world, make_config, pm):
    n = world.Get_size()
    mesh = _mesh(world, make_config, pm, tp=2, dp=-1)
    _check(mesh, replicated_spec("w", (8, 6)).split(0, "tp"), _logical((8, 6), 1))
    if n >= 4:  # two axes on one dim
        _check(mesh, replicated_spec("w", (8, 16)).split(1, ("dp", "tp")), _logical((8, 16), 2))


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_padded(world, make_config, pm):
    n = world.Get_size()
    mesh = _mesh(world, make_config, pm, tp=n)
    # 5 rows padded to a multiple of n (at least 6): some padding on the last rank, and
    # from 4 ranks on, ranks that hold padding only
    spec = replicated_spec("vocab", (5, 3)).split(0, "tp", padded=-(-6 // n) * n)
    assert n == 2 or any(not spec.pieces(mesh.coords_of(r), mesh.sizes) for r in range(n))
    _check(mesh, spec, _logical((5, 3), 3))


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_replicated_pieces(world, make_config, pm):
    n = world.Get_size()
    mesh = _mesh(world, make_config, pm, tp=n)
    # key/value heads when tp > n_kv_heads: 2 heads of 4 rows over n ranks (n / 2 replicas each),
    # and a fused QKV whose query block is split evenly while its k/v blocks are replicated
    pieces = 1 if n == 2 else 2
    _check(mesh, replicated_spec("wk", (8, 3)).split(0, "tp", pieces=pieces, unit=4), _logical((8, 3), 4))
    qkv = replicated_spec("wqkv", (4 * n + 16, 3)).split_blocks(
        0, "tp", [Block(4 * n, unit=4), Block(8, pieces, 4), Block(8, pieces, 4)])
    _check(mesh, qkv, _logical((4 * n + 16, 3), 5))


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_flat(world, make_config, pm):
    mesh = _mesh(world, make_config, pm, dp=-1)
    _check(mesh, replicated_spec("w", (7, 5)).flat_split("dp"), _logical((7, 5), 6))
    # inside a flat group that also holds other tensors: some ranks hold none of it
    _check(mesh, replicated_spec("w", (3, 2)).flat_split("dp", offset=40, total=50), _logical((3, 2), 7))


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_ranks_without_gradients_enter_the_same_collective(world, make_config, pm):
    """A pipeline stage with no gradient at all, and a tensor tied across the
    first and last stage (held twice, counted once)."""
    mesh = _mesh(world, make_config, pm, pp=2, dp=-1)
    stage = mesh.rank("pp")
    first = replicated_spec("layers.0.w", (6, 4)).on("pp", [0])
    tied = replicated_spec("tok_embeddings.weight", (5, 4)).on("pp", [0, 1])
    g_first, g_tied = _logical((6, 4), 8), _logical((5, 4), 9)
    pairs = [(g_first.clone(), first)] if stage == 0 else []
    want = float(torch.linalg.norm(g_first.double()))
    assert _norm(mesh, pairs) == pytest.approx(want, rel=RTOL)
    pairs.append((g_tied.clone(), tied))
    want = float(torch.sqrt(torch.linalg.norm(g_first.double()) ** 2 + torch.linalg.norm(g_tied.double()) ** 2))
    assert _norm(mesh, pairs) == pytest.approx(want, rel=RTOL)


@pytest.mark.every_size  # the pieces each rank holds change with the world size
@pytest.mark.mpi(min_size=2)
def test_loss_is_the_global_token_mean(world, make_config, pm):
    """The loss rides the same all-reduce: sum over ranks of loss sums over their tokens."""
    n, rank = world.Get_size(), world.Get_rank()
    mesh = _mesh(world, make_config, pm, dp=-1)
    tokens = rank + 1  # uneven on purpose
    _, mean = reduce_step([], torch.tensor(2.0 * rank * tokens), tokens, mesh, torch.device("cpu"))
    want = sum(2.0 * r * (r + 1) for r in range(n)) / sum(r + 1 for r in range(n))
    assert float(mean) == pytest.approx(want, rel=1e-6)


def test_local_share_divides_by_replicas():
    """One process: a piece held by 4 ranks contributes a quarter of its square."""
    spec = replicated_spec("w", (2, 2))
    g = torch.full((2, 2), 2.0)
    share = local_square_sum([(g, spec)], {"tp": 0, "cp": 0, "ep": 0, "dp": 0, "pp": 0},
                             {"tp": 1, "cp": 1, "ep": 1, "dp": 4, "pp": 1}, torch.device("cpu"))
    assert float(share) == 16.0 / 4
