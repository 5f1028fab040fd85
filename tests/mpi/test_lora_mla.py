"""LoRA on multi-head latent attention (DeepSeek-V3's, ``model.attention_kind=mla``) trains the adapters of
one process at 4 ranks.

A tiny MLA model (d_model 64, 2 layers, 4 heads; low-rank query of 24, key/value latent of 16 with a shared
rotary key of 8, q/k heads of 8 + 8 dims and value heads of 12) with adapters on latent attention's
down-projections (``q_a``, ``kv_a``), per-head up-projections (``q_b``, ``kv_b``) and output (``o``), rank 4,
dropout 0, its base frozen, trained 2 steps at tp 2 x dp 2 with and without sequence parallelism against one
shared one-process run: per-step losses and every adapter's gradient (the only gradients there are).
Tolerances as tests/mpi/test_lora.py.
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6


MLA = ("finetune=lora", "finetune.lora.rank=4", "finetune.lora.targets=[q_a,q_b,kv_a,kv_b,o]",
       "model.attention_kind=mla", "model.n_kv_heads=null", "model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16",
       "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12",
       "optim.warmup_steps=0", "optim.lr=0.01", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
       "trainer.seq_len=32", "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100")
MLA_LAYOUTS = {
    "tp2-sp-x-dp2": ("parallel.tp=2", "parallel.sequence_parallel=true"),
    "tp2-x-dp2": ("parallel.tp=2", "parallel.sequence_parallel=false"),
}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", list(MLA_LAYOUTS.values()), ids=list(MLA_LAYOUTS))
def test_lora_on_latent_attention_trains_like_one_process(world, pm, layout):
    """Adapters on multi-head latent attention's down-projections (whole on every tp rank: with sequence
    parallelism each adapts its own tokens and the gradients are summed over tp, without it every rank adapts
    every token), its per-head up-projections (B cut with the heads, A's gradient summed over tp) and output
    (row-parallel), at tp 2 x dp 2 with and without sequence parallelism."""
    want = shared_reference(MLA, STEPS)
    assert len(want[-1].grads) == 2 * 5 * 2 and all(".attn.w" in n and ".lora." in n for n in want[-1].grads)
    assert all(float(want[-1].grads[n].abs().max()) > 0 for n in want[-1].grads)
    got = record(world_trainer(pm, *MLA, *layout), STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
