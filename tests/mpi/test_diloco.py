"""DiLoCo / local SGD over the dp replicas (``optim.outer=diloco``,
``hpctrain.train.outer``).

- ``every=4`` at dp 4 (and, ``every=2``, at cp 2 x dp 2: the cp gradient
  average stays inside a replica; at tp 2 x dp 2; and tp 2 x pp 2 as one replica: the
  outer step over a replica's tensor and pipeline pieces, tied to the
  simulation's single one-process trainer) trains what a one-process simulation of
  the replicas trains: each replica a one-process trainer fed its dp rank's
  samples (inner AdamW, clipped with its own norm), and every ``every``
  steps the replicas' deltas averaged and ``torch.optim.SGD`` with Nesterov
  momentum stepping the shared weights, written here from the DiLoCo paper.
  The same per-step losses and the same weights of every replica, also in
  the middle of a round (5 steps with every=4).
- ``every=1, lr=1, momentum=0`` is plain data parallelism: with an inner
  update linear in the gradient (SGD; no clipping, which is per replica)
  the weights after 3 steps and the losses are plain dp's. (With AdamW the
  average of the replicas' updates is not the update of the averaged
  gradient; the simulation test covers that case.)
- ``comm_bytes.dp`` per step is 1/every of plain dp's (the parameters once
  per round against the gradients every step; ``dtype=bf16`` halves it).

Tolerances (fp32): the runs differ only in where fp32 sums run (cp's ring
attention and all-reduce, the all-reduce of deltas against a sum in one
process, tp's split sums): losses 5e-5 relative against the simulation
(AdamW at lr 1e-2 from step 1, then the outer step's 0.7 x (1 + 0.9) on
the delta, magnify fp32 reassociation: ~6e-6 with tp on the machine this
was written on, 1.1e-5 at tp 2 x pp 2 on another CPU, whose matrix kernels
round differently, which is why the bound is 5e-5 and not 1e-5; a wrong
average or clipping norm is off by 5e-4 or more, 10x the bound), 1e-6 against plain dp with an SGD
inner step (no AdamW to magnify anything); weights 1e-5 relative plus 5e-2 of the
inner learning rate (AdamW turns a rounding difference in a gradient near
its epsilon into an update difference of up to ~1e-2 of lr per inner step, as
``parity.ADAM_DRIFT`` explains for gradients, and three inner steps with an
outer step's 1.33x between them add up: 2.4e-2 of lr measured on one element
at tp 2 x pp 2 on the second CPU; a missing, doubled or misplaced average is
off by whole updates, ~lr, on most elements, 20x the bound).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest
import torch
from mpi4py import MPI

from parity import world_trainer

LR = 0.01
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.straggler_every=0",
        "reliability.weight_check_every=0", "optim.warmup_steps=1", f"optim.lr={LR}")
OUTER = ("optim.outer=diloco", "optim.outer.lr=0.7", "optim.outer.momentum=0.9")
RTOL = 1e-6

LOSS_RTOL = 5e-5
"""Losses against the simulation (the module docstring: measured 1.1e-5 at most; a wrong average 5e-4)."""
ADAM_DRIFT_LR = 5e-2
"""Weights against the simulation, in units of the inner lr (the module docstring: measured 2.4e-2)."""


def replica_weights(trainer) -> Dict[int, Dict[str, torch.Tensor]]:
    """Every replica's logical weights (gathered to every rank), by dp rank."""
    from hpctrain.parity import assemble_gathered
    from hpctrain.shard import get_spec

    mesh = trainer.mesh
    pieces = []
    for p in trainer.params:
        spec = get_spec(p)
        for piece in spec.pieces(mesh.coords, mesh.sizes):
            pieces.append((spec.logical_name, spec.global_shape, piece.box, piece.take(p.detach()).clone()))
    everyone = MPI.COMM_WORLD.allgather((mesh.rank("dp"), pieces))
    out = {}
    for r in sorted({r for r, _ in everyone}):
        weights, diffs = assemble_gathered([found for rr, found in everyone if rr == r])
        assert not diffs, f"ranks of replica {r} hold different weights: {diffs}"
        out[r] = weights
    return out


