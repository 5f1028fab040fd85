"""Multi-head latent attention (DeepSeek-V3's, ``model.attention_kind=mla``) under tensor, sequence and context
parallelism at 4 ranks: the losses and the gradient of every parameter equal one process's.

The models are tiny (d_model 64, 2 layers, 4 heads), with every MLA part: the low-rank query (q_lora_rank 24,
its norm), the key/value latent of 16 with a shared rotary key of 8 dims, value heads of 12 dims against
q/k heads of 8 + 8, and yarn RoPE with both mscale terms (cos/sin and the softmax scale change).

- a random all-dense DeepseekV3ForCausalLM made with transformers and loaded with
  ``checkpoint.init_from=hf:DIR`` (each rank reading its heads' rows of q_b_proj, kv_b_proj and o_proj):
  - at tp 2 with sequence parallelism x cp 2 (ring attention): the heads are split over tp (wq_b and wkv_b
    column-parallel, wo row-parallel), the down-projections and latent norms are whole on every rank with
    their gradients summed over tp (each projects its own sequence shard), the latents are all-gathered;
    ring attention sends keys and values of different head sizes around the cp ring; the first step's
    loss is transformers' own;
  - at tp 2 without sequence parallelism x cp 2 (all-gather attention): every tp rank projects every
    token, the latents' gradient is all-reduced on the way out of the heads' region;
- the plain query projection (q_lora_rank null, DeepSeek-V2-Lite's; the model's own init) at tp 2 with
  sequence parallelism x cp 2;
- the imported DeepseekV3 with an MoE second layer (8 experts in 4 groups, top-2 from the best 2, a shared
  expert, random selection biases read into the routers' buffers) at ep 2 x tp 2 with sequence parallelism:
  the routed experts split over ep, the shared expert and the latent attention over tp; the first step's
  loss is transformers' own.

Tolerances as tests/mpi/test_qwen.py (fp32: the layouts only regroup sums).
"""
from __future__ import annotations

import os

import pytest
from deepseek_models import deepseek_config, deepseek_moe_config, draw_expert_bias
from mpi4py import MPI
from qwen_models import hf_loss

from hf_models import hf_model, save
from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
PLAIN_Q = ("model.attention_kind=mla", "model.n_kv_heads=null", "model.mla.q_lora_rank=null",
           "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8",
           "model.mla.v_head_dim=12", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
           "model.rope_scaling.original_max_seq_len=16", "model.rope_scaling.mscale=1.0",
           "model.rope_scaling.mscale_all_dim=0.8")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
TP_CP = ("parallel.tp=2", "parallel.cp=2")
CASES = {
    "deepseek-v3-tp2sp-cp2-ring": ("hf", TP_CP + ("parallel.sequence_parallel=true", "parallel.cp_impl=ring")),
    "deepseek-v3-tp2-cp2-allgather": ("hf", TP_CP + ("parallel.sequence_parallel=false",
                                                     "parallel.cp_impl=allgather")),
    "plain-q-tp2sp-cp2-ring": ("plain", TP_CP + ("parallel.sequence_parallel=true", "parallel.cp_impl=ring")),
    "deepseek-v3-moe-ep2-tp2sp": ("moe", ("parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true")),
}


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    comm = MPI.COMM_WORLD
    root = comm.bcast(str(tmp_path_factory.mktemp("deepseek")) if comm.Get_rank() == 0 else None, root=0)
    dirs = {"hf": os.path.join(root, "v3"), "moe": os.path.join(root, "v3-moe")}
    if comm.Get_rank() == 0:
        save(deepseek_config(), dirs["hf"])
        draw_expert_bias(save(deepseek_moe_config(), dirs["moe"]))
    comm.Barrier()
    return dirs


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("case", list(CASES))
def test_mla_trains_like_one_process(world, pm, deepseek_dirs, case):
    which, layout = CASES[case]
    model = BASE + (PLAIN_Q if which == "plain" else hf_model(deepseek_dirs[which]))
    trainer = world_trainer(pm, *model, *layout)
    attn = trainer.model.layers[0].attn
    assert type(attn.linears).__name__ == "TensorParallelLatentLinears"
    assert type(attn.core).__name__ == ("AllGatherAttention" if "allgather" in case else
                                        "RingAttention" if "cp2" in case else "SdpaAttention")
    assert attn.wkv_b.weight.shape == (2 * (8 + 12), 16) and attn.wo.weight.shape == (64, 2 * 12)
    assert attn.wkv_a.weight.shape == (16 + 8, 64)  # whole on every rank
    first_batch = trainer.orders.train[0].batch(range(4))  # step 1's global batch (samples 0-3)
    got = record(trainer, STEPS)
    assert_parity(got, shared_reference(model, STEPS), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    if which != "plain":
        want = hf_loss(deepseek_dirs[which], first_batch)  # transformers' own loss (labels=)
        assert abs(got[0].loss - want) <= 1e-5 * want, (got[0].loss, want)
