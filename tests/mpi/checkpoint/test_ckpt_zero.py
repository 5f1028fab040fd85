"""ZeRO checkpoints hold logical tensors: stage and dp size are both free on
resume. A ZeRO-3 run on the whole world saves at step 2 and one process
resumes it; one process saves at step 2 and ZeRO-2 on the whole world
resumes it; both continue with the losses of an uninterrupted one-process
run (fp32: relative 1e-6, the parity tests' tolerance: only the order of
the data-parallel sums differs)."""
from __future__ import annotations

import pytest
from mpi4py import MPI

from hpctrain.bootstrap import idle_wait
from hpctrain.run import reference_trainer

from ckpt_helpers import BASE, alone_checkpointer, config, load_alone, losses

pytestmark = pytest.mark.mpi(min_size=2)
STEPS = ("trainer.steps=4",)



def _world_trainer(*overrides):
    from ckpt_helpers import build_trainer

    return build_trainer(*STEPS, *overrides)



@pytest.fixture(scope="module")
def straight():
    """The uninterrupted one-process losses of 4 steps."""
    return losses(reference_trainer(config(*BASE, *STEPS)), 4)


def test_zero3_on_the_world_resumes_in_one_process(shared_tmp, straight):
    trainer = _world_trainer("parallel.zero.stage=3", f"checkpoint.dir={shared_tmp}", "checkpoint.every=100")
    assert losses(trainer, 2) == pytest.approx(straight[:2], rel=1e-6)
    path = trainer.save_checkpoint(f"{shared_tmp}/zero3.h5")
    MPI.COMM_WORLD.Barrier()
    alone = reference_trainer(config(*BASE, *STEPS))
    load_alone(alone, path)
    assert alone.step == 2 and alone.cursor.consumed_samples == 16
    assert losses(alone, 2) == pytest.approx(straight[2:], rel=1e-6)


def test_one_process_resumes_as_zero2_on_the_world(shared_tmp, straight):
    path = f"{shared_tmp}/alone.h5"
    if MPI.COMM_WORLD.Get_rank() == 0:
        alone = reference_trainer(config(*BASE, *STEPS))
        losses(alone, 2)
        alone_checkpointer().save(alone.state, path)
    idle_wait(MPI.COMM_WORLD)
    trainer = _world_trainer("parallel.zero.stage=2", f"checkpoint.resume={path}")
    assert trainer.step == 2
    state = trainer.optimizer.shard_states()
    assert state and all(int(s["step"]) == 2 for s in state)  # Adam's step came back with the moments
    assert losses(trainer, 2) == pytest.approx(straight[2:], rel=1e-6)
