"""Differentiable collectives (``hpctrain.comm.differentiable``): forward and
backward of each one equal the one-process computation it stands for, on
the torch (gloo), mpi and hier backends, over groups of several shapes.

How. Every tensor is built from (tag, world rank) by ``_make``, so each rank
rebuilds every group member's inputs and upstream gradients locally and
computes the logical result with plain torch, no communication. Upstream
gradients are random and differ per rank (``(out * w_r).sum()``), so a
reduction over the wrong ranks, a wrong chunk or a swapped split cannot
pass.

Groups. One mesh per backend, ``tp=2 x dp=n/2`` in ``dp-tp`` order (so a
``tp`` pair is ranks ``(r, r + n/2)``, on different emulated nodes), made
once per module. Its groups:
- ``world``: every rank (group rank = world rank; two-level under hier
  at 4 and 8 ranks, see conftest.py);
- ``tp``: size 2, group rank != world rank for most ranks;
- ``dp``: size n/2 (at 8 ranks ranks 0-3 / 4-7: two nodes of two, so
  hier runs two-level on a sub-group; at 2 ranks a group of one).
A group of one with no communicator at all checks that size 1 is the
identity both ways and calls nothing.

Tolerances.
- Pure data movement (copy, scatter, gather, all-to-all, ring shift, and
  the movement half of every reduction): ``torch.equal``.
- fp32 sums over the group (all-reduce, reduce-scatter) of random data:
  the backend adds the k = group-size terms in an order of its own (hier:
  within nodes first). Any order of k fp32 additions is within
  ``(k-1) u sum|t|`` of the exact sum (u = 2^-24; Higham, gamma_{k-1}), so
  each element must be within ``k u sum|t_i|`` of the float64 sum of the
  very terms the ranks contributed (those are rebuilt bit for bit: same
  CPU ops on the same data). Cancellation is allowed for: the bound is on
  sum|t|, not on |sum t|.
- The same reductions on integer-valued fp32 data (every partial sum exact):
  ``torch.equal``, whatever the order.
- bf16: the backends reduce 16-bit floats in fp32 and round once. Inputs
  are multiples of 2^-7 in [1, 2), so the fp32 sum of <= 8 of them is exact
  and the result must equal ``(float32 sum).to(bfloat16)`` bit for bit
  (tolerance 0; a backend that rounded after each addition would differ).
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import List, Optional, Sequence

import pytest
import torch
from mpi4py import MPI

from hpctrain.bootstrap import get_runtime
from hpctrain.comm.differentiable import (
    all_to_all,
    copy_to_region,
    exchange_counts,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    ring_shift,
    scatter_to_region,
    scatter_to_sequence_region,
)
from hpctrain.errors import CommError
from hpctrain.mesh import Group, Mesh
from hpctrain.plugins import get_manager
from hpctrain.run import backend_factory

from conftest import compose_config

pytestmark = pytest.mark.every_size  # the world size changes what is tested

BACKENDS = ["torch", "mpi", "hier"]
GROUP_AXES = {"world": ("tp", "dp"), "tp": "tp", "dp": "dp"}
U32 = 2.0 ** -24


# -- inputs every rank can rebuild ----------------------------------------------
def _make(tag: str, rank: int, shape: Sequence[int], kind: str = "random",
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s tensor ``tag`` (``rank=-1``: one tensor shared by all).
    kind ``random``: standard normal; ``integer``: integers in [-8, 8]
    (exact sums); ``bf16``: multiples of 2^-7 in [1, 2) (exact in bf16)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    shape = tuple(shape)
    if kind == "random":
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    if kind == "integer":
        return torch.randint(-8, 9, shape, generator=gen).to(dtype)
    if kind == "bf16":
        return (1 + torch.randint(0, 128, shape, generator=gen).double() / 128).to(dtype)
    raise ValueError(kind)


def _each(tag: str, group: Group, shape, kind: str = "random", dtype=torch.float32) -> List[torch.Tensor]:
    """``tag`` of every member, in group-rank order."""
    return [_make(tag, r, shape, kind, dtype) for r in group.ranks]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _assert_sum(got: torch.Tensor, terms: Sequence[torch.Tensor], exact: bool, what: str) -> None:
    """``got`` is the sum of ``terms`` as a collective computes it (see the
    module docstring for the bound)."""
    assert got.dtype == terms[0].dtype and got.shape == terms[0].shape, what
    if exact:
        expected = torch.stack([t.double() for t in terms]).sum(0).to(terms[0].dtype)
        assert torch.equal(got, expected), f"{what}: not the exact sum"
        return
    exact_sum = torch.stack([t.double() for t in terms]).sum(0)
    bound = len(terms) * U32 * torch.stack([t.double().abs() for t in terms]).sum(0)
    err = (got.double() - exact_sum).abs()
    assert bool((err <= bound).all()), \
        f"{what}: error {float((err - bound).max()):.3g} over the bound k*u*sum|t| (max err {float(err.max()):.3g})"


# -- groups ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def meshes():
    """``meshes(backend)``: a tp=2 x dp=n/2 mesh (dp-tp order) whose groups
    run on ``backend``, made once per module (on first use: every rank runs
    the tests in the same order, so every rank creates it at the same point)."""
    made = {}

    def get(backend: str) -> Mesh:
        if backend not in made:
            world = MPI.COMM_WORLD
            cfg = compose_config(f"comm.backend={backend}")
            mesh = Mesh({"tp": 2, "dp": -1}, world.Get_rank(), world.Get_size(), order="dp-tp-cp-ep-pp",
                        rank_nodes=get_runtime().rank_nodes or None)
            mesh.attach_backends(backend_factory(cfg, get_manager(), torch.device("cpu")))
            made[backend] = mesh
        return made[backend]

    return get


GROUP_PARAMS = [(b, g) for b in BACKENDS for g in GROUP_AXES]


@pytest.fixture(params=GROUP_PARAMS, ids=[f"{b}-{g}" for b, g in GROUP_PARAMS])
def group(request, meshes) -> Group:
    backend, name = request.param
    grp = meshes(backend).group(GROUP_AXES[name])
    expected_size = {"world": MPI.COMM_WORLD.Get_size(), "tp": 2, "dp": MPI.COMM_WORLD.Get_size() // 2}[name]
    assert grp.size == expected_size and grp.ranks[grp.rank] == MPI.COMM_WORLD.Get_rank()
    if grp.size > 1:
        assert grp.communicator().backend == ("gloo" if backend == "torch" else backend)
    return grp


@pytest.fixture
def world_mpi(meshes) -> Group:
    return meshes("mpi").group(GROUP_AXES["world"])


class _NoCalls:
    """A communicator that fails any use: proves a path calls nothing."""

    def __getattr__(self, name):
        raise AssertionError(f"communicator used ({name}) where the collective must be the identity")


def _solo_group() -> Group:
    me, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return Group(name="solo", ranks=(me,), rank=0, partition=tuple((r,) for r in range(n)), comm=_NoCalls())


def _shape_with(base: Sequence[int], dim: int, size: int) -> List[int]:
    shape = list(base)
    shape[dim] = size
    return shape


DIMS = [0, 1, -1, -2]  # on 3-d tensors: leading, middle, last (negative), middle (negative)
BASE = (3, 4, 2)


# -- copy / reduce ---------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["random", "integer"])
def test_copy_to_region(group, kind):
    """Every rank uses the same x with its own loss L_r = sum(y*y*w_r):
    fwd identity; x.grad = sum_r dL_r/dx (all-reduce)."""
    me = group.rank
    x_val = _make("copy-x", -1, (3, 5), kind)
    ws = _each("copy-w", group, (3, 5), kind)
    x = _leaf(x_val)
    y = copy_to_region(x, group)
    assert torch.equal(y, x_val)
    (y * y * ws[me]).sum().backward()
    terms = []
    for w in ws:  # the one-process computation: each rank's loss on the same x
        xr = _leaf(x_val)
        (xr * xr * w).sum().backward()
        terms.append(xr.grad)
    _assert_sum(x.grad, terms, exact=kind == "integer", what="copy_to_region grad")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["random", "integer"])
def test_reduce_from_region(group, kind):
    """fwd sum_r x_r on every rank; bwd each rank's upstream gradient unchanged."""
    me = group.rank
    xs = _each("reduce-x", group, (4, 3), kind)
    x = _leaf(xs[me])
    out = reduce_from_region(x, group)
    _assert_sum(out, xs, exact=kind == "integer", what="reduce_from_region fwd")
    assert torch.equal(x.detach(), xs[me]), "the input was changed in place"
    w = _make("reduce-w", group.ranks[me], (4, 3), kind)
    (out * w).sum().backward()
    assert torch.equal(x.grad, w)


