"""Data axes: expert-parallel ranks are data-parallel for every dense weight.

On the dense tiny model (no experts), ``parallel.ep`` only splits the
samples, so any dp x ep layout must train exactly the model of one process:
the same per-step losses and the same gradient of every parameter (after the
gradient sync, before clipping), and ``comm_bytes.<group>`` must show the
averaging going over the whole ``ep+dp`` group. Several layouts run in one
session against one shared one-process reference.

Tolerances (fp32): the layouts differ from one process only in how the sum
over samples is associated (per-rank means averaged by an all-reduce instead
of one accumulation), ~1e-7 relative per step; 2 steps of AdamW keep losses
within 1e-6 relative and gradients within 1e-5 relative plus 1e-6 of the
largest element (elements near zero have no meaningful relative error).
A missed reduction, a rank reading another's samples or an average over the
wrong group moves them by orders of magnitude more.
"""
from __future__ import annotations

import pytest

from parity import agreed_config, assert_parity, record, reference_of

STEPS = 2  # the second step runs on weights the first AdamW step moved
BASE = ("trainer.steps=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32",
        "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100", "comm.bucket_mb=0.05")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6


def _layouts(n):
    """(dp, ep) pairs whose product is the world size, ep > 1."""
    return [(n // ep, ep) for ep in (2, 4, 8) if ep <= n and n % ep == 0]


@pytest.fixture(scope="module")
def one_process():
    return reference_of(BASE, STEPS)


def _run(world, pm, dp, ep, backend):
    from hpctrain.bootstrap import with_device
    from hpctrain.config.validate import validate
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    cfg = agreed_config(pm, *BASE, f"parallel.dp={dp}", f"parallel.ep={ep}", f"comm.backend={backend}")
    rt = with_device("cpu")
    assert validate(cfg, rt.world_size, pm) == []
    configure_torch(cfg, rt)
    trainer = Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)
    return trainer, record(trainer, STEPS)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["torch", pytest.param("mpi", marks=pytest.mark.every_size)])  # ep 8 at 8 ranks
def test_dp_times_ep_trains_like_one_process(world, pm, one_process, backend):
    n = world.Get_size()
    layouts = _layouts(n) if backend == "torch" else _layouts(n)[-1:]  # keeps the 8-rank session short
    for dp, ep in layouts:
        trainer, got = _run(world, pm, dp, ep, backend)
        mesh = trainer.mesh
        assert (mesh.size("dp"), mesh.size("ep")) == (dp, ep)
        assert trainer.cursor.sample_size == n and trainer.cursor.num_microbatches == 8 // n
        assert_parity(got, one_process, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL, later_atol_scale=GRAD_ATOL)
        # dense gradients are averaged over the whole ep x dp group, by one engine
        name = "ep+dp" if dp > 1 else "ep"
        assert trainer.metrics[f"comm_bytes.{name}"] > 0
        others = {k: v for k, v in trainer.metrics.items() if k.startswith("comm_bytes.") and k != f"comm_bytes.{name}"}
        assert all(v == 0 for v in others.values()), others
