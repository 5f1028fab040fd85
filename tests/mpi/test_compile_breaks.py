"""``trainer.compile=true`` compiles each block through its collectives: no
graph break inside a block (nor in the vocabulary-parallel loss) for the
layouts whose collectives are the core's differentiable ones, counted by the
run's own start-up report (``CompiledRegions.per_region``, dynamo's
counters read around the regions' first calls); compiled losses and every
gradient equal the one-process eager run's (``test_compile``'s tolerances
and references); ``trainer.compile_fullgraph=true`` compiles such a block as
one graph, and stops a layout whose block still breaks with one error naming
the region and the operation (and compiles cp's all-gather attention).

aot_eager (dynamo's tracing and AOTAutograd's joint graph, no code
generation): where a graph breaks is decided by tracing, not by the
backend's kernels (inductor's are measured in ``hpctrain-bench tp --compile``,
docs/benchmarks.md). One-process references are shared with
``test_compile`` (same overrides, same steps).
"""
from __future__ import annotations

import re

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
COMPILE = ("trainer.compile=true", "trainer.compile_backend=aot_eager")

# name: (model overrides, layout overrides, extra); 2 ranks, 2 steps; every region of these compiles without a
# break (cp's with trainer.compile_fullgraph=true: one graph per region or an error)
NO_BREAKS = {
    "tp2": ((), ("parallel.tp=2", "parallel.sequence_parallel=false"), ()),
    "tp2-sp": ((), ("parallel.tp=2", "parallel.sequence_parallel=true"), ()),
    "cp2-allgather": ((), ("parallel.cp=2", "parallel.cp_impl=allgather"), ("trainer.compile_fullgraph=true",)),
    "cp2-ring": ((), ("parallel.cp=2", "parallel.cp_impl=ring"), ()),
    "pp2": (("model.n_layers=4",), ("parallel.pp=2",), ()),
}
# not yet break-free (docs/benchmarks.md, issue 60): ep's dispatch (its counts and plan are host values by design,
# and the router's auxiliary-loss collection reads a context variable)


def _breaks(trainer):
    regions = trainer.parallel.compiled
    assert regions is not None and regions.reported and not regions.stats.failures
    return {kind: count.total_breaks for kind, count in regions.per_region.items()}, regions


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(NO_BREAKS))
def test_blocks_compile_without_graph_breaks(world, pm, name):
    import torch

    # compile afresh: a Block frame compiled by an earlier test of this process (the same code, guards that
    # still hold) would be reused, and this run's start-up report would count no graph for it
    torch._dynamo.reset()
    model, layout, extra = NO_BREAKS[name]
    trainer = world_trainer(pm, *BASE, *model, *layout, *COMPILE, *extra)
    assert_parity(record(trainer, 2), shared_reference(BASE + model, 2), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    breaks, regions = _breaks(trainer)
    assert "Block" in breaks and regions.blocks > 0, regions.report()
    assert breaks == {kind: 0 for kind in breaks}, regions.report()  # blocks and the vocab-parallel loss
    assert regions.per_region["Block"].graphs >= 1 and regions.fullgraph == bool(extra)


@pytest.mark.mpi(min_size=2)
def test_fullgraph_stops_a_breaking_block_in_one_line_naming_the_op(world, pm):
    from hpctrain.errors import ConfigError

    # ep's MoE block still breaks (its dispatch plan is host values)
    trainer = world_trainer(pm, *BASE, "model=tiny-moe", "parallel.ep=2", *COMPILE, "trainer.compile_fullgraph=true")
    with pytest.raises(ConfigError) as e:
        trainer.train_step()
    message = str(e.value)
    assert "\n" not in message and message.startswith("trainer.compile_fullgraph=true: Block does not compile"), message
    assert re.search(r" in \w+ \([\w/]+\.py:\d+\); ", message), message  # the frame that called what broke
    assert message.endswith("set trainer.compile_fullgraph=false to compile it in pieces (the start-up line then "
                            "counts the breaks)"), message


@pytest.mark.mpi(min_size=2)
def test_compiled_sequence_parallelism_moves_the_eager_bytes(world, pm):
    """The compiler keeps sequence parallelism's backward re-gather (``all_gather_along(again=True)``) apart
    from the forward's gather: merged, the step would keep the whole sequence and move 4/5 of the bytes."""
    layout = ("parallel.tp=2", "parallel.sequence_parallel=true")
    steps = {}
    for compiled in (False, True):
        trainer = world_trainer(pm, *BASE, *layout, *(COMPILE if compiled else ()))
        trainer.train_step()
        steps[compiled] = trainer.metrics["comm_bytes.tp"]
    assert steps[True] == steps[False] > 0, steps


@pytest.mark.mpi(min_size=4)
def test_fullgraph_compiles_each_block_at_tp2_cp2(world, pm):
    """tp 2 x cp 2 (sequence parallelism and ring attention in one block): one graph per region, or an error."""
    trainer = world_trainer(pm, *BASE, "parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true", *COMPILE,
                            "trainer.compile_fullgraph=true")
    assert_parity(record(trainer, 2), shared_reference(BASE, 2), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    breaks, regions = _breaks(trainer)
    assert regions.fullgraph and breaks["Block"] == 0 and sum(breaks.values()) == 0, regions.report()
