"""Qwen3-MoE at ep 2 x tp 2 (4 ranks; tiny models made with transformers' own Qwen3MoeConfig and saved in the
test, loaded with ``checkpoint.init_from=hf:DIR``): losses and the gradient of every parameter equal one
process loaded the same way, and the first step's loss is transformers' own on that step's batch.

- ``raw``: norm_topk_prob=false (the router's probabilities themselves weigh the experts), MoE in both
  blocks: each ep rank holds 2 of the 4 experts (of their own width, moe_intermediate_size 32), the
  attention (qk-norm) is split over tp;
- ``norm-step2``: norm_topk_prob=true with decoder_sparse_step=2 (block 0 a dense MLP of intermediate_size
  96, split column/row-parallel over tp; block 1 MoE), with sequence parallelism.

And trained 3 steps at ep 2 x pp 2 (``raw``), ``hpctrain-ckpt export`` writes a Qwen3MoeForCausalLM whose
transformers logits equal those of the saved checkpoint loaded here in one process (1e-5 relative).

Tolerances as tests/mpi/test_qwen.py (fp32: the layouts only regroup sums).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from mpi4py import MPI
from qwen_models import hf_loss, qwen3_moe_config, save

from hf_models import batch, hf_logits, hf_model
from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
MAKERS = {"raw": lambda: qwen3_moe_config(norm_topk_prob=False),
          "norm-step2": lambda: qwen3_moe_config(norm_topk_prob=True, decoder_sparse_step=2)}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    comm = MPI.COMM_WORLD
    root = comm.bcast(str(tmp_path_factory.mktemp("qwen3moe")) if comm.Get_rank() == 0 else None, root=0)
    dirs = {name: os.path.join(root, name) for name in MAKERS}
    if comm.Get_rank() == 0:
        for name, make in MAKERS.items():
            save(make(), dirs[name])
    comm.Barrier()
    return dirs


CASES = [("raw", ("parallel.ep=2", "parallel.tp=2")),
         ("norm-step2", ("parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"))]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("which,layout", CASES, ids=["raw-ep2-tp2", "norm-step2-ep2-tp2sp"])
def test_qwen3_moe_trains_like_one_process(world, pm, moe_dirs, which, layout):
    model = hf_model(moe_dirs[which])
    trainer = world_trainer(pm, *BASE, *model, *layout)
    moe = trainer.model.layers[1].ffn
    assert moe.experts.local == 2 and tuple(moe.experts.w1.shape) == (2, 32, 64)  # 2 of 4 experts, width 32
    assert moe.cfg.norm_topk_prob is (which != "raw")
    first_batch = trainer.orders.train[0].batch(range(4))  # step 1's global batch (samples 0-3)
    got = record(trainer, STEPS)
    assert_parity(got, shared_reference(BASE + model, STEPS), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    want = hf_loss(moe_dirs[which], first_batch)  # transformers' own loss (labels=)
    assert abs(got[0].loss - want) <= 1e-5 * want, (got[0].loss, want)


@pytest.mark.mpi(min_size=4)
def test_export_after_training_at_ep2_pp2_loads_in_transformers(world, pm, moe_dirs):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    from hpctrain_h5ckpt import cli

    root = os.path.join(os.path.dirname(moe_dirs["raw"]), "trained")
    ckpt, out = os.path.join(root, "ck"), os.path.join(root, "export")
    trainer = world_trainer(pm, *BASE, *hf_model(moe_dirs["raw"]), "parallel.ep=2", "parallel.pp=2",
                            "trainer.steps=3", "checkpoint.every=3", f"checkpoint.dir={ckpt}")
    trainer.fit()
    if world.Get_rank() == 0:
        assert cli.main(["export", ckpt, "--to", out]) == 0
        assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["Qwen3MoeForCausalLM"]
        saved = os.path.join(ckpt, "step_00000003.h5")
        ours = reference_trainer(compose_resolved(
            BASE + ("model=hf", f"model.hf_dir={moe_dirs['raw']}", f"checkpoint.init_from={saved}"), pm), pm).model
        ours.eval()
        ids = batch()
        with torch.no_grad():
            want = ours(ids)
        got = hf_logits(out, ids)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert (got - hf_logits(moe_dirs["raw"], ids)).abs().max() > 1e-3  # three steps changed the model
    world.Barrier()
