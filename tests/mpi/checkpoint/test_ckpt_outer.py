"""DiLoCo and fp16 checkpoints resume bit for bit (``hpctrain.train.outer``,
``hpctrain.train.loss_scale``).

A DiLoCo run over the whole world (every=3) in fp16 (a loss scale that
grows every 2 clean steps) saves at step 4, between outer steps, when the
replicas hold different weights and AdamW moments; a new trainer resumes it
and its step 5 and 6 (the next outer step) give exactly the losses, the
loss scale and every replica's weights of the uninterrupted run. The file
holds the per-replica state as logical tensors with a leading replica
dimension, and the shared anchor and outer momentum once; one process with
DiLoCo (a single replica) refuses it with one line naming parallel.dp. A checkpoint of
plain data parallelism resumes under DiLoCo: every replica and the anchor
start from its weights, and the inner AdamW from its moments.
"""
from __future__ import annotations

import h5py
import pytest
import torch
from mpi4py import MPI

from hpctrain.errors import ConfigError
from hpctrain.parity import on_rank0
from hpctrain.run import reference_trainer

from ckpt_helpers import BASE, build_trainer, config, load_alone

pytestmark = pytest.mark.mpi(min_size=2)
RUN = ("trainer.steps=6", "parallel.dp=-1", "optim.outer=diloco", "optim.outer.every=3", "trainer.precision=fp16",
       "trainer.loss_scale.initial=1024", "trainer.loss_scale.growth_interval=2", "reliability.straggler_every=0")


def _weights(trainer):
    return [p.detach().clone() for p in trainer.params]


def test_diloco_in_fp16_resumes_between_outer_steps_bit_for_bit(shared_tmp):
    straight = build_trainer(*RUN)
    metrics = [straight.train_step() for _ in range(6)]
    want_weights = _weights(straight)
    assert [m["outer_steps"] for m in metrics] == [0, 0, 1, 1, 1, 2]
    assert metrics[-1]["loss_scale"] > metrics[0]["loss_scale"]  # the scale state matters for the resume

    first = build_trainer(*RUN, f"checkpoint.dir={shared_tmp}/diloco", "checkpoint.every=100")
    assert [first.train_step()["loss"] for _ in range(4)] == [m["loss"] for m in metrics[:4]]
    path = first.save_checkpoint(f"{shared_tmp}/diloco-step4.h5")
    first.checkpointer.close()
    MPI.COMM_WORLD.Barrier()

    resumed = build_trainer(*RUN, f"checkpoint.resume={path}")
    assert resumed.step == 4 and resumed.optimizer.inner_steps == 4
    later = [resumed.train_step() for _ in range(2)]
    assert [m["loss"] for m in later] == [m["loss"] for m in metrics[4:]]
    assert [m["loss_scale"] for m in later] == [m["loss_scale"] for m in metrics[4:]]
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed), want_weights))

    replicas = MPI.COMM_WORLD.Get_size()
    with h5py.File(path, "r") as f:
        name = "tok_embeddings.weight"
        model = f[f"/model/{name}"].shape
        assert f[f"/optim/replica.params/{name}"].shape == (replicas,) + model
        assert f[f"/optim/inner.exp_avg/{name}"].shape == (replicas,) + model
        assert f[f"/optim/outer.anchor/{name}"].shape == model
        assert f[f"/optim/outer.momentum_buffer/{name}"].shape == model
        rows = f[f"/optim/replica.params/{name}"][()]
        assert not (rows[0] == rows[1]).all()  # between outer steps the replicas differ
    def refused_alone() -> str:  # one replica cannot take the replicas' state: one clear line
        try:
            load_alone(reference_trainer(config(*BASE, *RUN)), path)
        except ConfigError as e:
            return str(e)
        return "loaded"

    message = on_rank0(MPI.COMM_WORLD, refused_alone)  # (a failure on rank 0 reaches every rank: no hang)
    assert f"saved by DiLoCo with {replicas} dp replicas" in message and \
        f"this run has 1; resume with parallel.dp={replicas}" in message, message


def test_a_plain_checkpoint_resumes_under_diloco(shared_tmp):
    plain = build_trainer("trainer.steps=6", "parallel.dp=-1", f"checkpoint.dir={shared_tmp}/plain",
                          "checkpoint.every=100")
    for _ in range(2):
        plain.train_step()
    path = plain.save_checkpoint(f"{shared_tmp}/plain-step2.h5")
    plain.checkpointer.close()
    MPI.COMM_WORLD.Barrier()
    local = build_trainer(*RUN[:-1], f"checkpoint.resume={path}")
    opt = local.optimizer
    assert local.step == 2 and opt.inner_steps == 0
    assert all(torch.equal(p, q) and torch.equal(a, q) for p, q, a in zip(local.params, plain.params, opt.anchors))
    moments = [(opt.inner.state[p]["exp_avg"], plain.optimizer.state[q]["exp_avg"])
               for p, q in zip(local.params, plain.params)]
    assert all(torch.equal(a, b) for a, b in moments)
    local.train_step()  # and trains on
