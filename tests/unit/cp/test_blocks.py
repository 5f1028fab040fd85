"""The chunk-pair attention of context parallelism, in one process: for
every cp rank of a zigzag (and a contiguous) layout, merging the rank's
queries' partial results over every key chunk of the sequence gives the
rows of causal softmax attention over the whole sequence (torch's sdpa),
and the chunk-pair backward gives the same dQ, dK, dV (fp32: 1e-5
relative plus 1e-6 of the largest element; block sums reassociate).
Grouped-query attention: 4 query heads over 2 key/value heads.

With document masking (segment ids per token) the same holds against sdpa
under the causal AND same-document mask, for documents cut anywhere in a
chunk (rows a pair leaves empty: no NaN) and at chunk boundaries (pairs
that share no document are not computed)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hpctrain.data.sequence import SequenceLayout as Layout
from hpctrain.model.attention import document_mask

from hpctrain_cp.blocks import block_backward, block_forward, expand_kv, merge, pair_kind, plan_pairs, reduce_kv

B, H, HK, T, D = 2, 4, 2, 24, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, h, T, D, generator=g, requires_grad=True) for h in (H, HK, HK)]


def _rank_rows(layout: Layout, rank: int, chunk: int) -> torch.Tensor:
    return layout.positions(rank, chunk)


def _pairs(layout, rank, chunk):
    """(local query chunk, key chunk of the whole sequence, causal) for the pairs causality leaves."""
    return [(i, b, pair_kind(a, b) == "causal") for i, a in enumerate(layout.chunks[rank])
            for b in range(T // chunk) if pair_kind(a, b) is not None]


def _rank_forward(q, k, v, layout, rank, chunk, scale, segments=None):
    """This rank's output and lse from every key chunk of the sequence."""
    rows = _rank_rows(layout, rank, chunk)
    qr = q[:, :, rows].float()
    kx, vx = expand_kv(k.float(), H), expand_kv(v.float(), H)
    outs, lses = [None] * len(layout.chunks[rank]), [None] * len(layout.chunks[rank])
    q_seg = None if segments is None else segments[:, rows]
    for i, b, causal, mask in plan_pairs(_pairs(layout, rank, chunk), q_seg, segments, chunk):
        o, o_lse = block_forward(qr[:, :, i * chunk:(i + 1) * chunk], kx[:, :, b * chunk:(b + 1) * chunk],
                             vx[:, :, b * chunk:(b + 1) * chunk], scale, causal, mask)
        outs[i], lses[i] = merge(outs[i], lses[i], o, o_lse)
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


SEGMENTS = {
    "ragged": [[5, 9, 10], [12, 1, 11]],  # boundaries inside chunks: masked pairs with empty rows
    "aligned": [[6, 6, 12], [12, 12]],    # boundaries on chunk boundaries (cp 2, 3): pairs with no shared document
}


def _segments(lengths_per_sample):
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
                        for lengths in lengths_per_sample])


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("docs", list(SEGMENTS))
def test_chunk_pairs_with_documents_equal_document_attention(cp, kind, docs, fused):
    q, k, v = _inputs()
    segments = _segments(SEGMENTS[docs])
    layout = getattr(Layout, kind)(cp)
    chunk, scale = T // (2 * cp), 1.0 / math.sqrt(D)
    allowed = document_mask(segments, segments) & torch.ones(T, T, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    dout = torch.randn_like(want)
    want.backward(dout)
    ref = [t.grad.clone() for t in (q, k, v)]
    dq, dk, dv = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
    kx, vx = expand_kv(k.detach(), H), expand_kv(v.detach(), H)
    computed = 0
    for rank in range(cp):
        rows = _rank_rows(layout, rank, chunk)
        out, lse = _rank_forward(q.detach(), k.detach(), v.detach(), layout, rank, chunk, scale, segments)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        torch.testing.assert_close(out, want.detach()[:, :, rows], rtol=1e-5, atol=1e-6)
        g = dout[:, :, rows]
        delta = (g * out).sum(-1)
        for i, b, causal, mask in plan_pairs(_pairs(layout, rank, chunk), segments[:, rows], segments, chunk):
            computed += 1
            qs, ks = slice(i * chunk, (i + 1) * chunk), slice(b * chunk, (b + 1) * chunk)
            g_q, g_k, g_v = block_backward(q.detach()[:, :, rows][:, :, qs], kx[:, :, ks], vx[:, :, ks], scale,
                                           causal, lse[:, :, qs], g[:, :, qs], delta[:, :, qs], out[:, :, qs], mask)
            dq[:, :, rows[qs]] += g_q
            dk[:, :, ks] += g_k
            dv[:, :, ks] += g_v
    for got, exp in zip((dq, reduce_kv(dk, HK), reduce_kv(dv, HK)), ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6 * float(exp.abs().max()))
    # computed: exactly the pairs whose block of the mask allows some score
    blocks_with_work = sum(bool(allowed[..., layout.chunks[r][i] * chunk:(layout.chunks[r][i] + 1) * chunk,
                                        b * chunk:(b + 1) * chunk].any())
                           for r in range(cp) for i, b, _ in _pairs(layout, r, chunk))
    assert computed == blocks_with_work
    if docs == "aligned":  # a document boundary on a chunk boundary leaves pairs out
        assert computed < sum(len(_pairs(layout, r, chunk)) for r in range(cp))


@pytest.mark.parametrize("causal", [False, True])
def test_a_pair_with_empty_rows_merges_as_nothing(causal, fused):
    """Rows a pair's mask leaves without a key: output 0, lse -inf; merged
    with another part they take its values; merged with another empty part
    they stay empty, never NaN."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, D, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)[None, None]
    out, lse = block_forward(q, k, v, 0.5, causal, mask)
    empty = torch.tensor([False, True, False, True])
    assert (out[:, :, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, ~empty]).all()
    other_out, other_lse = block_forward(q, k, v, 0.5, causal)
    merged_out, merged_lse = merge(out, lse, other_out, other_lse)
    torch.testing.assert_close(merged_out[:, :, empty], other_out[:, :, empty], rtol=0, atol=0)
    both_out, both_lse = merge(out, lse, out, lse)
    assert not both_out.isnan().any() and (both_out[:, :, empty] == 0).all()
    assert (both_lse[:, :, empty] == float("-inf")).all()
