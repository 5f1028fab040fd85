"""End to end: training the tiny model over the mpi and hier backends gives
the per-step losses of one process.

dp = world size (4 or 8); with emulated nodes of 2 ranks the dp group spans
2 or 4 nodes, so ``hier`` runs its two-level all-reduce. The one-process
reference (``hpctrain.run.reference_trainer``: the same trainer with every
axis of size 1 and local communicators) runs once, on rank 0, while the
other ranks wait without spinning; its losses are then broadcast.
"""
import time

import pytest
from mpi4py import MPI

from hpctrain.run import prepare_run, reference_trainer

from conftest import compose_config

pytestmark = pytest.mark.every_size  # the world size changes what is tested

# fp32: the only difference from one process is the order in which the
# per-rank gradient sums are added (~1e-7 relative per step); 1e-5 leaves
# room for 6 Adam steps amplifying it.
REL_TOL = 1e-5
OVERRIDES = ("trainer.steps=6", "trainer.global_batch_size=16", "trainer.micro_batch_size=2", "trainer.log_every=100")


@pytest.fixture(scope="module")
def reference_losses():
    world = MPI.COMM_WORLD
    losses = None
    if world.Get_rank() == 0:
        losses = [m["loss"] for m in reference_trainer(compose_config(*OVERRIDES)).fit()]
    done = world.Ibarrier()  # the others sleep instead of busy-waiting in a collective
    while not done.Test():
        time.sleep(0.02)
    return world.bcast(losses, root=0)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("backend", ["mpi", "hier"])
def test_training_matches_one_process(world, make_config, shared_tmp, reference_losses, backend):
    cfg = make_config(*OVERRIDES, f"comm.backend={backend}")
    trainer = prepare_run(cfg, shared_tmp)
    dp = trainer.mesh.group("dp").communicator()
    assert dp.backend == backend and dp.size == world.Get_size()
    if backend == "hier":
        assert dp.mode == "hier", "the dp group should span the emulated nodes"
    losses = [m["loss"] for m in trainer.fit()]
    assert losses == pytest.approx(reference_losses, rel=REL_TOL)
    assert losses[-1] < losses[0]
