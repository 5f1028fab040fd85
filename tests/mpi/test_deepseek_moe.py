"""A tiny DeepSeek-V3-style model trains as in one process at 4 ranks: the
same per-step losses and the same gradient of every parameter.

The model: block 0 dense (``model.moe.first_dense_blocks=1``), block 1
MoE with the sigmoid router, its selection bias moving after every step
(``aux_free_bias_rate``, so step 2 routes with the bias the world's loads
set), group-limited routing (8 experts in 4 groups, top-2 from the best 2
groups), a routed scaling factor, one shared expert and experts narrower
than the dense feed-forward; multi-token prediction of depth 1 (its block
an MoE block too), weighted 0.3; every block's attention (the MTP
module's too) DeepSeek-V3's multi-head latent attention (``model.attention_kind=mla``):
the low-rank query (q_lora_rank 24) and key/value latent (16) with their norms, a
shared rotary key of 8 dims, q/k heads of 8 + 8 dims against value heads of 12,
and yarn RoPE with both mscale terms (as tests/mpi/test_mla.py's model).

Layouts (one shared one-process reference, 2 steps):

- ep 2 x pp 2: the experts split over ep (the shared expert replicated,
  its gradient averaged over ep like a dense weight), block 0 and the
  embedding on stage 0, block 1, the head and the MTP module (with the
  embedding it shares, whose gradient is summed with stage 0's) on stage 1;
- dp 4 with ZeRO-3: every weight sharded, gathered per unit (the MTP
  module's weights in the last unit, the embedding and head called twice);
- tp 2 with sequence parallelism x ep 2: the latent attention's heads (wq_b
  and wkv_b column-parallel, wo row-parallel; the down-projections and latent
  norms whole, their gradients summed over tp), the dense block and the
  shared expert split over tp (the MTP module's block too), the routed
  experts over ep; the MTP module's norms and projection whole, their
  gradients summed over tp.

And cp 2 x dp 2 with document masking, against its own one-process run on
the same document-masked micro-batches: ring attention with value heads
narrower than the q/k heads, each document's tokens attending only within it.

Tolerances as tests/mpi/test_moe.py (routing is discontinuous; no token
of these runs sits near a tie).
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "model=tiny-moe", "model.moe.first_dense_blocks=1",
        "model.moe.router=sigmoid", "model.moe.aux_free_bias_rate=0.01", "model.moe.num_experts=8",
        "model.moe.top_k=2", "model.moe.expert_groups=4", "model.moe.topk_groups=2",
        "model.moe.routed_scaling_factor=2.5", "model.moe.shared_experts=1", "model.moe.ffn_hidden=32",
        "model.mtp_depth=1", "model.mtp_loss_weight=0.3")
MLA = ("model.attention_kind=mla", "model.n_kv_heads=null", "model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16",
       "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12",
       "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_seq_len=16",
       "model.rope_scaling.mscale=1.0", "model.rope_scaling.mscale_all_dim=0.8")
BASE = BASE + MLA
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6

LAYOUTS = {
    "ep2-pp2": ("parallel.ep=2", "parallel.pp=2"),
    "dp4-zero3": ("parallel.zero.stage=3",),
    "tp2-sp-ep2": ("parallel.tp=2", "parallel.ep=2"),
}


@pytest.mark.mpi(min_size=4)
def test_cp2_dp2_with_document_masking_trains_like_one_process(world, pm):
    """cp 2 x dp 2 with document masking (the micro-batches of tests/mpi/documents.py): the model's and the
    MTP module's attention split over cp (ring), each rank's ids and targets one place ahead taken from the
    whole sequence; against the one-process run with the same documents."""
    from documents import with_documents
    from mpi4py import MPI

    from hpctrain.config import compose_resolved
    from hpctrain.parity import on_rank0
    from hpctrain.run import reference_trainer

    def one_process():
        trainer = with_documents(reference_trainer(compose_resolved(BASE, pm), pm))
        records = record(trainer, STEPS, MPI.COMM_SELF)
        assert max(int(mb.segments.max()) for mb in trainer.step_runner.seen) >= 2  # several documents
        return records

    want = on_rank0(MPI.COMM_WORLD, one_process)
    trainer = with_documents(world_trainer(pm, *BASE, "parallel.cp=2"))
    assert trainer.model.mtp.sequence is not None
    assert type(trainer.model.layers[0].attn).__name__ == "MLAttention"
    assert type(trainer.model.layers[0].attn.core).__name__ == "RingAttention"
    assert_parity(record(trainer, STEPS), want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_deepseek_style_model_trains_like_one_process(world, pm, layout):
    trainer = world_trainer(pm, *BASE, *LAYOUTS[layout])
    got = record(trainer, STEPS)
    want = shared_reference(BASE, STEPS)
    assert any(name.startswith("mtp.") for name in want[0].grads)  # the MTP module trains
    assert "layers.0.ffn.w1.weight" in want[0].grads and "layers.1.ffn.experts.w1" in want[0].grads
    assert {"layers.1.attn.wq_b.weight", "mtp.layers.2.block.attn.wkv_a.weight"} <= set(want[0].grads)  # MLA
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