def simulate(overrides: Sequence[str], replicas: int, every: int, steps: int, lr: float, momentum: float
             ) -> Tuple[List[float], List[Dict[str, torch.Tensor]]]:
    """(per-step mean loss over replicas, each replica's weights after ``steps``), in this process."""
    from hpctrain.config import compose_resolved
    from hpctrain.data import DataCursor
    from hpctrain.run import reference_trainer
    from hpctrain.shard import get_spec

    cfg = compose_resolved(tuple(overrides))
    assert cfg.optim.outer.name == "none"
    sims = []
    for r in range(replicas):  # each replica: one process fed dp rank r's share of every global batch
        t = reference_trainer(cfg)
        t.cursor = DataCursor(t.orders.train, cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, r,
                              replicas, weights=t.orders.weights)
        t.prefetch = None
        sims.append(t)
    anchor = [p.detach().clone() for p in sims[0].params]
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
    losses = []
    for step in range(1, steps + 1):
        losses.append(sum(t.train_step()["loss"] for t in sims) / replicas)
        if step % every == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    a.grad = sum(a - t.params[i].detach() for t in sims) / replicas
                outer.step()
                for t in sims:
                    for a, p in zip(anchor, t.params):
                        p.copy_(a)
    return losses, [{get_spec(p).logical_name: p.detach().clone() for p in t.params} for t in sims]


def _close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str, adam: bool = True) -> None:
    """Weights within the module docstring's tolerance (``adam=False``: an SGD inner step, no AdamW drift)."""
    assert set(got) == set(want)
    for name, ref in want.items():
        atol = ADAM_DRIFT_LR * LR if adam else RTOL * float(ref.abs().max())
        torch.testing.assert_close(got[name], ref, rtol=1e-5 if adam else RTOL, atol=atol,
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,every", [(("parallel.dp=4",), 4), (("parallel.cp=2", "parallel.dp=2"), 2),
                                          (("parallel.tp=2", "parallel.dp=2"), 2),
                                          (("parallel.tp=2", "parallel.pp=2", "parallel.dp=1"), 2)],
                         ids=["dp4-every4", "cp2-dp2-every2", "tp2-dp2-every2", "tp2-pp2-one-replica-every2"])
def test_replicas_train_like_a_one_process_simulation(world, pm, layout, every):
    steps = every + 1  # a whole round, then one step into the next
    trainer = world_trainer(pm, *BASE, *OUTER, f"optim.outer.every={every}", *layout)
    replicas = trainer.mesh.size("dp")
    got = [trainer.train_step() for _ in range(steps)]
    want_losses, want_weights = simulate(BASE, replicas, every, steps, 0.7, 0.9)
    for step, (m, w) in enumerate(zip(got, want_losses), start=1):
        assert abs(m["loss"] - w) <= LOSS_RTOL * abs(w), (step, m["loss"], w)
        assert m["outer_steps"] == step // every
    weights = replica_weights(trainer)
    assert sorted(weights) == list(range(replicas))
    for r in range(replicas):
        _close(weights[r], want_weights[r], f"replica {r} after {steps} steps")
    if replicas > 1:  # mid-round the replicas differ (each trained alone since the outer step)
        assert any(not torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


def _sgd_inner(trainer) -> None:
    inner = torch.optim.SGD(trainer.params, lr=LR)
    if hasattr(trainer.optimizer, "inner"):
        trainer.optimizer.inner = inner
    else:
        trainer.optimizer = inner


@pytest.mark.mpi(min_size=2)
def test_every_1_lr_1_momentum_0_is_plain_data_parallelism(world, pm):
    plain_sgd = ("optim.grad_clip=0", "parallel.dp=-1")
    local = world_trainer(pm, *BASE, *plain_sgd, "optim.outer=diloco", "optim.outer.every=1", "optim.outer.lr=1",
                          "optim.outer.momentum=0")
    plain = world_trainer(pm, *BASE, *plain_sgd)
    for t in (local, plain):
        _sgd_inner(t)
    a = [local.train_step()["loss"] for _ in range(3)]
    b = [plain.train_step()["loss"] for _ in range(3)]
    assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b)), (a, b)
    got, want = replica_weights(local), replica_weights(plain)
    for r in got:
        _close(got[r], want[r], f"replica {r}", adam=False)
    assert len(got) == world.Get_size() and local.optimizer.outer_steps == 3


@pytest.mark.mpi(min_size=2)
def test_dp_bytes_per_step_are_one_every_th_of_plain_data_parallelism(world, pm):
    every = 2
    plain = world_trainer(pm, *BASE, "parallel.dp=-1")
    plain_bytes = [plain.train_step()["comm_bytes.dp"] for _ in range(every)]
    for dtype, factor in (("fp32", 1.0), ("bf16", 0.5)):
        local = world_trainer(pm, *BASE, *OUTER, f"optim.outer.every={every}", f"optim.outer.dtype={dtype}",
                              "parallel.dp=-1")
        local_bytes = [local.train_step()["comm_bytes.dp"] for _ in range(every)]
        # the gradient norm's all-reduce runs over the same group every step: small against either
        ratio = (sum(local_bytes) / every) / (sum(plain_bytes) / every)
        assert abs(ratio - factor / every) <= 2e-3, (dtype, local_bytes, plain_bytes)
        assert local_bytes[0] < 1e-3 * local_bytes[-1]  # nothing but the norm inside a round
