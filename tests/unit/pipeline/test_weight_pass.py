"""Zero-bubble's split backward (``hpctrain_pp.weight_pass``): B (input
gradient) then W (weight gradients) give the gradients of one whole backward,
and nothing on the input path runs a second time in W."""
from __future__ import annotations

import pytest
import torch

from hpctrain.model.build import build_model, materialize

from hpctrain_pp.weight_pass import backward_input


class CountingIdentity(torch.autograd.Function):
    """Identity whose backward counts its calls (a node on the input path)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        CountingIdentity.calls += 1
        return g


def _middle_stage(make_config, tied=False):
    cfg = make_config("model.n_layers=3", f"model.tie_embeddings={str(tied).lower()}")
    model = materialize(build_model(cfg), torch.device("cpu"), 0, 0.02, 3)
    return model, model.part([1, 2], first=False, last=True)


@pytest.mark.parametrize("twice", [False, True], ids=["one-microbatch", "accumulating"])
def test_split_backward_equals_one_backward(make_config, twice):
    torch.manual_seed(0)
    _, stage = _middle_stage(make_config)
    params = [p for p in stage.parameters()]
    d = stage.shape.d_model
    xs = [torch.randn(2, 16, d) for _ in range(2 if twice else 1)]
    targets = [torch.randint(0, stage.shape.vocab_size, (2, 16)) for _ in xs]

    want_dx = []
    for x, t in zip(xs, targets):
        x = x.clone().requires_grad_()
        stage(CountingIdentity.apply(x), t).backward()
        want_dx.append(x.grad)
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)

    CountingIdentity.calls = 0
    deferred = []
    for x, t, dx in zip(xs, targets, want_dx):
        x = x.clone().requires_grad_()
        loss = stage(CountingIdentity.apply(x), t)
        wp = backward_input([loss], [None], x, params)
        assert wp is not None and all(p.grad is None for p in params), "B must leave the weights alone"
        torch.testing.assert_close(x.grad, dx, rtol=1e-6, atol=1e-7)
        deferred.append(wp)
    assert CountingIdentity.calls == len(xs)
    ready = []
    for wp in deferred:
        wp.run(ready.append)
    assert CountingIdentity.calls == len(xs), "W ran part of the input path again"
    assert {id(p) for p in ready} == {id(p) for p in params}
    for n, p in stage.named_parameters():
        # same products, summed in the same order except the B/W split: fp32 rounding only
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_weight_off_the_input_path_falls_back(make_config):
    """A weight whose path never meets the input's (here a second output of
    the stage that does not depend on the input) cannot be deferred:
    ``backward_input`` still writes the input gradient and returns None."""
    _, stage = _middle_stage(make_config)
    bias = torch.nn.Parameter(torch.tensor(0.5))
    x = torch.randn(1, 8, stage.shape.d_model, requires_grad=True)
    loss = stage(x, torch.zeros(1, 8, dtype=torch.long))
    assert backward_input([loss, bias * 2], [None, None], x, list(stage.parameters()) + [bias]) is None
    assert x.grad is not None and bias.grad is None
