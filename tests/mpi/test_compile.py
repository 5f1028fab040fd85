"""``trainer.compile=true`` trains the model of one process under every axis:
the compiled layout's per-step losses and every parameter's gradient match
the one-process *eager* run (the axes' own references, shared with their
test modules), with the compiled regions really run (their call count) and
compiled code on the block (dynamo's cache entries of ``Block._forward``).

Backends. tp (with sequence parallelism and selective recomputation) runs
inductor, the backend a user gets: generated C++ kernels, fused differently
from eager, between tp's collectives. dp, pp (with full recomputation), cp, ep,
ZeRO-3 and tp 2 x pp 2 at 4 ranks (tp's collectives inside pipeline stages)
run aot_eager (dynamo's tracing, the graph breaks at our collectives and AOTAutograd's
joint graph, without code generation): what these axes add to compilation
is where the graphs break and how backward is replayed, not the kernels (dp
adds nothing inside a block's graph: its gradient hooks fire on the leaves),
and inductor's C++ compilation of each axis's graphs (tens of seconds per
graph on a loaded 2-core machine, cold) would multiply the suite's time.
The tests share one inductor cache (tests/conftest.py sets
``TORCHINDUCTOR_CACHE_DIR``) and, within a session, dynamo's compiled code.

Tolerances (fp32), as for the axes' own tests: losses within 1e-6
relative, gradients within 1e-5 relative plus 1e-6 of the largest element
at step 1 and ``parity.ADAM_DRIFT`` afterwards; inductor reorders fp32
reductions inside a fused kernel, worth ~1e-7 relative.
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
MOE = ("model=tiny-moe",)
FOUR = ("model.n_layers=4",)

# name: (model overrides, layout overrides, backend); 2 ranks, 2 steps (the axes' own tests' references)
TWO_RANKS = {
    "dp2": ((), ("parallel.dp=2",), "aot_eager"),
    "tp2-sp-selective": (("model.recompute=selective",), ("parallel.tp=2", "parallel.sequence_parallel=true"),
                         "inductor"),
    "pp2-1f1b-full": (FOUR + ("model.recompute=full",), ("parallel.pp=2", "parallel.pipeline.schedule=1f1b"),
                      "aot_eager"),
    "cp2-ring": ((), ("parallel.cp=2", "parallel.cp_impl=ring"), "aot_eager"),
    "ep2-moe": (MOE, ("parallel.ep=2",), "aot_eager"),
    "dp2-zero3": ((), ("parallel.dp=2", "parallel.zero.stage=3"), "aot_eager"),
}
# 4 ranks, 2 steps (the pp2 reference above)
FOUR_RANKS = {
    "tp2-pp2-full": (FOUR + ("model.recompute=full",), ("parallel.tp=2", "parallel.pp=2"), "aot_eager"),
}


def one_process(model, steps):
    """The eager one-process run (recomputation changes no number: left out, so the reference is shared)."""
    plain = tuple(o for o in model if not o.startswith("model.recompute="))
    return shared_reference(BASE + plain, steps)


def _check(pm, layouts, name, steps):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from hpctrain.model.transformer import Block

    model, layout, backend = layouts[name]
    trainer = world_trainer(pm, *BASE, *model, *layout, "trainer.compile=true", f"trainer.compile_backend={backend}")
    regions = trainer.parallel.compiled
    blocks = [m for m in trainer.model.modules() if isinstance(m, Block)]
    assert regions is not None and regions.blocks == len(blocks) > 0
    assert all(b.compiled_forward is not None for b in blocks)
    assert_parity(record(trainer, steps), one_process(model, steps), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    # every block and loss call went through a compiled region, and the block's code has compiled entries
    microbatches = 8 // trainer.mesh.sample_size
    calls_per_step = microbatches * (regions.blocks * (2 if "model.recompute=full" in model else 1)
                                     + regions.losses)
    assert regions.calls == steps * calls_per_step, (regions.calls, calls_per_step)
    assert _debug_get_cache_entry_list(Block._forward.__code__)
    assert regions.reported and not regions.stats.failures
    return trainer


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_compiled_layout_trains_like_one_process(world, pm, name):
    _check(pm, TWO_RANKS, name, steps=2)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_compiled_tp_pp_layout_trains_like_one_process(world, pm, name):
    _check(pm, FOUR_RANKS, name, steps=2)
