"""``trainer.compile=true`` compiles each block through its collectives: no
graph break inside a block (nor in the vocabulary-parallel loss) for the
layouts whose collectives are the core's differentiable ones, counted by the
run's own start-up report (``CompiledRegions.per_region``, dynamo's
counters read around the regions' first calls); compiled losses and every
gradient equal the one-process eager run's (``test_compile``'s tolerances
and references); ``trainer.compile_fullgraph=true`` compiles such a block as
one graph, and stops a layout whose block still breaks with one error naming
the region and the operation.

aot_eager (dynamo's tracing and AOTAutograd's joint graph, no code
generation): where a graph breaks is decided by tracing, not by the
backend's kernels (inductor's are measured in ``hpctrain-bench tp --compile``,
docs/benchmarks.md). One-process references are shared with
``test_compile`` (same overrides, same steps).
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
COMPILE = ("trainer.compile=true", "trainer.compile_backend=aot_eager")

# name: (model overrides, layout overrides); 2 ranks, 2 steps; every region of these compiles without a break
NO_BREAKS = {
    "tp2": ((), ("parallel.tp=2", "parallel.sequence_parallel=false")),
    "tp2-sp": ((), ("parallel.tp=2", "parallel.sequence_parallel=true")),
}


def _breaks(trainer):
    regions = trainer.parallel.compiled
    assert regions is not None and regions.reported and not regions.stats.failures
    return {kind: count.total_breaks for kind, count in regions.per_region.items()}, regions


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(NO_BREAKS))
def test_blocks_compile_without_graph_breaks(world, pm, name):
    model, layout = NO_BREAKS[name]
    trainer = world_trainer(pm, *BASE, *model, *layout, *COMPILE)
    assert_parity(record(trainer, 2), shared_reference(BASE + model, 2), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    breaks, regions = _breaks(trainer)
    assert "Block" in breaks, regions.report()
    assert breaks == {kind: 0 for kind in breaks}, regions.report()  # blocks and the vocab-parallel loss
    assert regions.per_region["Block"].graphs >= 1


@pytest.mark.mpi(min_size=2)
def test_fullgraph_compiles_a_tensor_parallel_block(world, pm):
    trainer = world_trainer(pm, *BASE, "parallel.tp=2", "parallel.sequence_parallel=true", *COMPILE,
                            "trainer.compile_fullgraph=true")
    assert_parity(record(trainer, 1), shared_reference(BASE, 2)[:1], LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    breaks, regions = _breaks(trainer)
    assert regions.fullgraph and breaks["Block"] == 0
