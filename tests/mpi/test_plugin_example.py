"""The worked example of docs/plugins.md is real: its code block, executed
as a plugin module, makes ``parallel.tp=2`` train the same per-step losses
and gradients of every parameter as one process (with the rest of the world
as data parallelism), and shows its all-reduces as ``comm_bytes.tp``.

Tolerances as in test_data_axes: fp32, the tp all-reduce and the dp average
only reassociate sums (losses 1e-6 relative; gradients 1e-5 relative plus
1e-6 of the largest element at step 1, and ``parity.ADAM_DRIFT`` after
AdamW's first step has amplified the rounding differences of near-zero
gradients).
"""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from parity import agreed_config, assert_parity, record, reference_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "comm.bucket_mb=0.05")
STEPS = 2  # the second step runs on weights the first AdamW step moved


def example_plugin() -> types.ModuleType:
    """The ``# example: tp_ffn`` code block of docs/plugins.md, as a module."""
    blocks = re.findall(r"```python\n(# example: tp_ffn\n.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/plugins.md must hold exactly one '# example: tp_ffn' block"
    module = types.ModuleType("tp_ffn_example")
    exec(compile(blocks[0], str(DOC), "exec"), module.__dict__)
    return module


@pytest.mark.mpi(min_size=2)
def test_the_documented_tp_plugin_trains_like_one_process(world, pm):
    from hpctrain.bootstrap import with_device
    from hpctrain.config.validate import validate
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    want = reference_of(BASE, STEPS)
    pm.register(example_plugin(), name="tp_ffn")
    cfg = agreed_config(pm, *BASE, "parallel.tp=2", "parallel.impl.tp=tp_ffn")  # the built-in tp serves tp too
    rt = with_device("cpu")
    assert validate(cfg, rt.world_size, pm) == []
    configure_torch(cfg, rt)
    trainer = Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)
    ffn = trainer.model.layers[0].ffn
    assert type(ffn.linears).__name__ == "ColumnsThenRow" and ffn.w2.weight.shape == (64, 192 // 2)
    assert_parity(record(trainer, STEPS), want, 1e-6, 1e-5, 1e-6)
    assert trainer.metrics["comm_bytes.tp"] > 0
