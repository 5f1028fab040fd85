"""The MoE layer in one process against a per-token loop, and its parts as
pure functions: routing (softmax / sigmoid), capacity priority, balance
losses, the selection-bias update.

The per-token reference computes, for each token alone, the router's
choice and sum_j weight_j * expert_j(token) + shared(token) with plain
matrix-vector products; the layer's sorted, grouped, index_add version
must give the same output and the same gradient of every weight (fp32,
1e-5 relative plus 1e-6 of the largest element: the two sum the same
products in different orders)."""
from __future__ import annotations

import math

import pytest
import torch

from hpctrain.model.aux import collect_aux_losses

from hpctrain_moe.capacity import expert_capacity, keep_mask
from hpctrain_moe.config import MoEConfig
from hpctrain_moe.layer import MoE
from hpctrain_moe.router import balance_loss, route, update_bias

D, H = 16, 24


def _layer(**kw) -> MoE:
    torch.manual_seed(0)
    layer = MoE(D, H, MoEConfig(**kw))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _silu_glu(x, w1, w3, w2):
    return w2 @ (torch.nn.functional.silu(w1 @ x) * (w3 @ x))


def _per_token(layer: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    cfg = layer.cfg
    tokens = x.reshape(-1, D)
    out = []
    for t, tok in enumerate(tokens):
        logits = (layer.router.weight.float() @ tok.float()).unsqueeze(0)
        r = route(logits, cfg.top_k, cfg.router, layer.router.expert_bias)
        y = torch.zeros(D)
        for j in range(cfg.top_k):
            if keep is not None and not bool(keep[t, j]):
                continue
            e = int(r.experts[0, j])
            ex = layer.experts
            y = y + r.weights[0, j] * _silu_glu(tok, ex.w1[e], ex.w3[e], ex.w2[e])
        if layer.shared is not None:
            s = layer.shared
            y = y + _silu_glu(tok, s.w1.weight, s.w3.weight, s.w2.weight)
        out.append(y)
    return torch.stack(out).view_as(x)


def _grads(layer, fn, x):
    layer.zero_grad()
    fn(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kw", [
    dict(num_experts=4, top_k=2),
    dict(num_experts=4, top_k=1),
    dict(num_experts=6, top_k=3, shared_experts=2),
    dict(num_experts=4, top_k=2, router="sigmoid"),
], ids=["softmax-top2", "switch-top1", "shared", "sigmoid"])
def test_layer_equals_per_token_loop(kw):
    layer = _layer(**kw)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.0, 0.25]))
    x = torch.randn(3, 5, D)
    torch.testing.assert_close(layer(x), _per_token(layer, x), rtol=1e-5, atol=1e-6)
    got, want = _grads(layer, layer, x), _grads(layer, lambda v: _per_token(layer, v), x)
    assert set(got) == set(want)
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_capacity_drops_what_the_priority_order_says():
    # 6 tokens, top-2 over 3 experts, capacity 2 per expert
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0], [1, 2]])
    keep = keep_mask(experts, 3, 2)
    # first choices in token order: e0 <- t0, t1 (t2 dropped); e1 <- t3, t5; e2 <- t4
    # then second choices in token order: e1 full (t0 dropped), e2 <- t1 (t5's dropped), e0 full
    want = torch.tensor([[True, False], [True, True], [False, False], [True, False], [True, False], [True, False]])
    assert torch.equal(keep, want)
    assert expert_capacity(tokens=6, top_k=2, num_experts=3, factor=0.5) == 2
    assert expert_capacity(tokens=7, top_k=2, num_experts=3, factor=1.0) == math.ceil(14 / 3)


def test_layer_with_capacity_equals_per_token_loop_with_the_same_drops():
    layer = _layer(num_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 8, D)
    out = layer(x)
    keep = layer.last_keep
    assert 0 < int((~keep).sum()) < keep.numel()  # something was dropped, not everything
    torch.testing.assert_close(out, _per_token(layer, x, keep), rtol=1e-5, atol=1e-6)


def test_balance_loss_is_one_when_uniform_and_grows_with_imbalance():
    uniform = balance_loss(torch.tensor([4.0, 4.0, 4.0, 4.0]), torch.tensor([2.0, 2.0, 2.0, 2.0]), 8, 2)
    assert float(uniform) == pytest.approx(1.0)
    skewed = balance_loss(torch.tensor([16.0, 0.0, 0.0, 0.0]), torch.tensor([8.0, 0.0, 0.0, 0.0]), 8, 2)
    assert float(skewed) == pytest.approx(4.0)


def test_aux_losses_reach_the_channel_only_when_collected():
    layer = _layer(num_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(2, 4, D)
    layer(x)
    assert layer.stats.row is None  # inference: no statistics
    with collect_aux_losses() as aux:
        layer(x)
    names = aux.by_name()
    assert set(names) == {"moe.aux_loss", "moe.z_loss"}
    row = layer.stats.take(torch.device("cpu"))
    assert float(row[:4].sum()) == 2 * 4 * 2  # every assignment counted once
    assert names["moe.aux_loss"] == pytest.approx(0.1 * float(row[4 + 2]), rel=1e-6)


def test_sigmoid_bias_selects_but_does_not_weight():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    free = route(logits, 1, "sigmoid")
    forced = route(logits, 1, "sigmoid", torch.tensor([100.0, 0.0, 0.0, 0.0]))
    assert int(free.experts[0, 0]) == 3 and int(forced.experts[0, 0]) == 0
    assert float(forced.weights[0, 0]) == 1.0  # normalised over the one chosen
    bias = torch.zeros(4)
    update_bias(bias, torch.tensor([10.0, 2.0, 2.0, 2.0]), 0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