# -- scatter / gather along a dim ----------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dim", DIMS + [None], ids=[f"dim{d}" for d in DIMS] + ["default"])
def test_scatter_to_region(group, dim):
    """x replicated; fwd own chunk of dim; bwd x.grad = the ranks' upstream
    gradients concatenated along dim (all-gather). Default dim: -1."""
    g, me = group.size, group.rank
    d = -1 if dim is None else dim
    x_val = _make(f"scatter-x{d}", -1, _shape_with(BASE, d, 2 * g))
    x = _leaf(x_val)
    out = scatter_to_region(x, group) if dim is None else scatter_to_region(x, group, dim)
    assert torch.equal(out, x_val.chunk(g, d)[me])
    ws = _each(f"scatter-w{d}", group, out.shape)
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, torch.cat(ws, d))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dim", DIMS + [None], ids=[f"dim{d}" for d in DIMS] + ["default"])
def test_gather_from_region(group, dim):
    """fwd the members' x_r concatenated along dim; bwd this rank's chunk of
    its upstream gradient. Default dim: -1."""
    g, me = group.size, group.rank
    d = -1 if dim is None else dim
    xs = _each(f"gather-x{d}", group, _shape_with(BASE, d, 2))
    x = _leaf(xs[me])
    out = gather_from_region(x, group) if dim is None else gather_from_region(x, group, dim)
    assert torch.equal(out, torch.cat(xs, d))
    w = _make(f"gather-w{d}", group.ranks[me], out.shape)
    (out * w).sum().backward()
    assert torch.equal(x.grad, w.chunk(g, d)[me])


