"""LAMB, LARS and Muon train the model of one process under tp 2 x dp 2
with ZeRO-1 and with ZeRO-3, and under pp 2 x dp 2: the same per-step
losses, the same gradient of every parameter, and the same parameters after
3 steps.

What each layout must get right: LAMB's and LARS's trust ratios need the
norm of each logical tensor while tp and ZeRO split it (summed over exactly
the axes that split it, each element once); Muon orthogonalises each whole
matrix, assembled from its tp and ZeRO pieces, with the Newton-Schulz work
spread over the stage's ranks.

Tolerances (fp32): losses 1e-6 relative and gradients 1e-5 relative plus
1e-6 of the largest element at step 1 (only the association of the
data-parallel sums differs, as in test_zero), ``parity.ADAM_DRIFT``
afterwards (LAMB's and Muon's AdamW part divide by sqrt(v) + eps as AdamW
does); parameters after 3 steps within 1e-4 of the largest element of each
tensor: an element whose gradient is near eps moves by a slightly different
Adam step (the same drift, here times LAMB's lr of 0.02), while a real error
(a shard orthogonalised alone, a norm of a piece) changes whole steps, which
move weights by a few percent of the largest.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from mpi4py import MPI

from hpctrain.parity import on_rank0

from parity import assert_parity, logical_params, record, world_trainer

STEPS = 3
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", f"trainer.steps={STEPS}")
LAYOUTS = {
    "tp2-dp2-zero1": ("parallel.tp=2", "parallel.zero.stage=1"),
    "tp2-dp2-zero3": ("parallel.tp=2", "parallel.zero.stage=3"),
    "pp2-dp2": ("parallel.pp=2",),
}
OPTIMIZERS = ("lamb", "lars", "muon")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL, PARAM_ATOL = 1e-6, 1e-5, 1e-6, 1e-4

_REFERENCE: Dict[str, Tuple[List, Dict[str, torch.Tensor]]] = {}


def reference(name: str):
    """(records, parameters after STEPS) of the one-process run, once per job."""
    if name not in _REFERENCE:
        from hpctrain.config import compose_resolved
        from hpctrain.run import reference_trainer

        def run():
            trainer = reference_trainer(compose_resolved((*BASE, f"optim={name}")))
            return record(trainer, STEPS, MPI.COMM_SELF), logical_params(trainer, MPI.COMM_SELF)
        _REFERENCE[name] = on_rank0(MPI.COMM_WORLD, run)  # the others sleep meanwhile
    return _REFERENCE[name]


def inner(optimizer):
    """The core optimizer (ZeRO's holds one of its shards)."""
    return optimizer.optimizers[0] if hasattr(optimizer, "optimizers") else optimizer


def assert_same_params(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=0, atol=PARAM_ATOL * float(ref.abs().max()),
                                   msg=lambda m, name=name: f"parameter {name} after {STEPS} steps: {m}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_trains_like_one_process(world, pm, name, layout):
    from hpctrain.optimizers.muon import Muon

    trainer = world_trainer(pm, *BASE, f"optim={name}", *LAYOUTS[layout])
    opt = inner(trainer.optimizer)
    assert type(opt).__name__.lower() == name
    if isinstance(opt, Muon):  # every rank of the stage orthogonalises a share, each matrix once
        owners = opt.plan.owner
        assert sorted(owners) == [i for i, m in enumerate(opt.is_matrix) if m]
        assert set(owners.values()) == set(range(opt.group.size)) and opt.group.size > 1
    want, want_params = reference(name)
    assert_parity(record(trainer, STEPS), want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    assert_same_params(logical_params(trainer), want_params)
    if "zero" in layout:  # the ZeRO memory log counts this optimizer's state to the byte
        from hpctrain_zero.memory import measured

        handle = trainer.data_handle
        assert measured(handle, trainer.model, trainer.optimizer).optimizer == handle.memory.optimizer


NORM_LAYOUTS = {**LAYOUTS, "tp4-kv-replicated": ("parallel.tp=4",)}
"""With tp 4 and 2 key/value heads, each head's rows are held by 2 tp ranks (a replica on the splitting axis)."""


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", list(NORM_LAYOUTS))
@pytest.mark.parametrize("name", ("lamb", "lars"))
def test_trust_ratio_norms_are_the_logical_tensors_norms(world, pm, name, layout):
    """Each tensor's norm, from the pieces a rank holds and the per-axis
    reductions, is the norm of the one-process tensor (here the initial
    weights, the same in every layout), on every rank. A trust ratio is a
    quotient of two such norms, so a tensor counted twice in both leaves it
    unchanged: this is where counting a replica twice shows."""
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    trainer = world_trainer(pm, *BASE, f"optim={name}", *NORM_LAYOUTS[layout])
    opt = inner(trainer.optimizer)
    if layout.startswith("tp4"):
        assert max(max(r) for r in opt.norms.replicas) == 2  # the key/value rows
    values = [None] * len(opt.specs)
    for p in opt.held():
        values[opt.slot[id(p)]] = [p, torch.ones_like(p)]
    got = opt.norms.squares(values, 2, torch.device("cpu"))
    one = reference_trainer(compose_resolved((*BASE, f"optim={name}")))
    want = {n: p.detach() for n, p in one.model.named_parameters()}
    for spec, (w2, ones) in zip(opt.specs, got.tolist()):
        logical = want[spec.logical_name]
        assert ones == logical.numel(), f"{spec.logical_name}: {ones} elements counted, not {logical.numel()}"
        assert w2 == pytest.approx(float(logical.double().pow(2).sum()), rel=1e-12), spec.logical_name


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_is_bit_exact_and_continues_at_another_layout(world, pm, shared_tmp, name):
    """tp 2 x dp 2 with ZeRO-3 saves after step 2 (the optimizer state as
    logical tensors); resumed on the same layout, step 3 gives bit for bit
    the loss and parameters of the uninterrupted run; resumed at pp 2 x dp 2
    (the state resharded), the same within the parity tolerances."""
    here, there = LAYOUTS["tp2-dp2-zero3"], LAYOUTS["pp2-dp2"]
    # the uninterrupted run saves after step 2 and goes on (a save changes nothing it computes)
    saving = world_trainer(pm, *BASE, f"optim={name}", *here, f"checkpoint.dir={shared_tmp}", "checkpoint.every=100")
    losses = [saving.train_step()["loss"] for _ in range(2)]
    path = saving.save_checkpoint(f"{shared_tmp}/{name}.h5")
    losses.append(saving.train_step()["loss"])
    want = logical_params(saving)
    saving.checkpointer.close()
    world.Barrier()
    for layout, exact in ((here, True), (there, False)):
        resumed = world_trainer(pm, *BASE, f"optim={name}", *layout, f"checkpoint.resume={path}")
        assert resumed.step == 2
        loss = resumed.train_step()["loss"]
        got = logical_params(resumed)
        if exact:
            assert loss == losses[2]
            assert all(torch.equal(got[n], want[n]) for n in want), \
                [n for n in want if not torch.equal(got[n], want[n])]
        else:
            assert loss == pytest.approx(losses[2], rel=LOSS_RTOL)
            assert_same_params(got, want)
        if resumed.checkpointer is not None:
            resumed.checkpointer.close()
