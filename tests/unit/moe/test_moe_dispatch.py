"""The token path's parts against the plain expressions they replace: the
plan's one sort, the combine's own autograd Function and the gather into a
reused send buffer, with and without dropped assignments, forward and every
gradient (fp32: 1e-6 absolute; the weights' gradient sums its products in
another order)."""
from __future__ import annotations

import pytest
import torch

from hpctrain_moe import dispatch as D
from hpctrain_moe import native

N, K, DIM, E = 48, 2, 16, 8


def _plain(x, e, w, keep):
    tok = torch.arange(x.shape[0]).repeat_interleave(K)
    fe, fw = e.reshape(-1), w.reshape(-1)
    if keep is not None:
        kept = keep.reshape(-1)
        tok, fe, fw = tok[kept], fe[kept], fw[kept]
    order = torch.argsort(fe, stable=True)
    tok, fw = tok[order], fw[order]
    rows = x[tok] * 1.5  # an "expert"
    out = torch.zeros_like(x).index_add(0, tok, rows * fw.unsqueeze(-1).to(x.dtype))
    return tok, fw, out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("drop", [False, True])
def test_plan_and_fused_combine_match_the_plain_expressions(dtype, tol, drop):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, DIM, generator=g).requires_grad_()
    logits = torch.randn(N, E, generator=g).requires_grad_()
    keep = (torch.rand(N, K, generator=g) > 0.3) if drop else None

    def run(fused):
        w, e = torch.topk(logits.softmax(-1), K)
        xx = x.to(dtype)
        if fused:
            plan = D.plan_dispatch(e, w, keep, E, None)
            out = D.combine(D.dispatch(xx, plan, None) * 1.5, plan, None, N)
            tok, fw = plan.token, plan.weight
        else:
            tok, fw, out = _plain(xx, e, w, keep)
        grads = torch.autograd.grad((out.float() ** 2).sum(), (x, logits))
        return tok, fw, out, grads

    tok, fw, out, grads = run(True)
    rtok, rfw, rout, rgrads = run(False)
    assert torch.equal(tok, rtok) and torch.equal(fw, rfw)
    torch.testing.assert_close(out, rout, atol=tol, rtol=0)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol * 10)


def test_the_send_buffer_is_reused_per_shape_and_the_cache_stays_small():
    like = torch.zeros(1)
    first = D._send_buffer((2 * N, DIM), like)
    assert D._send_buffer((2 * N, DIM), like).data_ptr() == first.data_ptr()  # the same memory, not new pages
    other = D._send_buffer((N, DIM), like)
    assert other.data_ptr() != first.data_ptr() and other.shape == (N, DIM)
    for rows in range(3, 3 + 2 * D._MAX_SEND_BUFFERS):
        D._send_buffer((rows, DIM), like)
    assert len(D._send_buffers) <= D._MAX_SEND_BUFFERS


def test_no_tokens():
    plan = D.plan_dispatch(torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K), None, E, None)
    assert D.combine(D.dispatch(torch.zeros(0, DIM), plan, None), plan, None, 0).shape == (0, DIM)


def test_the_c_plan_is_built_here():
    """The suite's machine has a C compiler (scripts/setup.sh installs gcc): the C plan must
    load, or the comparison below would compare torch with itself."""
    assert native.library() is not None, native.cache_dir()


def _both_plans(experts, keep, num_experts, own_experts):
    out = []
    for lib in (native.library(), None):
        counts = torch.full((num_experts,), -7, dtype=torch.long)  # every entry must be written
        out.append((D._index_plan(experts, keep, num_experts, own_experts, counts, lib), counts))
    return out


@pytest.mark.parametrize("num_experts", [8, 300])
@pytest.mark.parametrize("drop", [False, True])
def test_the_c_and_torch_index_paths_agree(num_experts, drop):
    """The plan's integer work runs in C on CPU and in torch elsewhere: the same send
    order, tokens, combine bags, offsets, kept slots and counts, for every own-expert range."""
    g = torch.Generator().manual_seed(5)
    experts = torch.randint(0, num_experts, (N, K), generator=g)
    keep = (torch.rand(N, K, generator=g) > 0.3) if drop else None
    q = num_experts // 4
    for own in [(0, num_experts), (0, q), (q, 2 * q), (3 * q, num_experts)]:
        (c_plan, c_counts), (t_plan, t_counts) = _both_plans(experts, keep, num_experts, own)
        assert torch.equal(c_counts, t_counts)
        assert torch.equal(c_counts, torch.bincount(experts[keep] if drop else experts.reshape(-1),
                                                    minlength=num_experts))
        assert (c_plan[4] is None) == (t_plan[4] is None) == (not drop)
        for a, b in zip(c_plan, t_plan):
            assert a is None or torch.equal(a, b)
    order, tok, bag, offsets, kept = c_plan
    ids = experts.reshape(-1) if kept is None else experts.reshape(-1)[kept]
    assert torch.equal(order, torch.argsort(ids, stable=True))
    slots = torch.arange(N * K) if kept is None else kept
    assert torch.equal(tok, slots[order] // K)
    assert torch.equal(offsets[1:] - offsets[:-1], keep.sum(1) if drop else torch.full((N,), K))
    a, b = int(c_counts[:3 * q].sum()), len(order)  # the last own range: own rows at the end of the send order
    combine_rows = torch.cat([order[a:b], order[:a]])  # own rows first, then the rest in send order
    assert torch.equal(combine_rows[bag], torch.arange(len(order)))  # the bags list each slot's combine row


@pytest.mark.parametrize("c_plan", [True, False])
@pytest.mark.parametrize("bad", [-1, E, 256 + 1])
def test_expert_ids_outside_the_experts_are_refused(bad, c_plan):
    """An id out of range must not index past the counts (C) or become another expert;
    torch's path refuses them too (negative ones in bincount itself)."""
    experts = torch.zeros(N, K, dtype=torch.long)
    experts[3, 1] = bad
    counts = torch.empty(E, dtype=torch.long)
    with pytest.raises((ValueError, RuntimeError), match="outside|negative"):
        D._index_plan(experts, None, E, (0, E), counts, native.library() if c_plan else None)
    if c_plan:
        with pytest.raises(ValueError, match="outside"):
            D.plan_dispatch(experts, torch.ones(N, K), None, E, None)