SEQ_DIMS = [None, 0, -1]
SEQ_IDS = ["default", "dim0", "dim-1"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dim", SEQ_DIMS, ids=SEQ_IDS)
def test_scatter_to_sequence_region(group, dim):
    """As scatter_to_region, default dim 1."""
    g, me = group.size, group.rank
    d = 1 if dim is None else dim
    x_val = _make(f"sscatter-x{d}", -1, _shape_with(BASE, d, 2 * g))
    x = _leaf(x_val)
    out = scatter_to_sequence_region(x, group) if dim is None else scatter_to_sequence_region(x, group, dim)
    assert torch.equal(out, x_val.chunk(g, d)[me])
    ws = _each(f"sscatter-w{d}", group, out.shape)
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, torch.cat(ws, d))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["random", "integer"])
@pytest.mark.parametrize("dim", SEQ_DIMS, ids=SEQ_IDS)
def test_gather_from_sequence_region(group, dim, kind):
    """fwd concatenation along dim (default 1); bwd reduce-scatter: each rank's
    upstream gradient differs, and x_r.grad = sum over ranks j of chunk r of
    w_j."""
    g, me = group.size, group.rank
    d = 1 if dim is None else dim
    xs = _each(f"sgather-x{d}", group, _shape_with(BASE, d, 2), kind)
    x = _leaf(xs[me])
    out = gather_from_sequence_region(x, group) if dim is None else gather_from_sequence_region(x, group, dim)
    assert torch.equal(out, torch.cat(xs, d))
    ws = _each(f"sgather-w{d}", group, out.shape, kind)
    (out * ws[me]).sum().backward()
    _assert_sum(x.grad, [w.chunk(g, d)[me] for w in ws], exact=kind == "integer",
                what="gather_from_sequence_region grad")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["random", "integer"])
@pytest.mark.parametrize("dim", SEQ_DIMS, ids=SEQ_IDS)
def test_reduce_scatter_to_sequence_region(group, dim, kind):
    """fwd chunk r of sum_j x_j along dim (default 1); bwd the ranks' upstream
    gradients concatenated along dim (all-gather)."""
    g, me = group.size, group.rank
    d = 1 if dim is None else dim
    xs = _each(f"rs-x{d}", group, _shape_with(BASE, d, 2 * g), kind)
    x = _leaf(xs[me])
    out = reduce_scatter_to_sequence_region(x, group) if dim is None else \
        reduce_scatter_to_sequence_region(x, group, dim)
    _assert_sum(out, [t.chunk(g, d)[me] for t in xs], exact=kind == "integer",
                what="reduce_scatter_to_sequence_region fwd")
    assert torch.equal(x.detach(), xs[me]), "the input was changed in place"
    ws = _each(f"rs-w{d}", group, out.shape, kind)
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, torch.cat(ws, d))


