"""Document masking in one process: a packed sample whose attention is
masked by document (``segments``) and whose RoPE positions restart at each
document gives, token for token, what each document gives alone: the
attention core's output, the model's logits and, through the loss, the
gradient of every parameter; with and without recomputation, dense and MoE.

Tolerances (fp32): the packed run and the per-document runs differ only in
how many (masked, exactly zero) terms each softmax row and each matrix
product sums over, so outputs agree to 1e-5 relative plus 1e-6 of the
largest element, as the chunk-pair tests (tests/unit/cp).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpctrain.model.attention import SdpaAttention
from hpctrain.model.build import build_model, materialize

T = 32
DOCS = [[5, 9, 3, 15], [32], [1, 1, 30]]
"""Document lengths of each packed sample (each sums to T): a single-token document, one filling the sample."""


def _segments_positions(lengths):
    seg = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return seg, pos


def _packed():
    pairs = [_segments_positions(lengths) for lengths in DOCS]
    return torch.stack([s for s, _ in pairs]), torch.stack([p for _, p in pairs])


def _documents(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def _model(make_config, pm, *overrides):
    cfg = make_config(*overrides)
    return materialize(build_model(cfg, pm), torch.device("cpu"), 3, cfg.model.init_std, cfg.model.n_layers)


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_core_attention_equals_each_document_alone():
    """SdpaAttention with segments, grouped-query (4 query / 2 key-value heads), against sdpa per document."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(DOCS), h, T, 8, generator=g) for h in (4, 2, 2))
    segments, _ = _packed()
    out = SdpaAttention()(q, k, v, segments)
    assert not out.isnan().any()
    for s, lengths in enumerate(DOCS):
        for a, b in _documents(lengths):
            alone = F.scaled_dot_product_attention(q[s:s + 1, :, a:b], k[s:s + 1, :, a:b], v[s:s + 1, :, a:b],
                                                   is_causal=True, enable_gqa=True)
            _close(out[s:s + 1, :, a:b], alone)
    # one document per sample is plain causal attention
    _close(SdpaAttention()(q, k, v, torch.zeros(len(DOCS), T, dtype=torch.long)), SdpaAttention()(q, k, v))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_model_equals_each_document_alone(make_config, pm, model, recompute):
    """Logits per token, and every parameter's gradient of the packed mean
    loss against the token-weighted mean of the documents' losses."""
    from hpctrain.model.recompute import set_recompute

    net = _model(make_config, pm, f"model={model}")  # MoE: dropless, so routing is per token
    set_recompute(net, recompute)
    tokens = torch.randint(0, 256, (len(DOCS), T + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments, positions = _packed()

    logits = net(inputs, positions=positions, segments=segments)
    loss = net(inputs, targets, positions, segments=segments)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()

    total = torch.zeros(())
    for s, lengths in enumerate(DOCS):
        for a, b in _documents(lengths):
            with torch.no_grad():
                _close(logits[s:s + 1, a:b], net(inputs[s:s + 1, a:b]))  # positions 0.. and no mask: alone
            total = total + net(inputs[s:s + 1, a:b], targets[s:s + 1, a:b]) * (b - a)
    (total / targets.numel()).backward()
    for name, p in net.named_parameters():
        _close(packed_grads[name], p.grad)


def test_masking_changes_the_result(make_config, pm):
    """The check has teeth: the same packed tokens without their segments give other logits."""
    net = _model(make_config, pm)
    inputs = torch.randint(0, 256, (len(DOCS), T), generator=torch.Generator().manual_seed(2))
    segments, positions = _packed()
    with torch.no_grad():
        masked = net(inputs, positions=positions, segments=segments)
        plain = net(inputs, positions=positions)
    assert not torch.allclose(masked[0], plain[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(masked[1], plain[1], rtol=0, atol=0)  # one document: no mask needed, same numbers


def test_positions_per_sample_reach_rope(make_config, pm):
    """Positions (batch, seq) rotate each sample by its own row: the packed
    call equals each sample alone with its 1-D positions, with segments or
    without. (RoPE scores depend on position differences only, so inside a
    document, absolute and document-relative positions give the same
    attention up to rounding: the per-document test above cannot tell them
    apart; positions that are not a shift of 0, 1, ... can.)"""
    net = _model(make_config, pm)
    g = torch.Generator().manual_seed(4)
    inputs = torch.randint(0, 256, (2, T), generator=g)
    positions = torch.stack([torch.randperm(T, generator=g) for _ in range(2)])
    one_document = torch.zeros(2, T, dtype=torch.long)
    with torch.no_grad():
        for segments in (None, one_document):
            both = net(inputs, positions=positions, segments=segments)
            for s in range(2):
                _close(both[s:s + 1], net(inputs[s:s + 1], positions=positions[s]))
            assert not torch.allclose(both, net(inputs, segments=segments), rtol=1e-3, atol=1e-3)
