"""Context parallelism trains the model of one process: cp 2 and 4 give the
same per-step losses and the same gradient of every parameter, for ring
and all-gather attention, with grouped-query attention (the tiny model has
4 query and 2 key/value heads); also cp 2 x dp 2 and cp 2 x tp 2 (sequence
parallelism inside each cp rank's tokens), and bf16 within a looser bound.
Saved attention activations per rank fall as 1/cp.

Tolerances (fp32): context parallelism changes how each query's softmax is
summed (block by block, merged by log-sum-exp) and how gradients add up
over ranks, so losses agree to 1e-6 relative and gradients to 1e-5 relative
plus 1e-6 of the largest element at step 1 and ``parity.ADAM_DRIFT``
afterwards, as for data parallelism. bf16: the one-process run and the cp
run round differently (cp computes attention in fp32 blocks, one process in
bf16 sdpa), so losses agree to 2e-2 relative and gradients to 5e-2 of the
largest element: bf16 keeps 8 bits of mantissa (relative 4e-3 per
rounding) and a step chains dozens of roundings.
"""
from __future__ import annotations

import pytest
import torch

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2  # the second step runs on weights the first AdamW step moved
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6


def one_process(*model_overrides):
    return shared_reference(BASE + tuple(model_overrides), STEPS)


def _check(pm, model, *layout, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL, grad_atol=GRAD_ATOL, later=None):
    trainer = world_trainer(pm, *BASE, *model, *layout)
    kw = {} if later is None else {"later_atol_scale": later}
    assert_parity(record(trainer, STEPS), one_process(*model), loss_rtol, grad_rtol, grad_atol, **kw)
    return trainer


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_cp_trains_like_one_process(world, pm, impl):
    """cp 2 and cp 4 (when the world has 4 ranks), the rest data parallel."""
    for cp in (2, 4):
        if cp <= world.Get_size():
            trainer = _check(pm, (), f"parallel.cp={cp}", f"parallel.cp_impl={impl}")
            core = trainer.model.layers[0].attn.core
            assert type(core).__name__ == ("RingAttention" if impl == "ring" else "AllGatherAttention")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_cp2_with_data_parallelism(world, pm, impl):
    trainer = _check(pm, (), "parallel.cp=2", f"parallel.cp_impl={impl}", "parallel.dp=-1")
    assert trainer.mesh.size("dp") == world.Get_size() // 2


@pytest.mark.mpi(min_size=4)
def test_cp2_with_tensor_parallelism(world, pm):
    _check(pm, (), "parallel.cp=2", "parallel.tp=2")


@pytest.mark.mpi(min_size=2)
def test_bf16(world, pm):
    _check(pm, ("trainer.precision=bf16",), "parallel.cp=2", loss_rtol=2e-2, grad_rtol=0.0, grad_atol=5e-2,
           later=5e-2)


@pytest.mark.mpi(min_size=2)
def test_saved_attention_activations_fall_as_one_over_cp(world, pm):
    """Bytes the attention core saves for backward in one block's forward
    (saved-tensor hooks), per rank: at cp = n they are the one-process
    bytes / n (ring attention keeps only this rank's q, k, v, output and
    log-sum-exp; one process's sdpa keeps the same tensors for the whole
    sequence)."""
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    def saved_bytes(trainer, cp):
        attn = trainer.model.layers[0].attn
        t = 32 // cp
        q = torch.randn(2, 4, t, 16, requires_grad=True)
        k = torch.randn(2, 2, t, 16, requires_grad=True)
        v = torch.randn(2, 2, t, 16, requires_grad=True)
        seen = {}

        def pack(x):
            seen[id(x)] = x.numel() * x.element_size()
            return x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = attn.core(q, k, v)
        out.sum().backward()
        return sum(seen.values())

    one = saved_bytes(reference_trainer(compose_resolved(BASE, pm), pm), 1)
    n = world.Get_size()
    for cp in (2, 4):
        if cp <= n:
            got = saved_bytes(world_trainer(pm, *BASE, f"parallel.cp={cp}"), cp)
            assert got * cp == one, (cp, got, one)