# -- all-to-all --------------------------------------------------------------------------
def _a2a_splits(pattern: str, g: int) -> Optional[List[List[int]]]:
    """S[i][j]: rows group rank i sends group rank j."""
    if pattern in ("equal", "equal-none"):
        return [[2] * g for _ in range(g)]
    if pattern == "uneven":
        return [[(i + 2 * j) % 3 + (i == j) for j in range(g)] for i in range(g)]
    if pattern == "zero-rank":  # the last rank sends nothing, rank 0 receives nothing
        return [[0 if i == g - 1 or j == 0 else 1 + (i + 2 * j) % 3 for j in range(g)] for i in range(g)]
    if pattern == "all-zero":
        return [[0] * g for _ in range(g)]
    raise ValueError(pattern)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pattern", ["equal-none", "equal", "uneven", "zero-rank", "all-zero"])
def test_all_to_all(group, pattern):
    """Rows (3-d: each row 2x3) moved by S: rank me receives, in source
    order, block i->me of every rank i; bwd x.grad = for each destination j,
    the rows of j's upstream gradient that came from me."""
    g, me = group.size, group.rank
    S = _a2a_splits(pattern, g)
    col = lambda j: [S[i][j] for i in range(g)]  # noqa: E731
    in_splits = S[me]
    out_splits = exchange_counts(in_splits, group)
    assert out_splits == col(me)
    row = (2, 3)
    xs = [_make(f"a2a-x-{pattern}", group.ranks[i], (sum(S[i]),) + row) for i in range(g)]
    x = _leaf(xs[me])
    if pattern == "equal-none":
        out = all_to_all(x, group)
    else:
        out = all_to_all(x, group, out_splits, in_splits)
    assert torch.equal(out, torch.cat([xs[i].split(S[i])[me] for i in range(g)]))
    ws = [_make(f"a2a-w-{pattern}", group.ranks[j], (sum(col(j)),) + row) for j in range(g)]
    assert out.shape == ws[me].shape
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, torch.cat([ws[j].split(col(j))[me] for j in range(g)]))


@pytest.mark.mpi(min_size=2)
def test_all_to_all_equal_send_uneven_receive(world_mpi):
    """input_splits=None (this rank sends k_r rows to every rank: k_0 = 1, the
    others 2) with the output_splits from exchange_counts: a legal forward.
    Its backward must give x.grad of x's shape (g*k_r rows), not
    sum(output_splits) rows (a bug found here once)."""
    group = world_mpi
    g, me = group.size, group.rank
    k = [1] + [2] * (g - 1)
    out_splits = exchange_counts([k[me]] * g, group)
    assert out_splits == k
    xs = [_make("a2a-mixed-x", group.ranks[i], (g * k[i], 3)) for i in range(g)]
    x = _leaf(xs[me])
    out = all_to_all(x, group, output_splits=out_splits)
    assert torch.equal(out, torch.cat([xs[i].split(k[i])[me] for i in range(g)]))
    ws = [_make("a2a-mixed-w", group.ranks[j], (sum(k), 3)) for j in range(g)]
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, torch.cat([ws[j].split(k)[me] for j in range(g)]))


@pytest.mark.mpi(min_size=2)
def test_exchange_counts(group):
    g, me = group.size, group.rank
    counts = [(7 * group.ranks[me] + 3 * j) % 5 for j in range(g)]  # uneven, with zeros, per world rank
    assert exchange_counts(counts, group) == [(7 * group.ranks[i] + 3 * me) % 5 for i in range(g)]
    if g > 1:
        with pytest.raises(CommError, match=rf"exchange_counts: {g + 1} counts for group .* of size {g}"):
            exchange_counts([1] * (g + 1), group)


# -- ring shift --------------------------------------------------------------------------
SHIFTS = ["1", "-1", "2", "g+1", "g", "-2g"]


def _shift_value(spec: str, g: int) -> int:
    return {"1": 1, "-1": -1, "2": 2, "g+1": g + 1, "g": g, "-2g": -2 * g}[spec]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spec", SHIFTS)
