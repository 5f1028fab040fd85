"""LoRA dropout (``finetune.lora.dropout`` > 0) under tensor parallelism at 2 ranks: what is guaranteed.

Dropout masks come from torch's global generator (every rank's starts from the same state: torch's own
seed, or the state a checkpoint restored; a test seeds it with ``torch.manual_seed`` on both sides), one
mask per adapter, drawn where the adapter's input is (``hpctrain.finetune.lora``):

- column-parallel targets (q, k, v, gate, up) without sequence parallelism: the input is whole on every tp
  rank, so each rank draws the mask of the whole input, in the order and shape one process draws it: the
  run equals the one-process run with the same seed, losses and every adapter gradient (tp 2, dropout 0.1;
  against the same one-process run with dropout 0, the second step's loss differs: the masks matter);
- with sequence parallelism, or on a row-parallel target (o, down), each rank masks only the part of the
  input it holds (its tokens; its columns), a mask of another shape than one process's, so the masks, and
  the run, are not one process's (a valid dropout: each element masked once, with probability p). What
  holds then: every replicated piece (A of a column-parallel adapter, B of a row-parallel one) is
  identical on every rank at every step (``record`` checks it), the loss is the same on every rank, and
  the first step's loss (B still zero, the adapters add nothing) is one process's.
"""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from hpctrain.parity import on_rank0

from parity import assert_parity, record, world_trainer

STEPS = 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
SEED = 1234
COLUMNS = ("finetune=lora", "finetune.lora.rank=4", "finetune.lora.dropout=0.1",
           "finetune.lora.targets=[q,k,v,gate,up]", "optim.warmup_steps=0", "optim.lr=0.01",
           "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.device=cpu",
           "trainer.progress=off", "trainer.log_every=100")
ALL = tuple(o for o in COLUMNS if not o.startswith("finetune.lora.targets")) + (
    "finetune.lora.targets=[q,k,v,o,gate,up,down]",)


def _seeded_reference(overrides):
    """The one-process run of ``overrides`` on rank 0, torch's global generator seeded with SEED first."""
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import get_manager
    from hpctrain.run import reference_trainer

    def run():
        trainer = reference_trainer(compose_resolved(tuple(overrides), get_manager()), get_manager())
        torch.manual_seed(SEED)
        return record(trainer, STEPS, MPI.COMM_SELF)

    return on_rank0(MPI.COMM_WORLD, run)


def _seeded_world(pm, *overrides):
    trainer = world_trainer(pm, *overrides)
    torch.manual_seed(SEED)
    return record(trainer, STEPS)


@pytest.mark.mpi(min_size=2)
def test_column_parallel_targets_without_sequence_parallelism_draw_one_process_masks(world, pm):
    want = _seeded_reference(COLUMNS)
    no_dropout = _seeded_reference(tuple(o for o in COLUMNS if "dropout" not in o))
    assert abs(want[1].loss - no_dropout[1].loss) > 1e-4 * abs(want[1].loss)  # the masks matter
    got = _seeded_world(pm, *COLUMNS, "parallel.tp=2", "parallel.sequence_parallel=false")
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", ["true", "false"], ids=["tp2-sp", "tp2"])
def test_rank_local_masks_keep_replicas_identical(world, pm, sp):
    want = _seeded_reference(ALL)
    got = _seeded_world(pm, *ALL, "parallel.tp=2", f"parallel.sequence_parallel={sp}")  # replicas checked
    losses = world.allgather([r.loss for r in got])
    assert all(mine == losses[0] for mine in losses)
    assert abs(got[0].loss - want[0].loss) <= LOSS_RTOL * abs(want[0].loss)  # step 1: B zero
    assert all(torch.isfinite(g).all() and float(g.abs().max()) > 0 for g in got[-1].grads.values())
