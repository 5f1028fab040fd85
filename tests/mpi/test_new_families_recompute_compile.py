"""Issue 56's model families under activation recomputation and ``trainer.compile=true`` at 2 ranks: the
per-step losses and every parameter's gradient equal the one-process *eager* run without recomputation
(recomputation and compilation change no number; the reference is shared by the cases of one model).

The models are tiny and made from the model's own overrides (their Hugging Face import is proved in
tests/mpi/test_qwen.py, test_qwen_moe.py, test_mla.py and test_deepseek_moe.py):

- Qwen3: qk-norm (an RMSNorm over each query and key head) with a decoupled head size (8 heads of 16 over a
  hidden size of 64) and 2 key/value heads;
- Qwen3-MoE: that attention with softmax top-2 of 4 experts normalised (norm_topk_prob), experts of their
  own width, MoE in every block;
- DeepSeek-V3: multi-head latent attention (the low-rank query and key/value latent with their norms, the
  shared rotary key, v heads of 12 against q/k heads of 8 + 8, yarn RoPE with both mscale terms), block 0
  dense, block 1 MoE with the sigmoid router and its moving selection bias, group-limited routing (8 experts
  in 4 groups, top-2 from the best 2), the routed scaling factor and a shared expert, and multi-token
  prediction of depth 1 (its block MLA + MoE too), as tests/mpi/test_deepseek_moe.py's model.

Cases:

- Qwen3 at tp 2 with sequence parallelism, ``model.recompute=full``: each block's forward (qk-norm, the
  tp collectives) replayed in backward;
- DeepSeek-V3 at ep 2, ``model.recompute=selective``: MLA's core (the sdpa over the concatenated
  nope + rope heads) recomputed; its rotary parts and projections are kept as in eager; the MTP block's too;
- DeepSeek-V3 at ep 2, ``model.recompute=full``: every block (the MoE all-to-alls, the router's bias
  statistics counted once) and the MTP module's block replayed;
- Qwen3 at tp 2 with sequence parallelism, ``trainer.compile=true``;
- Qwen3-MoE at ep 2, ``trainer.compile=true`` with ``model.recompute=full`` (the compiled block replayed);
- DeepSeek-V3 at tp 2 with sequence parallelism, ``trainer.compile=true`` with ``model.recompute=selective``
  (the core an eager island in each compiled MLA block, tests/mpi/test_compile.py's tp case).

Compiled cases check that every block (the MTP module's included) ran through its compiled region, each
step, and that no region's compilation failed. The MoE experts' runs are an eager island in a compiled block
(``hpctrain_moe.experts._runs``): traced, their routing-given lengths made dynamo recompile the frame at each
call until it failed one of its own guards (the DeepSeek-V3 case at tp 2 stopped with "Guard failed on the same
frame it was created").

Checked by breaking: MLA's yarn softmax factor left out of the recomputed forward fails the full case at
step 1 (tok_embeddings' gradient; selective passes: the factor is outside the recomputed core); the keys'
qk-norm skipped when compiled fails the compiled Qwen3 case (step 1's loss).

Backend: aot_eager (dynamo's tracing, the graph breaks and AOTAutograd's joint graph, without code
generation), as tests/mpi/test_compile.py picks for every axis but its one inductor case: what these
families add to compilation is new ops in the block's graph (qk-norm, the latent projections and their
split/concat, the rotary part, routing), traced and differentiated by AOTAutograd; inductor's cold C++
compilation of each new graph would take tens of seconds per graph on a loaded 2-core machine.

Tolerances (fp32), as tests/mpi/test_compile.py's and the families' own tests: losses within 1e-6
relative, gradients within 1e-5 relative plus 1e-6 of the reference's largest element at step 1 and
``parity.ADAM_DRIFT`` afterwards.
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
QWEN3 = ("model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=16", "model.qk_norm=true")
QWEN3_MOE = ("model=tiny-moe",) + QWEN3 + ("model.moe.router=softmax", "model.moe.norm_topk_prob=true",
                     "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=32")
DEEPSEEK_V3 = ("model=tiny-moe", "model.moe.first_dense_blocks=1", "model.moe.router=sigmoid",
               "model.moe.aux_free_bias_rate=0.01", "model.moe.num_experts=8", "model.moe.top_k=2",
               "model.moe.expert_groups=4", "model.moe.topk_groups=2", "model.moe.routed_scaling_factor=2.5",
               "model.moe.shared_experts=1", "model.moe.ffn_hidden=32", "model.mtp_depth=1",
               "model.mtp_loss_weight=0.3",
               "model.attention_kind=mla", "model.n_kv_heads=null", "model.mla.q_lora_rank=24",
               "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8",
               "model.mla.v_head_dim=12", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
               "model.rope_scaling.original_max_seq_len=16", "model.rope_scaling.mscale=1.0",
               "model.rope_scaling.mscale_all_dim=0.8")
TP2_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
EP2 = ("parallel.ep=2",)

# name: (model, layout, recompute, compile backend or None)
CASES = {
    "qwen3-tp2sp-full": (QWEN3, TP2_SP, "full", None),
    "deepseek-v3-ep2-selective": (DEEPSEEK_V3, EP2, "selective", None),
    "deepseek-v3-ep2-full": (DEEPSEEK_V3, EP2, "full", None),
    "qwen3-tp2sp-compile": (QWEN3, TP2_SP, "none", "aot_eager"),
    "qwen3-moe-ep2-compile-full": (QWEN3_MOE, EP2, "full", "aot_eager"),
    "deepseek-v3-tp2sp-compile-selective": (DEEPSEEK_V3, TP2_SP, "selective", "aot_eager"),
}


def _switches(trainer):
    """(blocks with full recomputation on, attentions with selective on, all blocks) of the trainer's model."""
    from hpctrain.model.transformer import Block

    blocks = [m for m in trainer.model.modules() if isinstance(m, Block)]
    return (sum(b.recompute for b in blocks), sum(b.attn.recompute_core for b in blocks), blocks)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(CASES))