def test_ring_shift(group, spec):
    """fwd rank r gets x_{r-shift}; bwd x_r.grad = the upstream gradient of
    rank r+shift (mod g). A shift that is a multiple of g is the identity."""
    g, me = group.size, group.rank
    s = _shift_value(spec, g)
    xs = _each(f"ring-x{spec}", group, (3, 4))
    ws = _each(f"ring-w{spec}", group, (3, 4))
    x = _leaf(xs[me])
    out = ring_shift(x, group, s)
    assert torch.equal(out, xs[(me - s) % g])
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, ws[(me + s) % g])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spec", ["g", "-2g", "0"])
def test_ring_shift_by_a_multiple_of_the_size_calls_nothing(group, spec):
    """A shift by a multiple of the group size is the identity both ways and
    does not touch the communicator (which here fails on any use)."""
    g, me = group.size, group.rank
    s = 0 if spec == "0" else _shift_value(spec, g)
    silent = dataclasses.replace(group, comm=_NoCalls())
    x = _leaf(_make("ring-id-x", group.ranks[me], (2, 3)))
    out = ring_shift(x, silent, s)
    w = _make("ring-id-w", group.ranks[me], (2, 3))
    (out * w).sum().backward()
    assert torch.equal(out, x.detach()) and torch.equal(x.grad, w)


# -- size-1 group, bf16, layouts -------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_group_of_one_is_the_identity_both_ways():
    """Every function on a group of one returns its input and passes the
    gradient through; its communicator fails on any use, so nothing is called."""
    solo = _solo_group()
    me = MPI.COMM_WORLD.Get_rank()
    calls = [
        ("copy_to_region", lambda t: copy_to_region(t, solo)),
        ("reduce_from_region", lambda t: reduce_from_region(t, solo)),
        ("scatter_to_region", lambda t: scatter_to_region(t, solo, 1)),
        ("gather_from_region", lambda t: gather_from_region(t, solo, -1)),
        ("scatter_to_sequence_region", lambda t: scatter_to_sequence_region(t, solo)),
        ("gather_from_sequence_region", lambda t: gather_from_sequence_region(t, solo)),
        ("reduce_scatter_to_sequence_region", lambda t: reduce_scatter_to_sequence_region(t, solo, 0)),
        ("all_to_all", lambda t: all_to_all(t, solo, [3], [3])),
        ("all_to_all(None)", lambda t: all_to_all(t, solo)),
        ("ring_shift", lambda t: ring_shift(t, solo, 1)),
    ]
    for name, fn in calls:
        x = _leaf(_make(f"solo-x-{name}", me, (3, 4, 2)))
        w = _make(f"solo-w-{name}", me, (3, 4, 2))
        out = fn(x)
        assert torch.equal(out, x.detach()), name
        (out * w).sum().backward()
        assert torch.equal(x.grad, w), name
    assert exchange_counts([5], solo) == [5]


@pytest.mark.mpi(min_size=2)
def test_bf16_reductions_round_once(group):
    """bf16 through the three reductions: reduce_from_region fwd
    (all-reduce), copy_to_region bwd (all-reduce), gather_from_sequence_region
    bwd (reduce-scatter). Exact: see the module docstring."""
    g, me = group.size, group.rank
    bf = torch.bfloat16

    def round_once(terms):
        return torch.stack([t.float() for t in terms]).sum(0).to(bf)

    xs = _each("bf-reduce-x", group, (5, 3), "bf16", bf)
    x = _leaf(xs[me])
    out = reduce_from_region(x, group)
    assert out.dtype == bf and torch.equal(out, round_once(xs))
    w = _make("bf-reduce-w", group.ranks[me], (5, 3), "bf16", bf)
    (out * w).sum().backward()
    assert torch.equal(x.grad, w)

    ws = _each("bf-copy-w", group, (5, 3), "bf16", bf)
    x = _leaf(_make("bf-copy-x", -1, (5, 3), "bf16", bf))
    y = copy_to_region(x, group)
    (y * ws[me]).sum().backward()  # dL_r/dx = w_r exactly
    assert x.grad.dtype == bf and torch.equal(x.grad, round_once(ws))

    xs = _each("bf-sg-x", group, (2, 2, 3), "bf16", bf)
    x = _leaf(xs[me])
    out = gather_from_sequence_region(x, group)
    ws = _each("bf-sg-w", group, out.shape, "bf16", bf)
    (out * ws[me]).sum().backward()
    assert torch.equal(x.grad, round_once([w.chunk(g, 1)[me] for w in ws]))


