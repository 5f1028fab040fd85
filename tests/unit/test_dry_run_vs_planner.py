"""The dry run against the planner, rank by rank (``hpctrain-train --dry-run`` prints both columns).

For small but representative 16-rank layouts under bf16 autocast (where the
residual stream's fp32 and autocast's copies make the dtypes matter) --
tp 2 x interleaved pp 4 (vpp 2) x dp 2, without and with full
recomputation; an MoE with tp 2 x ep 2 x pp 2 x dp 2; and a 4D
tp 2 x cp 2 x pp 2 x dp 2 -- the first, a middle and the last
pipeline rank's report must agree with the planner's prediction for the same
rank (``hpctrain.planner.estimate.stage_memory`` and
``hpctrain.planner.traffic.stage_bytes``):

- parameters, gradients and optimizer state within 1%;
- the bus bytes of every axis within 5% (they are equal today: both count
  the Communicators' nccl-tests bus bytes, pp as this rank's sends);
- the activation peak within 3%: the planner's table counts a block's
  saved tensors per token and weighs each chunk with the schedule's own
  order (``hpctrain.pipeline.bubble.peak_held``), but leaves out a few
  per-micro-batch scalars and masks (loss-mask flags, counts), which a
  tiny model's few tokens make visible (the layouts below differ by at most
  0.7%).

On a middle stage every tensor-parallel all-gather moves bf16: the
sequence-parallel columns cast their input before gathering it
(``plugins/hpctrain_tp/columns.py``; they gathered the fp32 residual stream).

The same comparison at full size (Llama 3 405B on 8,192 ranks, Mixtral 8x7B
with ep, a cp layout) is in docs/planner.md, "Dry run vs the planner".
"""
from __future__ import annotations

import pytest
import torch

from hpctrain.dry_run import DryRunFlags, dry_run

WORLD = 16
BASE = ("trainer.device=cpu", "trainer.progress=off", "trainer.precision=bf16", "parallel.zero.stage=1")

LAYOUTS = {
    # rank = tp + 2 dp + 4 pp (the default order tp-cp-ep-dp-pp): pp 0, 1 and 3
    "tp2-pp4-interleaved-dp2": (("model=tiny", "model.n_layers=8", "parallel.tp=2", "parallel.pp=4",
                                 "parallel.pipeline.schedule=interleaved", "parallel.pipeline.vpp=2",
                                 "trainer.global_batch_size=16", "trainer.micro_batch_size=1",
                                 "trainer.seq_len=64"), (0, 4, 15)),
    # full recomputation: the recomputed forward's collectives (and its attention, the flash kernel again)
    "tp2-pp4-interleaved-dp2-recompute": (("model=tiny", "model.n_layers=8", "parallel.tp=2", "parallel.pp=4",
                                           "parallel.pipeline.schedule=interleaved", "parallel.pipeline.vpp=2",
                                           "model.recompute=full", "trainer.global_batch_size=16",
                                           "trainer.micro_batch_size=1", "trainer.seq_len=64"), (0, 15)),
    "moe-tp2-ep2-pp2-dp2": (("model=tiny-moe", "parallel.tp=2", "parallel.ep=2", "parallel.pp=2",
                             "trainer.global_batch_size=32", "trainer.micro_batch_size=2", "trainer.seq_len=128"),
                            (0, 15)),
    "4d-tp2-cp2-pp2-dp2": (("model=tiny", "parallel.tp=2", "parallel.cp=2", "parallel.pp=2",
                            "trainer.global_batch_size=16", "trainer.micro_batch_size=1", "trainer.seq_len=128"),
                           (0, 15)),
}
STATES, BYTES, ACTIVATIONS = 0.01, 0.05, 0.03


def _close(mine: float, theirs: float, tol: float) -> bool:
    return abs(mine - theirs) <= tol * max(abs(theirs), 1.0)


def _states_and_bytes_agree(r, where: str) -> set:
    """Parameters, gradients and optimizer state within STATES, every axis's bus bytes within BYTES;
    returns the axes compared."""
    p = r.planner
    assert p.problem is None, (where, p.problem)
    for what, mine, theirs in (("parameters", r.params, p.weights), ("gradients", r.grads, p.grads),
                               ("optimizer state", r.optimizer, p.optimizer)):
        assert theirs is not None and _close(mine, theirs, STATES), (where, what, mine, theirs)
    measured = {a: b for a, b in r.bytes_by_axis().items() if a != "world"}  # the step's totals: not planned
    axes = set(measured) | {a for a, b in p.comm.items() if b}
    for axis in sorted(axes):
        mine, theirs = measured.get(axis, 0.0), p.comm.get(axis, 0.0)
        assert _close(mine, theirs, BYTES), (where, axis, mine, theirs)
    return axes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_matches_the_planner(make_config, pm, name):
    overrides, ranks = LAYOUTS[name]
    cfg = make_config(*BASE, *overrides)
    for r in dry_run(cfg, DryRunFlags(WORLD, ranks), pm):
        p = r.planner
        where = f"{name}, rank {r.rank} (pp {r.coords['pp']})"
        axes = _states_and_bytes_agree(r, where)
        assert len(axes) >= 3, (where, axes)
        assert p.activations is not None and _close(r.activations, p.activations, ACTIVATIONS), \
            (where, "activation peak", r.activations, p.activations)
        if r.coords["pp"] == 1:  # no embedding, no head: every tp all-gather moves bf16 (columns cast, then gather)
            gathers = {rec.dtype for rec in r.records if rec.op == "all_gather" and rec.axes == ("tp",)}
            assert gathers == {torch.bfloat16}, (where, gathers)


LORA_LAYOUTS = {
    # every projection adapted (column and row cuts of A and B), the first and the last pipeline stage
    "lora-tp2-pp2-dp4": (("model=tiny", "model.n_layers=4", "parallel.tp=2", "parallel.pp=2", "finetune=lora",
                          "finetune.lora.targets=[q,k,v,o,gate,up,down]", "trainer.global_batch_size=16",
                          "trainer.micro_batch_size=1", "trainer.seq_len=64"), (0, 15)),
    # attention only, without sequence parallelism (tp's plain all-reduces)
    "lora-tp2-dp8-no-sp": (("model=tiny", "parallel.tp=2", "parallel.sequence_parallel=false", "finetune=lora",
                            "trainer.global_batch_size=16", "trainer.micro_batch_size=1", "trainer.seq_len=64"),
                           (0,)),
}


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_ranks_match_the_planner(make_config, pm, name):
    """LoRA (``hpctrain.planner.lora``): the frozen base's weights, the adapters' gradients and optimizer
    state within 1%, the bus bytes of every axis within 5% (the adapters' tp sums, the collectives the
    frozen embedding no longer needs, the data axes reducing only adapters). The planner keeps the full
    training activation tables for LoRA, an upper bound (a frozen projection saves no input for a weight
    gradient): the measured peak must not exceed it."""
    overrides, ranks = LORA_LAYOUTS[name]
    cfg = make_config(*BASE, *overrides)
    for r in dry_run(cfg, DryRunFlags(WORLD, ranks), pm):
        p = r.planner
        where = f"{name}, rank {r.rank} (pp {r.coords['pp']})"
        assert r.optimizer < 0.2 * r.params, (where, "optimizer state is the adapters' only", r.optimizer)
        _states_and_bytes_agree(r, where)
        assert p.activations is not None and r.activations <= p.activations, (where, r.activations, p.activations)
