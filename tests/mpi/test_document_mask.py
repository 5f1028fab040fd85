"""Document masking trains the model of one process under every axis:
with micro-batches whose attention is masked by document and whose RoPE
positions restart at each document (``documents.with_documents``: a
newline ends a document), cp 2 (ring and all-gather, with the zigzag
split), tp 2 (with and without sequence parallelism), pp 2 and ep 2
(``model=tiny-moe``) give the same per-step losses and the same gradient
of every parameter as one process with document masking on; so do cp 2
with full recomputation, and at 4 ranks cp 2 x tp 2 and cp 2 x dp 2.

Micro-batches of 2 samples, so one micro-batch holds samples with
different documents. Tolerances (fp32) as tests/mpi/test_cp.py and
test_tp.py: masking adds no arithmetic (masked scores are exactly zero
weights, and chunk pairs that share no document are not computed, which
adds nothing), so losses agree to 1e-6 relative and gradients to 1e-5
relative plus 1e-6 of the largest element at step 1 and
``parity.ADAM_DRIFT`` afterwards.
"""
from __future__ import annotations

from typing import Dict, Tuple

import pytest
from documents import with_documents
from mpi4py import MPI

from hpctrain.parity import on_rank0

from parity import assert_parity, record, world_trainer

STEPS = 2  # the second step runs on weights the first AdamW step moved
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
MOE = ("model=tiny-moe",)

_REFERENCES: Dict[Tuple[str, ...], list] = {}


def one_process(pm, *model):
    """The one-process run of this model with document masking (once per job)."""
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    key = tuple(model)
    if key not in _REFERENCES:
        def run():
            trainer = with_documents(reference_trainer(compose_resolved(BASE + key, pm), pm))
            records = record(trainer, STEPS, MPI.COMM_SELF)
            seen = trainer.step_runner.seen
            # the documents are there: some samples hold several, and one micro-batch mixes layouts
            assert max(int(mb.segments.max()) for mb in seen) >= 2
            assert any(not bool((mb.segments[0] == mb.segments[1]).all()) for mb in seen)
            return records
        _REFERENCES[key] = on_rank0(MPI.COMM_WORLD, run)  # the other ranks sleep meanwhile
    return _REFERENCES[key]


def _check(pm, model, *layout):
    trainer = with_documents(world_trainer(pm, *BASE, *model, *layout))
    assert_parity(record(trainer, STEPS), one_process(pm, *model), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    return trainer


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("model", [(), MOE], ids=["dense", "moe"])
def test_masking_changes_the_one_process_run(world, pm, model):
    """The parity below has teeth: the reference is not the same run with
    document positions but no mask (a schedule dropping the segments on
    both sides would pass the parity tests, not this)."""
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    unmasked = with_documents(reference_trainer(compose_resolved(BASE + model, pm), pm), segments=False)
    for m, u in zip(one_process(pm, *model), record(unmasked, STEPS, MPI.COMM_SELF)):
        assert abs(m.loss - u.loss) > 1e-4 * abs(u.loss)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_cp2(world, pm, impl):
    trainer = _check(pm, (), "parallel.cp=2", f"parallel.cp_impl={impl}")
    assert type(trainer.model.layers[0].attn.core).__name__ == ("RingAttention" if impl == "ring"
                                                                else "AllGatherAttention")
    mb = trainer.step_runner.seen[0]
    assert mb.inputs.shape == mb.segments.shape == mb.positions.shape == (2, 16)  # this rank's zigzag tokens


@pytest.mark.mpi(min_size=2)
def test_cp2_ring_with_full_recomputation(world, pm):
    """Recomputed blocks replay the ring, segment ids included (same numbers as without recomputation)."""
    _check(pm, (), "parallel.cp=2", "parallel.cp_impl=ring", "model.recompute=full")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_tp2(world, pm, sequence_parallel):
    _check(pm, (), "parallel.tp=2", f"parallel.sequence_parallel={str(sequence_parallel).lower()}")


@pytest.mark.mpi(min_size=2)
def test_pp2(world, pm):
    """Every stage's attention masks: the second stage gets the micro-batch's segments too."""
    _check(pm, (), "parallel.pp=2")


@pytest.mark.mpi(min_size=2)
def test_ep2(world, pm):
    _check(pm, MOE, "parallel.ep=2")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_cp2_tp2(world, pm, impl):
    _check(pm, (), "parallel.cp=2", "parallel.tp=2", f"parallel.cp_impl={impl}")


@pytest.mark.mpi(min_size=4)
def test_cp2_dp2(world, pm):
    _check(pm, (), "parallel.cp=2", "parallel.dp=-1")