@pytest.mark.mpi(min_size=2)
def test_strided_inputs_and_expanded_gradients(group):
    """Inputs that are non-contiguous views (a transpose) and upstream
    gradients of stride 0 (what ``out.sum().backward()`` sends back): every
    function must read them by value, not by memory layout."""
    g, me = group.size, group.rank

    def strided(tag, rank, shape):  # a transposed view with the values of _make(tag, rank, shape)
        base = _make(tag, rank, shape).transpose(0, 2).contiguous().requires_grad_()
        view = base.transpose(0, 2)
        assert not view.is_contiguous()
        return base, view

    def check(name, fn, x_val_of, expected_out, expected_grad):
        base, view = strided(*x_val_of)
        out = fn(view)
        assert torch.equal(out, expected_out), name
        out.sum().backward()  # upstream gradient: ones expanded, stride 0
        assert torch.equal(base.grad.transpose(0, 2), expected_grad), name

    shape = (2 * g, 3, 2)
    ones = torch.ones(shape)
    x_shared = _make("st-shared", -1, shape)
    xs = _each("st-x", group, shape)
    # copy: grad = sum of g ones = g (exact)
    check("copy_to_region", lambda t: copy_to_region(t, group), ("st-shared", -1, shape), x_shared,
          torch.full(shape, float(g)))
    check("reduce_from_region", lambda t: reduce_from_region(t, group), ("st-x", group.ranks[me], shape),
          reduce_from_region(xs[me].clone(), group), ones)  # the same as for a contiguous input
    check("scatter_to_region", lambda t: scatter_to_region(t, group, 0), ("st-shared", -1, shape),
          x_shared.chunk(g, 0)[me], ones)
    check("gather_from_region", lambda t: gather_from_region(t, group, 1), ("st-x", group.ranks[me], shape),
          torch.cat(xs, 1), ones)
    check("gather_from_sequence_region", lambda t: gather_from_sequence_region(t, group, 2),
          ("st-x", group.ranks[me], shape), torch.cat(xs, 2), torch.full(shape, float(g)))
    check("reduce_scatter_to_sequence_region", lambda t: reduce_scatter_to_sequence_region(t, group, 0),
          ("st-x", group.ranks[me], shape), reduce_scatter_to_sequence_region(xs[me].clone(), group, 0), ones)
    # (the two sums are compared with the contiguous-input result: their values are tested above)
    check("all_to_all", lambda t: all_to_all(t, group), ("st-x", group.ranks[me], shape),
          torch.cat([t.chunk(g, 0)[me] for t in xs]), ones)
    check("ring_shift", lambda t: ring_shift(t, group, 1), ("st-x", group.ranks[me], shape),
          xs[(me - 1) % g], ones)


# -- compositions: a tensor-parallel MLP equals the one-process MLP -------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_parallel_mlp_equals_one_process(group, sequence_parallel):
    """Y = relu(X @ W1) @ W2 with W1 split by columns and W2 by rows (Megatron
    MLP), loss sum(Y * U). Plain TP: copy_to_region -> local -> reduce_from_region.
    Sequence parallel: X and the loss split along the sequence (dim 1),
    gather_from_sequence_region -> local -> reduce_scatter_to_sequence_region.
    Integer-valued data keep every sum exact, so outputs and every gradient
    (X, this rank's W1 columns and W2 rows) equal the one-process ones bit for bit."""
    g, me = group.size, group.rank
    B, S, H, F = 2, 2 * g, 4, 3 * g
    X, W1, W2, U = (_make(t, -1, s, "integer") for t, s in
                    (("mlp-X", (B, S, H)), ("mlp-W1", (H, F)), ("mlp-W2", (F, H)), ("mlp-U", (B, S, H))))
    # one process
    Xr, W1r, W2r = _leaf(X), _leaf(W1), _leaf(W2)
    Yr = torch.relu(Xr @ W1r) @ W2r
    (Yr * U).sum().backward()
    # parallel
    W1p, W2p = _leaf(W1.chunk(g, 1)[me]), _leaf(W2.chunk(g, 0)[me])
    if sequence_parallel:
        Xp = _leaf(X.chunk(g, 1)[me])
        Y = reduce_scatter_to_sequence_region(torch.relu(gather_from_sequence_region(Xp, group) @ W1p) @ W2p, group)
        (Y * U.chunk(g, 1)[me]).sum().backward()
        assert torch.equal(Y, Yr.detach().chunk(g, 1)[me])
        assert torch.equal(Xp.grad, Xr.grad.chunk(g, 1)[me])
    else:
        Xp = _leaf(X)
        Y = reduce_from_region(torch.relu(copy_to_region(Xp, group) @ W1p) @ W2p, group)
        (Y * U).sum().backward()
        assert torch.equal(Y, Yr.detach())
        assert torch.equal(Xp.grad, Xr.grad)
    assert torch.equal(W1p.grad, W1r.grad.chunk(g, 1)[me])
    assert torch.equal(W2p.grad, W2r.grad.chunk(g, 0)[me])


