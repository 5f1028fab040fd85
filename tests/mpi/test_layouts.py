"""Five axes on one mesh: at 8 ranks every combined layout trains the model
of one process, with the same per-step losses and the same gradient of every
parameter (assembled from whichever ranks hold its pieces).

The layouts are the issue's: tp 2 x pp 2 x dp 2 with ZeRO-1; tp 2 x cp 2 x
dp 2; ep 2 x tp 2 x pp 2 on ``tiny-moe``; dp 2 x cp 2 x pp 2 interleaved;
tp 2 x dp 4 with ZeRO-3; and full and selective activation recomputation on
the 3D layout.

Tolerances (fp32), as for each axis alone: a layout changes only where sums
run and in what order, so losses agree to 1e-6 relative and gradients to
1e-5 relative plus 1e-6 of the largest element at step 1 and
``parity.ADAM_DRIFT`` afterwards. A global batch of 8 with micro-batches of
1 gives each pipeline 4 micro-batches; 4 blocks give interleaving a block
per virtual stage.
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
DENSE = ("model.n_layers=4",)
MOE = ("model=tiny-moe", "model.n_layers=4")

LAYOUTS = {
    "tp2-pp2-dp2-zero1": (DENSE, ("parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero.stage=1")),
    "tp2-cp2-dp2": (DENSE, ("parallel.tp=2", "parallel.cp=2", "parallel.dp=2")),
    "ep2-tp2-pp2-moe": (MOE, ("parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "parallel.dp=1")),
    "dp2-cp2-pp2-interleaved": (DENSE, ("parallel.dp=2", "parallel.cp=2", "parallel.pp=2",
                                        "parallel.pipeline.schedule=interleaved", "parallel.pipeline.vpp=2")),
    "tp2-dp4-zero3": (DENSE, ("parallel.tp=2", "parallel.dp=4", "parallel.zero.stage=3")),
    "3d-full-recompute": (DENSE + ("model.recompute=full",),
                          ("parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero.stage=1")),
    "3d-selective-recompute": (DENSE + ("model.recompute=selective",),
                               ("parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero.stage=1")),
}


def one_process(model):
    """The one-process run of this model, without recomputation (which must
    not change a single number), computed once per job."""
    plain = tuple(o for o in model if not o.startswith("model.recompute="))
    return shared_reference(BASE + plain, STEPS)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(world, pm, name):
    if world.Get_size() != 8:
        pytest.skip("the layouts are for 8 ranks")
    model, layout = LAYOUTS[name]
    trainer = world_trainer(pm, *BASE, *model, *layout)
    sizes = trainer.mesh.sizes
    want = dict(o.split("=", 1) for o in layout if o.split("=")[0].split(".")[-1] in sizes)
    assert {f"parallel.{a}": str(n) for a, n in sizes.items() if f"parallel.{a}" in want} == want
    assert_parity(record(trainer, STEPS), one_process(model), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
