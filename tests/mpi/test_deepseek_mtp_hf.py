"""DeepSeek-V3's multi-token prediction layer read lazily at a 4-rank layout: a Hugging Face directory holding
an MTP layer (``model.layers.2``, ``num_nextn_predict_layers`` 1: hpctrain's export, ``write_hf_dir``, of a
model of tests/deepseek_models.py's MoE shape with ``model.mtp_depth=1``, its norms drawn away from ones) is loaded with
``model=hf checkpoint.init_from=hf:DIR model.mtp_depth=1`` at ep 2 x pp 2, each rank reading its slices (the
MTP module on the last stage, its block's experts split over ep), and trains as the one-process import of the
same directory: per-step losses (the MTP term included) and the gradient of every parameter. The first step's
MTP loss is the exported model's. Tolerances as tests/mpi/test_deepseek_moe.py.
"""
from __future__ import annotations

import os

import pytest
import torch
from deepseek_models import deepseek_moe_config, draw_expert_bias
from mpi4py import MPI

from hpctrain.parity import on_rank0

from hf_models import SEQ, hf_model, save
from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", f"trainer.seq_len={SEQ}", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0", "model.mtp_depth=1",
        "model.mtp_loss_weight=0.3")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The export's directory (made on rank 0), the same path on every rank."""
    comm = MPI.COMM_WORLD
    root = comm.bcast(str(tmp_path_factory.mktemp("mtp")) if comm.Get_rank() == 0 else None, root=0)
    out = os.path.join(root, "out")

    def make():
        from hpctrain.config import compose_resolved
        from hpctrain.hf.export import Entry, write_hf_dir
        from hpctrain.plugins import get_manager
        from hpctrain.run import reference_trainer

        src = draw_expert_bias(save(deepseek_moe_config(), os.path.join(root, "hf")))
        pm = get_manager()
        cfg = compose_resolved(BASE + ("model=hf", f"model.hf_dir={src}"), pm)
        trainer = reference_trainer(cfg, pm)
        with torch.no_grad():  # norms away from ones (our init), so that one read from the wrong place shows
            g = torch.Generator().manual_seed(5)
            for name, p in trainer.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
        # written as hpctrain-ckpt export writes a checkpoint's tensors (a checkpoint save here, on rank 0 alone,
        # would wait for the other ranks in its MPI-IO)
        tensors = dict(trainer.model.named_parameters())
        tensors.update((n, b) for n, b in trainer.model.named_buffers() if n.endswith("router.expert_bias"))
        write_hf_dir(out, cfg.model, [Entry(n, tuple(t.shape), lambda t=t: t.detach().float())
                                      for n, t in tensors.items()])

    on_rank0(comm, make)  # (a failure there is raised on every rank)
    return out


@pytest.mark.mpi(min_size=4)
def test_an_mtp_layer_read_at_ep2_pp2_trains_like_one_process(world, pm, exported):
    model = BASE + hf_model(exported)
    want = shared_reference(model, STEPS)
    assert any(n.startswith("mtp.layers.2.block.ffn.experts") for n in want[0].grads)
    trainer = world_trainer(pm, *model, "parallel.ep=2", "parallel.pp=2")
    got = record(trainer, STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
