"""The token path's parts against the plain expressions they replace: the
plan's one sort, the combine's own autograd Function and the gather into a
reused send buffer, with and without dropped assignments, forward and every
gradient (fp32: 1e-6 absolute; the weights' gradient sums its products in
another order)."""
from __future__ import annotations

import pytest
import torch

from hpctrain_moe import dispatch as D

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


@pytest.mark.parametrize("num_experts", [8, 300])  # 8- and 16-bit expert ids
@pytest.mark.parametrize("drop", [False, True])
def test_the_numpy_and_torch_index_paths_agree(num_experts, drop):
    """The plan's integer work runs in numpy on CPU and in torch elsewhere: the same
    send order, tokens, combine bags, offsets and counts, for every own-row range."""
    g = torch.Generator().manual_seed(5)
    experts = torch.randint(0, num_experts, (N, K), generator=g)
    keep = (torch.rand(N, K, generator=g) > 0.3) if drop else None
    host = D._assignments(experts, keep, num_experts, host=True)
    device = D._assignments(experts, keep, num_experts, host=False)
    assert torch.equal(torch.from_numpy(host[0].astype("int64")), device[0])
    assert (host[1] is None) == (device[1] is None)
    if drop:
        assert torch.equal(torch.from_numpy(host[1]), device[1])
    assert torch.equal(host[2], device[2]) and host[3] == device[3]
    rows = len(host[0])
    for own in [(0, rows), (0, rows // 3), (rows // 3, rows // 2), (rows // 2, rows)]:
        for a, b in zip(D._orders(host[0], host[1], K, own), D._orders(device[0], device[1], K, own)):
            assert torch.equal(a, b)
    order, tok, bag = D._orders(host[0], host[1], K, (rows // 3, rows // 2))
    assert torch.equal(order, torch.argsort(device[0], stable=True))
    a, b = rows // 3, rows // 2
    combine_rows = torch.cat([order[a:b], order[:a], order[b:]])  # own rows first, then the rest in send order
    assert torch.equal(combine_rows[bag], torch.arange(rows))  # the bags list each slot's combine row


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("bad", [-1, E, 256 + 1])
def test_expert_ids_outside_the_experts_are_refused_not_wrapped(bad, host):
    """numpy's plan narrows the ids to 8 bits: an id out of range must not become another
    expert; torch's path refuses them too (negative ones in bincount itself)."""
    experts = torch.zeros(N, K, dtype=torch.long)
    experts[3, 1] = bad
    with pytest.raises((ValueError, RuntimeError), match="outside|negative"):
        D._assignments(experts, None, E, host)
    if host:
        with pytest.raises(ValueError, match="outside"):
            D.plan_dispatch(experts, torch.ones(N, K), None, E, None)
