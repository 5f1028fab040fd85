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

N, K, DIM, E = 24, 2, 8, 8
TOL = 1e-6


def _scale(e: torch.Tensor) -> torch.Tensor:
    """The "expert" e multiplies its rows by 1 + e / 8 (so the results tell the experts apart)."""
    return 1.0 + e.to(torch.float32) / 8


def _inputs(rank: int, drop: bool):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, DIM, generator=g)
    w = torch.rand(N, K, generator=g)
    e = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    keep = (torch.rand(N, K, generator=g) > 0.3) if drop else None
    probe = torch.randn(N, DIM, generator=g)
    return x, w, e, keep, probe


def _expected(rank: int, drop: bool, identity: bool):
    x, w, e, keep, probe = _inputs(rank, drop)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    scale = torch.ones(N, K) if identity else _scale(e)
    mask = torch.ones(N, K) if keep is None else keep.float()
    out = ((w * scale * mask).unsqueeze(-1) * x.unsqueeze(1)).sum(1)
    return (out.detach(),) + torch.autograd.grad((out * probe).sum(), (x, w))


def _ours(group, rank: int, drop: bool, form: str):
    x, w, e, keep, probe = _inputs(rank, drop)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    plan = D.plan_dispatch(e, w, keep, E, group)
    local = E // group.size
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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("form", ["runs", "in place", "own tensor"])
def test_token_path_equals_the_plain_expression(world, pm, form, drop):
    from hpctrain.bootstrap import with_device
    from hpctrain.config import compose_resolved
    from hpctrain.run import build_mesh

    n = world.Get_size()
    cfg = compose_resolved(("model=tiny-moe", f"model.moe.num_experts={E}", "trainer.device=cpu",
                            f"parallel.ep={n}", f"trainer.global_batch_size={n}", "trainer.micro_batch_size=1"), pm)
    group = build_mesh(cfg, with_device("cpu"), pm).group("ep")
    assert group.size == n
    got = _ours(group, world.Get_rank(), drop, form)
    want = _expected(world.Get_rank(), drop, identity=form != "runs")
    for name, a, b in zip(("output", "token gradient", "weight gradient"), got, want):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m, name=name: f"{form}, {name}: {m}")
