"""Qwen2 and Qwen3 under tensor, sequence, context and data parallelism at 4 ranks (tiny models made with
transformers' own classes and saved in the test, loaded with ``checkpoint.init_from=hf:DIR``): losses and
the gradient of every parameter equal one process loaded the same way, and the first step's loss is
transformers' own on that step's batch.

- Qwen3 with a decoupled head size (8 heads of 16 over a hidden size of 64) at tp 2 with sequence
  parallelism x cp 2: the qk-norm weights are whole on every rank and their gradient is summed over tp
  (each rank normalises its own heads), the output projection is row-parallel over 128 query dims;
- Qwen2 at tp 2 x dp 2: the q/k/v biases are cut with their weights' rows;
- Qwen2 at tp 4 over its 2 key/value heads: each k/v head, and its biases, replicated on two ranks, which
  sum their gradients.

Tolerances as tests/mpi/test_hf.py (fp32: the layouts only regroup sums).
"""
from __future__ import annotations

import os

import pytest
from mpi4py import MPI
from qwen_models import hf_loss, qwen2_config, qwen3_config, save

from hf_models import hf_model
from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    comm = MPI.COMM_WORLD
    root = comm.bcast(str(tmp_path_factory.mktemp("qwen")) if comm.Get_rank() == 0 else None, root=0)
    makers = {"qwen2": qwen2_config, "qwen3-head16": lambda: qwen3_config(head_dim=16)}
    dirs = {name: os.path.join(root, name) for name in makers}
    if comm.Get_rank() == 0:
        for name, make in makers.items():
            save(make(), dirs[name])
    comm.Barrier()
    return dirs


CASES = [("qwen3-head16", ("parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true")),
         ("qwen2", ("parallel.tp=2", "parallel.dp=2")),
         ("qwen2", ("parallel.tp=4",))]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("which,layout", CASES, ids=["qwen3-tp2sp-cp2", "qwen2-tp2-dp2", "qwen2-tp4-kv-replicated"])
def test_qwen_trains_like_one_process(world, pm, qwen_dirs, which, layout):
    model = hf_model(qwen_dirs[which])
    trainer = world_trainer(pm, *BASE, *model, *layout)
    attn = trainer.model.layers[0].attn
    assert type(attn.linears).__name__ == "TensorParallelLinears"
    if which == "qwen2":
        tp = trainer.mesh.sizes["tp"]
        assert attn.wq.bias.shape == (64 // tp,) and attn.wk.bias.shape == (16 // min(tp, 2),)
    else:
        assert attn.q_norm.weight.shape == (16,) and attn.wo.weight.shape == (64, 128 // 2)
    first_batch = trainer.orders.train[0].batch(range(4))  # step 1's global batch (samples 0-3)
    got = record(trainer, STEPS)
    assert_parity(got, shared_reference(BASE + model, STEPS), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    want = hf_loss(qwen_dirs[which], first_batch)  # transformers' own loss (labels=)
    assert abs(got[0].loss - want) <= 1e-5 * want, (got[0].loss, want)
