"""fp16 with dynamic loss scaling across ranks (``hpctrain.train.loss_scale``).

An overflow that only one rank sees (``debug.fault=overflow``: one of its
gradients becomes inf after the step's reduction) is agreed through the
gradient norm's all-reduce: every rank skips that step (weights unchanged),
lowers the scale alike, and the next step trains again (plain dp, ZeRO-1/2,
pp 2 x dp 2 with ZeRO-3). At pp 2 x dp 2 with ZeRO-3, and with ZeRO-1/2 over
the world, fp16 trains the losses and gradients of one fp16 process.

Tolerance: each micro-batch's forward computes the same fp16 products in
both runs; what differs is where the fp32 gradient sums run (reduce-scatter
over dp, pipeline stages). Losses agree to 1e-6 relative. Gradients: 1e-4
of the largest element at step 1 (same weights); afterwards AdamW's first
step turns fp32 reassociation differences into weight differences that
fp16's 11-bit rounding magnifies, so 5e-3 of it (``parity.ADAM_DRIFT`` is
the fp32 analogue). A gradient left scaled, or a micro-batch lost, is off
by orders of magnitude.
"""
from __future__ import annotations

import pytest
import torch

from parity import record, shared_reference, world_trainer

STEPS = 3
BASE = ("trainer.precision=fp16", "trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32",
        "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100", "model.n_layers=4")
PP2_DP2_ZERO3 = ("parallel.pp=2", "parallel.dp=2", "parallel.zero.stage=3")


def _skips_step_three_everywhere(world, trainer, backoff: float) -> None:
    scales, changed = [], []
    for _ in range(4):
        before = [p.detach().clone() for p in trainer.params]
        m = trainer.train_step()
        scales.append(m["loss_scale"])
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, trainer.params)))
    s = scales[0]
    assert scales == [s, s, s, s * backoff]
    assert changed == [True, True, False, True]
    assert trainer.loss_scale.skipped == 1 and trainer.guard.skipped == 0
    assert world.allgather((scales, changed)) == [(scales, changed)] * world.Get_size()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(world, pm, stage):
    last = world.Get_size() - 1
    trainer = world_trainer(pm, *BASE, f"parallel.zero.stage={stage}", "debug.fault=overflow",
                            f"debug.fault_rank={last}", "debug.fault_step=3")
    _skips_step_three_everywhere(world, trainer, 0.5)


@pytest.mark.mpi(min_size=4)
def test_an_overflow_under_pipeline_and_zero3_skips_the_step_on_every_rank(world, pm):
    trainer = world_trainer(pm, *BASE, *PP2_DP2_ZERO3, "parallel.dp=-1", "debug.fault=overflow", "debug.fault_rank=1",
                            "debug.fault_step=3", "trainer.loss_scale.backoff=0.25")
    _skips_step_three_everywhere(world, trainer, 0.25)


@pytest.mark.mpi(min_size=4)
def test_fp16_at_pp2_dp2_with_zero3_trains_like_one_fp16_process(world, pm):
    if world.Get_size() != 4:
        pytest.skip("pp 2 x dp 2 is a 4-rank layout")
    _like_one_fp16_process(world_trainer(pm, *BASE, *PP2_DP2_ZERO3))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_with_zero_trains_like_one_fp16_process(world, pm, stage):
    """ZeRO-1/2 keep the gradients in shards: the loss scale comes off there too."""
    _like_one_fp16_process(world_trainer(pm, *BASE, f"parallel.zero.stage={stage}"))


def _like_one_fp16_process(trainer) -> None:
    got = record(trainer, STEPS)
    want = shared_reference(BASE, STEPS)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g.loss - w.loss) <= 1e-6 * abs(w.loss), (step, g.loss, w.loss)
        assert set(g.grads) == set(w.grads)
        scale = 1e-4 if step == 1 else 5e-3
        for name, ref in w.grads.items():
            torch.testing.assert_close(g.grads[name], ref, rtol=1e-3, atol=scale * float(ref.abs().max()),
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")
