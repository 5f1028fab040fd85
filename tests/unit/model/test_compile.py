"""``trainer.compile`` in one process: the start-up report (regions, graphs,
graph breaks by where), and the two fallbacks, each one warning and a run
that goes on eagerly with the eager numbers: inductor without a C++
compiler (nothing is compiled), and a graph its backend fails to compile
(that graph runs as captured). Backends here are aot_eager and a failing
one registered by the test: what is checked is the wiring, not inductor's
kernels (tests/mpi/test_compile.py runs inductor)."""
from __future__ import annotations

import pytest
import torch

from hpctrain.config import compose_resolved
from hpctrain.model.transformer import Block
from hpctrain.run import reference_trainer

BASE = ("trainer.global_batch_size=2", "trainer.micro_batch_size=2", "trainer.seq_len=16", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "trainer.steps=2")


def _losses(pm, *overrides):
    trainer = reference_trainer(compose_resolved(BASE + overrides, pm), pm)
    return trainer, [trainer.train_step()["loss"] for _ in range(2)]


@pytest.fixture(scope="module")
def eager_losses():
    from hpctrain.plugins import create_manager

    pm = create_manager()
    return _losses(pm)[1]


def test_report_names_regions_graphs_and_the_selective_recomputation_break(pm, capsys, eager_losses):
    trainer, losses = _losses(pm, "trainer.compile=true", "trainer.compile_backend=aot_eager",
                              "model.recompute=selective")
    assert losses == eager_losses  # aot_eager runs the same aten ops as eager
    regions = trainer.parallel.compiled
    assert regions is not None and regions.reported and regions.calls == 2 * (2 + 1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compile (")]
    assert len(lines) == 1, lines  # once, after the first step
    line = lines[0]
    assert line.startswith("compile (aot_eager): 3 regions (2 blocks, 1 loss), ")
    assert "eager recomputed" in line  # the attention core's checkpoint: an eager island inside the block
    breaks = int(line.split(" graph breaks")[0].rsplit(" ", 1)[1])
    assert breaks >= 1


def test_inductor_without_a_cxx_compiler_warns_once_and_trains_eagerly(pm, capsys, eager_losses):
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):  # the compilers inductor looks for
        trainer, losses = _losses(pm, "trainer.compile=true", "trainer.compile_backend=inductor")
    assert trainer.parallel.compiled is None
    assert all(b.compiled_forward is None for b in trainer.model.modules() if isinstance(b, Block))
    assert losses == eager_losses
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "trainer.compile=true" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), err
    assert "C++ compiler" in warnings[0] and "training eagerly" in warnings[0]
    assert "trainer.compile_backend=aot_eager" in warnings[0]  # the fix


def _fail(gm, example_inputs):
    raise RuntimeError("no kernels today")


def test_a_graph_that_fails_to_compile_runs_eagerly_with_one_warning(pm, capsys, eager_losses):
    torch._dynamo.register_backend(name="hpctrain_test_failing")(_fail)
    trainer, losses = _losses(pm, "trainer.compile=true", "trainer.compile_backend=hpctrain_test_failing")
    assert losses == eager_losses
    regions = trainer.parallel.compiled
    assert regions is not None and regions.calls > 0 and regions.stats.failures
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("warning: compile (")]
    assert len(lines) == 1, err
    assert "failed to compile and run eagerly (RuntimeError: no kernels today)" in lines[0]
    assert "trainer.compile=false" in lines[0]


@pytest.mark.parametrize("deterministic", [True, False])
def test_inductor_follows_trainer_deterministic(pm, deterministic):
    """``trainer.deterministic`` sets inductor's own deterministic mode (nothing compiles until a call)."""
    import torch._inductor.config as inductor_config

    from hpctrain.model.build import build_model
    from hpctrain.model.compile import compile_regions

    model = build_model(compose_resolved(BASE, pm), pm)
    with inductor_config.patch(deterministic=not deterministic):  # (restored afterwards)
        regions = compile_regions(model, "inductor", deterministic, True)
        assert regions is not None and regions.blocks == 2 and regions.losses == 1
        assert inductor_config.deterministic is deterministic


def test_compile_table_compares_each_compiled_contender_with_itself_eager():
    from hpctrain.bench.common import COMPILED, compile_table

    samples = {"tp[mpi]": [0.2, 0.4, 0.3], "tp[mpi]" + COMPILED: [0.1, 0.1, 0.3], "torch-TP": [1.0, 1.0, 1.0]}
    table = compile_table(samples, {"tp[mpi]": 5.0, "tp[mpi]" + COMPILED: 5.0, "torch-TP": 5.0}, "inductor")
    assert len(table.rows) == 1
    # medians 300 and 100 ms; per round 0.5, 0.25, 1.0
    assert table.rows[0][:5] == ["tp[mpi]", "300.0", "100.0", "0.333", "0.500"]
