"""LoRA trains the adapters of one process under every axis.

A tiny Llama with adapters on all seven projections (q, k, v, o, gate, up,
down; rank 4, dropout 0), its base frozen, trained 2 steps at 4 ranks in one
session, each layout against one shared one-process run:

- tp 2 x dp 2, ZeRO-1 (column-parallel bases: B cut by rows, A whole with its
  gradient summed over tp; row-parallel: A cut by columns, B whole),
- pp 2 x dp 2, ZeRO-3 (frozen base weights sharded, never reduced),
- cp 2 x dp 2, ZeRO-2, full recomputation,
- and an MoE model's attention adapters (its experts, router and the rest
  frozen) at ep 2 x tp 2 against its own one-process run,

each equals one process: per-step losses and the gradient of every adapter
(the only gradients there are; the base has none on any rank). No warm-up,
so step 1 moves B off zero and step 2's gradients of A are not zero.

Tolerances (fp32) as tests/mpi/test_loss_mask.py: losses 1e-6 relative,
gradients 1e-5 relative plus 1e-6 of the largest element at step 1 and
``parity.ADAM_DRIFT`` afterwards.
"""
from __future__ import annotations

import pytest

from hpctrain.shard import get_spec

from hpctrain_zero.memory import measured
from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
BASE = ("finetune=lora", "finetune.lora.rank=4", "finetune.lora.targets=[q,k,v,o,gate,up,down]",
        "optim.warmup_steps=0", "optim.lr=0.01", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.seq_len=32", "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100")
LAYOUTS = {
    "tp2xdp2-zero1": ("parallel.tp=2", "parallel.zero.stage=1"),
    "pp2xdp2-zero3": ("parallel.pp=2", "parallel.zero.stage=3"),
    "cp2xdp2-zero2-recompute": ("parallel.cp=2", "parallel.zero.stage=2", "model.recompute=full"),
}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_lora_trains_like_one_process(world, pm, layout):
    want = shared_reference(BASE, STEPS)
    adapters = {n for n in want[-1].grads if ".lora." in n}
    assert adapters == set(want[-1].grads) and len(adapters) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    assert all(float(want[-1].grads[n].abs().max()) > 0 for n in adapters)  # B moved: A's gradients too
    trainer = world_trainer(pm, *BASE, *layout)
    got = record(trainer, STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    # no gradient for the base on any rank
    assert all(p.grad is None for p in trainer.model.parameters() if not p.requires_grad)


MOE = BASE[:2] + ("finetune.lora.targets=[q,k,v,o]", "model=tiny-moe") + BASE[3:]


@pytest.mark.mpi(min_size=4)
def test_lora_on_moe_attention_trains_like_one_process(world, pm):
    want = shared_reference(MOE, STEPS)
    assert set(want[-1].grads) == {n for n in want[-1].grads if ".attn." in n and ".lora." in n}
    assert len(want[-1].grads) == 2 * 4 * 2
    got = record(world_trainer(pm, *MOE, "parallel.ep=2", "parallel.tp=2"), STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_logs_what_a_lora_run_holds(world, pm, stage):
    """ZeRO's memory log (frozen base whole at stage 1, in fp32 flat chunks at stage 3; gradients and
    optimizer state of the adapters only) equals what the tensors hold after a step, and the optimizer
    holds state for adapters alone."""
    trainer = world_trainer(pm, *BASE, f"parallel.zero.stage={stage}")
    trainer.train_step()
    setup = trainer.data_handle
    got, seen = setup.memory, measured(setup, trainer.model, trainer.optimizer)
    assert (seen.params, seen.grads, seen.optimizer) == (got.params, got.grads, got.optimizer)
    adapters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) * (4 if stage == 3 else 1)
    assert 0 < got.optimizer <= 8 * adapters  # two fp32 moments per adapter element held, none for the base
    assert {get_spec(p).logical_name for p in trainer.optimizer.state} <= {
        get_spec(p).logical_name for p in trainer.model.parameters() if ".lora." in get_spec(p).logical_name}
