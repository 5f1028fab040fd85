"""fp16's dynamic loss scale (``hpctrain.train.loss_scale``): the scale
follows torch's GradScaler over the same overflow pattern; in one process
an injected overflow skips its step (weights and optimizer state
untouched), lowers the scale and training goes on; an overflow once the
scale is down to 1 is a divergence for the non-finite guard; fp16 training
computes in fp16 under autocast with fp32 weights and gradients."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hpctrain.errors import TrainingDiverged
from hpctrain.train.loss_scale import DynamicLossScale

BASE = ("trainer.precision=fp16", "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32",
        "trainer.progress=off", "trainer.log_every=100", "trainer.device=cpu")


def test_the_scale_follows_torch_grad_scaler():
    pattern = [False, True, False, False, False, True, True, False, False, False, False, False]
    cfg = SimpleNamespace(initial=1024.0, growth_interval=3, backoff=0.25, growth=4.0)
    ours = DynamicLossScale(cfg)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=cfg.initial, growth_factor=cfg.growth,
                                  backoff_factor=cfg.backoff, growth_interval=cfg.growth_interval)
    for overflow in pattern:
        assert ours.scale == theirs.get_scale()
        opt.zero_grad()
        theirs.scale((w * 2.0).sum()).backward()
        if overflow:
            w.grad[0] = math.inf
        theirs.step(opt)
        theirs.update()
        ours.update(overflow)
    assert ours.scale == theirs.get_scale()
    assert ours.skipped == sum(pattern)


def _trainer(pm, *overrides):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    return reference_trainer(compose_resolved(BASE + overrides, pm), pm)


def test_an_injected_overflow_skips_its_step_and_lowers_the_scale(pm):
    t = _trainer(pm, "trainer.steps=4", "debug.fault=overflow", "debug.fault_step=3",
                 "trainer.loss_scale.initial=1024", "trainer.loss_scale.backoff=0.5")
    seen = {}
    dtypes = set()
    hook = t.model.layers["0"].attn.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    for step in range(1, 5):
        before = [p.detach().clone() for p in t.params]
        state = {k: v.clone() for k, v in t.optimizer.state[t.params[0]].items()} if step > 1 else {}
        m = t.train_step()
        seen[step] = m
        unchanged = all(torch.equal(a, p) for a, p in zip(before, t.params))
        assert unchanged == (step == 3), step
        if step == 3:  # the optimizer did not step either
            assert all(torch.equal(v, t.optimizer.state[t.params[0]][k]) for k, v in state.items())
    hook.remove()
    assert dtypes == {torch.float16} and all(p.dtype == torch.float32 for p in t.params)
    assert [seen[s]["loss_scale"] for s in range(1, 5)] == [1024.0, 1024.0, 1024.0, 512.0]
    assert [seen[s]["loss_scale_skips"] for s in range(1, 5)] == [0, 0, 1, 1]
    assert "skipped_steps" not in seen[4] and t.guard.skipped == 0  # not a reliability event
    assert all(math.isfinite(seen[s]["loss"]) for s in seen) and math.isinf(seen[3]["grad_norm"])


def test_an_overflow_at_scale_one_is_a_divergence(pm):
    t = _trainer(pm, "trainer.steps=2", "debug.fault=overflow", "debug.fault_step=2", "trainer.loss_scale.initial=1")
    t.train_step()
    with pytest.raises(TrainingDiverged, match="step 2"):
        t.train_step()


def test_the_scale_grows_after_clean_steps(pm):
    t = _trainer(pm, "trainer.steps=3", "trainer.loss_scale.initial=8", "trainer.loss_scale.growth_interval=2")
    assert [t.train_step()["loss_scale"] for _ in range(3)] == [8.0, 8.0, 16.0]
