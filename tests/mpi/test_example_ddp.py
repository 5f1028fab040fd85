"""The example third-party axis plugin (plugins/examples/hpctrain-example-ddp:
the data axes through torch's DistributedDataParallel, written only against
the core's public API) is installed with pip here and trains pp 2 x dp 2
and tp 2 x dp 2 with the same per-step losses and gradients as one process.

Tolerances as the data-parallel parity tests (fp32: DDP's average only
reassociates sums, as ours does): losses 1e-6 relative, gradients 1e-5
relative plus 1e-6 of the largest element (``parity.ADAM_DRIFT`` after the
first update).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain.bootstrap import idle_wait

from parity import assert_parity, record, shared_reference, world_trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "plugins" / "examples" / "hpctrain-example-ddp"
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "model.n_layers=4")
STEPS = 2  # the second step runs on weights the first AdamW step moved


@pytest.fixture(scope="module")
def ddp_pm():
    """A plugin manager that found the example through its entry point, after
    ``pip install`` (rank 0) into a directory every rank then imports from."""
    from hpctrain.plugins import create_manager

    world = MPI.COMM_WORLD
    target, error = None, None
    if world.Get_rank() == 0:
        target = tempfile.mkdtemp(prefix="hpctrain-example-ddp-")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                               "--target", target, str(EXAMPLE)], capture_output=True, text=True)
        error = done.stderr if done.returncode else None
    idle_wait(world)  # the others sleep through rank 0's pip install
    target, error = world.bcast((target, error), root=0)
    assert error is None, error
    sys.path.insert(0, target)
    try:
        pm = create_manager()
        assert "torch-ddp" in dict(pm.list_name_plugin())
        yield pm
    finally:
        sys.path.remove(target)
        world.Barrier()  # (every rank has imported what it needs from the target)
        if world.Get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [("parallel.pp=2",), ("parallel.tp=2",)], ids=["pp2-dp2", "tp2-dp2"])
def test_the_example_ddp_plugin_trains_like_one_process(world, ddp_pm, layout):
    if world.Get_size() != 4:
        pytest.skip("pp 2 x dp 2 and tp 2 x dp 2")
    want = shared_reference(BASE, STEPS)
    trainer = world_trainer(ddp_pm, *BASE, *layout, "parallel.impl.dp=torch-ddp")
    assert trainer.mesh.sizes["dp"] == 2
    handle = trainer.data_handle
    assert type(handle).__name__ == "TorchDDP" and handle.wrappers  # the example's handle, DDP inside
    assert_parity(record(trainer, STEPS), want, 1e-6, 1e-5, 1e-6)
