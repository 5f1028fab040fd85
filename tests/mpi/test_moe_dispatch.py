"""The token path at ep = the world size against one plain expression of all
ranks' tokens: each token's sum of its experts' outputs times its router
weights, forward and the gradients of the tokens and of the weights, for
each way the experts' results reach the combine: one run per (source,
expert) as the layer's experts give them (joined into the buffer the
combine sums from), ``dispatch``'s in-place buffer (identity experts, as
the bench runs), and a tensor of their own (its own rows copied in front
of the returned ones); with and without dropped assignments.

Tolerance (fp32): 1e-6 absolute and relative: the combine sums a token's two
products, and the weights' gradient its row's dot product, in another order
than the expression (one or two roundings of values up to about 10).
"""
from __future__ import annotations

import pytest
import torch

from hpctrain_moe import dispatch as D
from parity import agreed_config

N, K, DIM, E = 24, 2, 8, 16  # 2 experts per rank at 8 ranks: "first rank only" picks K of its own
TOL = 1e-6


def _scale(e: torch.Tensor) -> torch.Tensor:
    """The "expert" e multiplies its rows by 1 + e / 8 (so the results tell the experts apart)."""
    return 1.0 + e.to(torch.float32) / 8


def _inputs(rank: int, drop: bool, first_rank_only: bool = False, local: int = E):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, DIM, generator=g)
    w = torch.rand(N, K, generator=g)
    choices = local if first_rank_only else E  # the first rank holds experts [0, local)
    e = torch.stack([torch.randperm(choices, generator=g)[:K] for _ in range(N)])
    keep = (torch.rand(N, K, generator=g) > 0.3) if drop else None
    probe = torch.randn(N, DIM, generator=g)
    return x, w, e, keep, probe


def _expected(rank: int, drop: bool, identity: bool, first_rank_only: bool, local: int):
    x, w, e, keep, probe = _inputs(rank, drop, first_rank_only, local)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    scale = torch.ones(N, K) if identity else _scale(e)
    mask = torch.ones(N, K) if keep is None else keep.float()
    out = ((w * scale * mask).unsqueeze(-1) * x.unsqueeze(1)).sum(1)
    return (out.detach(),) + torch.autograd.grad((out * probe).sum(), (x, w))


def _ours(group, rank: int, drop: bool, form: str, first_rank_only: bool):
    local = E // group.size
    x, w, e, keep, probe = _inputs(rank, drop, first_rank_only, local)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    plan = D.plan_dispatch(e, w, keep, E, group)
    first = group.rank * local
    if form == "runs":
        rows = D.dispatch(x, plan, group)
        parts, at = [], 0
        for expert, n in plan.segments:
            parts.append(rows[at:at + n] * float(_scale(torch.tensor(first + expert))))
            at += n
        out = D.combine(parts, plan, group, N)
    elif form == "in place":
        out = D.combine(D.dispatch(x, plan, group, experts_in_place=True), plan, group, N)
    else:
        out = D.combine(D.dispatch(x, plan, group).clone(), plan, group, N)
    return (out.detach(),) + torch.autograd.grad((out * probe).sum(), (x, w))


def _ep_group(world, pm):
    from hpctrain.bootstrap import with_device
    from hpctrain.run import build_mesh

    n = world.Get_size()
    cfg = agreed_config(pm, "model=tiny-moe", f"model.moe.num_experts={E}", "trainer.device=cpu",
                        f"parallel.ep={n}", f"trainer.global_batch_size={n}", "trainer.micro_batch_size=1")
    group = build_mesh(cfg, with_device("cpu"), pm).group("ep")
    assert group.size == n
    return group


@pytest.mark.every_size  # ep is the world: every rank's exchange has world-size - 1 peers
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("routing", ["random", "first rank only"])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("form", ["runs", "in place", "own tensor"])
def test_token_path_equals_the_plain_expression(world, pm, form, drop, routing):
    group = _ep_group(world, pm)
    only_first = routing == "first rank only"
    got = _ours(group, world.Get_rank(), drop, form, only_first)
    want = _expected(world.Get_rank(), drop, form != "runs", only_first, E // group.size)
    for name, a, b in zip(("output", "token gradient", "weight gradient"), got, want):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m, name=name: f"{form}, {name}: {m}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["runs", "in place"])
def test_the_combine_keeps_only_what_its_backward_reads(world, pm, form):
    """Saved for backward: the rows summed (this rank's own results and the
    returned ones, in the in-place buffer itself for that form) and the
    weights; not the results sent to other ranks."""
    group = _ep_group(world, pm)
    x, w, e, keep, _ = _inputs(world.Get_rank(), False)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    plan = D.plan_dispatch(e, w, keep, E, group)
    rows = D.dispatch(x, plan, group, experts_in_place=form == "in place")
    runs = list(rows.split([n for _, n in plan.segments])) if form == "runs" else rows
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        D.combine(runs, plan, group, N)
    kept_rows = [t for t in saved if t.dim() == 2]
    assert len(kept_rows) == 1 and kept_rows[0].shape == (plan.own_rows + plan.returned_rows, DIM)
    storage = kept_rows[0].untyped_storage()
    if form == "in place":  # summed where dispatch put them, behind the rows sent
        assert plan.rows_buffer is not None
        assert storage.data_ptr() == plan.rows_buffer.untyped_storage().data_ptr()
    else:  # a buffer of exactly those rows
        assert storage.nbytes() == kept_rows[0].numel() * kept_rows[0].element_size()


@pytest.mark.mpi(min_size=2)
def test_bfloat16_runs(world, pm):
    """The runs joined and summed in bf16: within bf16 rounding of the fp32 expression."""
    group = _ep_group(world, pm)
    local = E // group.size
    x, w, e, _, probe = _inputs(world.Get_rank(), False)
    plan = D.plan_dispatch(e, w, None, E, group)
    rows = D.dispatch(x.to(torch.bfloat16), plan, group)
    parts, at = [], 0
    for expert, n in plan.segments:
        parts.append(rows[at:at + n] * float(_scale(torch.tensor(group.rank * local + expert))))
        at += n
    out = D.combine(parts, plan, group, N)
    assert out.dtype == torch.bfloat16
    want = _expected(world.Get_rank(), False, False, False, local)[0]
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