# -- what goes on the wire ----------------------------------------------------------------------
DIRECTIONS = {  # function -> (call, ops of the forward, ops of the backward); each op one call
    "copy_to_region": (lambda t, g: copy_to_region(t, g), (), ("all_reduce",)),
    "reduce_from_region": (lambda t, g: reduce_from_region(t, g), ("all_reduce",), ()),
    "scatter_to_region": (lambda t, g: scatter_to_region(t, g, 0), (), ("all_gather",)),
    "gather_from_region": (lambda t, g: gather_from_region(t, g, 0), ("all_gather",), ()),
    "scatter_to_sequence_region": (lambda t, g: scatter_to_sequence_region(t, g, 0), (), ("all_gather",)),
    "gather_from_sequence_region": (lambda t, g: gather_from_sequence_region(t, g, 0), ("all_gather",),
                                    ("reduce_scatter",)),
    "reduce_scatter_to_sequence_region": (lambda t, g: reduce_scatter_to_sequence_region(t, g, 0),
                                          ("reduce_scatter",), ("all_gather",)),
    "all_to_all": (lambda t, g: all_to_all(t, g), ("all_to_all",), ("all_to_all",)),
    "ring_shift": (lambda t, g: ring_shift(t, g, 1), ("send",), ("send",)),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(DIRECTIONS))
def test_one_counted_collective_per_direction(group, name):
    """Each direction is exactly the one collective its docstring names (no
    hidden extra communication), and it goes through the group's counted
    communicator."""
    if group.size == 1:
        pytest.skip("a group of one has no counted communicator (see the group-of-one test)")
    call, want_fwd, want_bwd = DIRECTIONS[name]
    counter = group.communicator().counter

    def ops_of(step):
        calls, before = counter.calls, dict(counter.by_op)
        result = step()
        grown = tuple(sorted(op for op, b in counter.by_op.items() if b > before.get(op, 0.0)))
        return (counter.calls - calls, grown), result

    x = _leaf(_make("wire-x", group.ranks[group.rank], (2 * group.size, 3)))
    fwd, out = ops_of(lambda: call(x, group))
    bwd, _ = ops_of(lambda: out.sum().backward())
    assert fwd == (len(want_fwd), want_fwd) and bwd == (len(want_bwd), want_bwd), (fwd, bwd)


@pytest.mark.mpi(min_size=4)
def test_hier_runs_two_level_here(meshes):
    """The hier cases above exercise the two-level path, not only the flat
    fallback: the world at 4+ ranks and the dp group at 8+ ranks span
    several emulated nodes with the same number of ranks on each."""
    mesh = meshes("hier")
    n = MPI.COMM_WORLD.Get_size()
    assert mesh.group(GROUP_AXES["world"]).communicator().two_level
    if n >= 8:
        assert mesh.group("dp").communicator().two_level


# -- argument errors (raised on every rank before any communication) ---------------------------
@pytest.mark.mpi(min_size=2)
def test_uneven_dim_is_an_error(world_mpi):
    g = world_mpi.size
    x = torch.zeros(3, 2 * g + 1)
    with pytest.raises(CommError, match=rf"scatter over group .*: dim -1 of size {2 * g + 1} is not divisible"):
        scatter_to_region(x, world_mpi)
    with pytest.raises(CommError, match=rf"reduce-scatter over group .*: dim 1 of size {2 * g + 1} is not"):
        reduce_scatter_to_sequence_region(x, world_mpi)
    # the group is still in step
    assert torch.equal(reduce_from_region(torch.ones(2), world_mpi), torch.full((2,), float(g)))


@pytest.mark.mpi(min_size=2)
def test_all_to_all_needs_output_splits_when_input_splits_are_given(world_mpi):
    """Receive sizes cannot be known locally: every rank gets the same clear error, none waits."""
    g = world_mpi.size
    with pytest.raises(CommError, match="input_splits without output_splits.*exchange_counts"):
        all_to_all(torch.zeros(g, 2), world_mpi, input_splits=[1] * g)
