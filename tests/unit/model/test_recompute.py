"""Activation recomputation changes memory, never a number: with
``model.recompute=selective`` and ``full`` a one-process run trains the same
per-step losses, gradients and (MoE) expert statistics as without, bit for
bit on the CPU, and the recomputed parts really run a second time in
backward. Recomputation under every parallel axis is proved at 8 ranks
(tests/mpi/test_layouts.py)."""
from __future__ import annotations

import pytest
import torch

from hpctrain.model.recompute import recomputed, recomputing

BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.steps=2")
MODELS = {"dense": ("model=tiny",), "moe": ("model=tiny-moe", "model.moe.capacity_factor=1.0")}


def _run(make_config, pm, model, recompute):
    from hpctrain.run import reference_trainer

    trainer = reference_trainer(make_config(*BASE, *model, f"model.recompute={recompute}"), pm)
    calls = {"attention": 0, "core": 0}
    block = trainer.model.layers[0]
    block.attn.register_forward_hook(lambda *a: calls.__setitem__("attention", calls["attention"] + 1))
    block.attn.core.register_forward_hook(lambda *a: calls.__setitem__("core", calls["core"] + 1))
    steps = []
    for _ in range(2):
        metrics = trainer.train_step()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        steps.append((metrics, grads))
    return steps, calls


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_trains_the_same_numbers(make_config, pm, model, recompute):
    want, plain_calls = _run(make_config, pm, MODELS[model], "none")
    got, calls = _run(make_config, pm, MODELS[model], recompute)
    for step, ((gm, gg), (wm, wg)) in enumerate(zip(got, want), start=1):
        assert gm["loss"] == wm["loss"] and gm["grad_norm"] == wm["grad_norm"], step
        shared = {k for k in wm if k.startswith("moe.")}  # aux losses and expert loads, counted once
        assert bool(shared) == (model == "moe")
        assert {k: gm[k] for k in shared} == {k: wm[k] for k in shared}, step
        assert gg.keys() == wg.keys()
        for name in wg:
            assert torch.equal(gg[name], wg[name]), (step, name)
    # 2 steps x 2 micro-batches: each forward once, plus once more in backward for what is recomputed
    assert plain_calls == {"attention": 4, "core": 4}
    assert calls == ({"attention": 4, "core": 8} if recompute == "selective" else {"attention": 8, "core": 8})


def test_recomputed_replays_with_the_flag_and_is_plain_without_grad():
    seen = []

    def f(x):
        seen.append(recomputing())
        return (x * x).sum()

    x = torch.ones(3, requires_grad=True)
    recomputed(f, x).backward()
    assert seen == [False, True] and torch.equal(x.grad, 2 * torch.ones(3))
    with torch.no_grad():
        recomputed(f, x)
    assert seen == [False, True, False]
