"""The chunk-pair attention of context parallelism, in one process: for
every cp rank of a zigzag (and a contiguous) layout, merging the rank's
queries' partial results over every key chunk of the sequence gives the
rows of causal softmax attention over the whole sequence (torch's sdpa),
and the chunk-pair backward gives the same dQ, dK, dV (fp32: 1e-5
relative plus 1e-6 of the largest element; block sums reassociate).
Grouped-query attention: 4 query heads over 2 key/value heads."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hpctrain.data.sequence import SequenceLayout as Layout

from hpctrain_cp.blocks import block_backward, block_forward, expand_kv, merge, pair_kind, reduce_kv

B, H, HK, T, D = 2, 4, 2, 24, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, T, D, generator=g, requires_grad=True) for h in (H, HK, HK)]


def _rank_rows(layout: Layout, rank: int, chunk: int) -> torch.Tensor:
    return layout.positions(rank, chunk)


def _rank_forward(q, k, v, layout, rank, chunk, scale):
    """This rank's output and lse from every key chunk of the sequence."""
    rows = _rank_rows(layout, rank, chunk)
    qr = q[:, :, rows].float()
    kx, vx = expand_kv(k.float(), H), expand_kv(v.float(), H)
    outs, lses = [], []
    for i, a in enumerate(layout.chunks[rank]):
        out = lse = None
        for b in range(T // chunk):
            kind = pair_kind(a, b)
            if kind is None:
                continue
            o, o_lse = block_forward(qr[:, :, i * chunk:(i + 1) * chunk], kx[:, :, b * chunk:(b + 1) * chunk],
                                     vx[:, :, b * chunk:(b + 1) * chunk], scale, kind == "causal")
            out, lse = merge(out, lse, o, o_lse)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@pytest.fixture(params=[True, False], ids=["fused", "matmul"])
def fused(request, monkeypatch):
    """Both paths of a chunk pair: the CPU flash kernel and the plain products."""
    from hpctrain_cp import blocks

    monkeypatch.setattr(blocks, "FUSED", request.param)
    return request.param


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_chunk_pairs_equal_causal_attention(cp, kind, fused):
    q, k, v = _inputs()
    layout = getattr(Layout, kind)(cp)
    chunk, scale = T // (2 * cp), 1.0 / math.sqrt(D)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(want)
    want.backward(dout)
    ref = [t.grad.clone() for t in (q, k, v)]
    dq, dk, dv = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
    kx, vx = expand_kv(k.detach(), H), expand_kv(v.detach(), H)
    for rank in range(cp):
        rows = _rank_rows(layout, rank, chunk)
        out, lse = _rank_forward(q.detach(), k.detach(), v.detach(), layout, rank, chunk, scale)
        torch.testing.assert_close(out, want.detach()[:, :, rows], rtol=1e-5, atol=1e-6)
        g = dout[:, :, rows]
        delta = (g * out).sum(-1)
        for i, a in enumerate(layout.chunks[rank]):
            qs = slice(i * chunk, (i + 1) * chunk)
            for b in range(T // chunk):
                kind_ = pair_kind(a, b)
                if kind_ is None:
                    continue
                ks = slice(b * chunk, (b + 1) * chunk)
                g_q, g_k, g_v = block_backward(q.detach()[:, :, rows][:, :, qs], kx[:, :, ks], vx[:, :, ks], scale,
                                               kind_ == "causal", lse[:, :, qs], g[:, :, qs], delta[:, :, qs],
                                               out[:, :, qs])
                dq[:, :, rows[qs]] += g_q
                dk[:, :, ks] += g_k
                dv[:, :, ks] += g_v
    for got, exp in zip((dq, reduce_kv(dk, HK), reduce_kv(dv, HK)), ref):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6 * float(exp.abs().max()))


def test_zigzag_balances_the_work_and_contiguous_does_not():
    """Chunk pairs each rank computes (its causal work) over the whole sequence."""
    for cp in (2, 4, 8):
        chunks = 2 * cp

        def work(layout, cp=cp, chunks=chunks):
            return [sum(1 for a in layout.chunks[r] for b in range(chunks) if pair_kind(a, b)) for r in range(cp)]
        zig, flat = work(Layout.zigzag(cp)), work(Layout.contiguous(cp))
        assert len(set(zig)) == 1  # every rank the same
        assert max(flat) / min(flat) == pytest.approx((4 * cp - 1) / 3)  # last rank vs first