def test_family_recomputed_or_compiled_trains_like_one_process(world, pm, case):
    model, layout, recompute, backend = CASES[case]
    compiled = ("trainer.compile=true", f"trainer.compile_backend={backend}") if backend else ()
    trainer = world_trainer(pm, *BASE, *model, *layout, f"model.recompute={recompute}", *compiled)
    full, selective, blocks = _switches(trainer)
    assert (full, selective) == ((len(blocks), 0) if recompute == "full" else
                                 (0, len(blocks)) if recompute == "selective" else (0, 0))
    if model is DEEPSEEK_V3:
        assert type(blocks[0].attn).__name__ == "MLAttention" and trainer.model.mtp is not None
        assert any(type(b.ffn).__name__ != "SwiGLU" for b in blocks)  # MoE blocks
    else:
        assert blocks[0].attn.q_norm is not None and blocks[0].attn.q_norm.weight.shape == (16,)
    want = shared_reference(BASE + model, STEPS)  # one process, eager, no recomputation
    got = record(trainer, STEPS)
    if model is DEEPSEEK_V3:
        assert any(name.startswith("mtp.") for name in want[0].grads)  # the MTP module trains
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    if backend:
        regions = trainer.parallel.compiled
        assert regions is not None and regions.blocks == len(blocks)
        assert all(b.compiled_forward is not None for b in blocks)
        microbatches = 4 // trainer.mesh.sample_size
        loss_calls = regions.losses * (1 + (1 if model is DEEPSEEK_V3 else 0))  # the MTP module's loss too
        calls_per_step = microbatches * (len(blocks) * (2 if recompute == "full" else 1) + loss_calls)
        assert regions.calls == STEPS * calls_per_step, (regions.calls, calls_per_step)
        assert regions.reported and not regions.stats.failures
