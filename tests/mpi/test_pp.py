"""Pipeline parallelism trains the model of one process: every schedule at
pp 2 and 4 gives the same per-step losses and the same gradient of every
parameter (each assembled from the stage that holds it), and so do
interleaving, an uneven split, tied embeddings (with ZeRO too), and pp
with dp, tp and ZeRO 1-3 around it.

Tolerances (fp32), as for data parallelism: a pipeline changes only where
each micro-batch's backward runs and how gradients are summed over
micro-batches and data ranks, so losses agree to 1e-6 relative and
gradients to 1e-5 relative plus 1e-6 of the largest element at step 1 and
``parity.ADAM_DRIFT`` afterwards. A global batch of 8 with micro-batches of
1 gives each pipeline 2 to 8 micro-batches.
"""
from __future__ import annotations

import pytest

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2  # the second step runs on weights the first AdamW step moved
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
FOUR = ("model.n_layers=4",)
EIGHT = ("model.n_layers=8",)

def one_process(*model_overrides):
    """The one-process run of this model (computed once per job)."""
    return shared_reference(BASE + tuple(model_overrides), STEPS)


def _check(pm, model, *layout):
    trainer = world_trainer(pm, *BASE, *model, *layout)
    assert_parity(record(trainer, STEPS), one_process(*model), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    return trainer


def _pp_sizes(n):
    return [pp for pp in (2, 4) if pp <= n]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_schedule_trains_like_one_process(world, pm, schedule):
    for pp in _pp_sizes(world.Get_size()):
        trainer = _check(pm, FOUR, f"parallel.pp={pp}", f"parallel.pipeline.schedule={schedule}")
        names = {n for n, _ in trainer.model.named_parameters()}
        r = trainer.mesh.coords["pp"]
        mine = {str(i) for i in range(4)[r * 4 // pp:(r + 1) * 4 // pp]}
        assert {n.split(".")[1] for n in names if n.startswith("layers.")} == mine
        assert ("tok_embeddings.weight" in names) == (r == 0) and ("output.weight" in names) == (r == pp - 1)


@pytest.mark.mpi(min_size=2)
def test_interleaved(world, pm):
    """vpp 2: pp 2 on 4 blocks (a block per virtual stage); pp 4 on 8 (at 4 ranks)."""
    for pp in _pp_sizes(world.Get_size()):
        model = FOUR if pp == 2 else EIGHT
        trainer = _check(pm, model, f"parallel.pp={pp}", "parallel.pipeline.schedule=interleaved",
                         "parallel.pipeline.vpp=2")
        assert len(trainer.model.chunks) == 2


@pytest.mark.mpi(min_size=2)
def test_uneven_split(world, pm):
    trainer = _check(pm, FOUR, "parallel.pp=2", "parallel.pipeline.layers=[1,3]")
    held = sorted(int(n.split(".")[1]) for n, _ in trainer.model.named_parameters() if n.startswith("layers."))
    assert sorted(set(held)) == ([0] if trainer.mesh.coords["pp"] == 0 else [1, 2, 3])


@pytest.mark.mpi(min_size=2)
def test_auto_split_is_the_planners(world, pm):
    """``parallel.pipeline.layers=auto`` counts the embedding and the head on
    the end stages as the planner does (``hpctrain.pipeline.split``): a
    1024-token vocabulary weighs 1.33 blocks of this model, so 8 blocks on
    pp 2 x vpp 2 split [1, 3, 3, 1] (the even split would be [2, 2, 2, 2]);
    the planner's layout for this mesh assumes the same split, and the
    uneven interleaved pipeline trains like one process."""
    from hpctrain.planner.arch import Arch
    from hpctrain.planner.layouts import Layout, planned_layers

    model = EIGHT + ("model.vocab_size=1024",)
    trainer = _check(pm, model, "parallel.pp=2", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.vpp=2")
    names = [n.split(".") for n, _ in trainer.model.named_parameters()]  # chunks.<c>.layers.<block>...
    held = sorted({int(n[n.index("layers") + 1]) for n in names if "layers" in n})
    # rank 0 runs virtual stages 0 and 2, rank 1 stages 1 and 3
    assert held == ([0, 4, 5, 6] if trainer.mesh.coords["pp"] == 0 else [1, 2, 3, 7])
    lay = Layout(tp=1, cp=1, ep=1, dp=world.Get_size() // 2, pp=2, micro_batch=1, schedule="interleaved", vpp=2)
    assert planned_layers(Arch.from_model_config(trainer.cfg.model), lay) == (1, 3, 3, 1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_tied_embeddings(world, pm, schedule):
    """The first stage's embedding and the last stage's output projection are
    one logical tensor: each end holds a copy, their gradients are summed."""
    vpp = ("parallel.pipeline.vpp=2",) if schedule == "interleaved" else ()
    _check(pm, FOUR + ("model.tie_embeddings=true",), "parallel.pp=2", f"parallel.pipeline.schedule={schedule}",
           *vpp)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage, schedule", [(1, "1f1b"), (2, "zb-h1"), (3, "interleaved")])
def test_tied_embeddings_with_zero(world, pm, stage, schedule):
    """Under ZeRO the two copies' gradients are summed over the shards: the
    copy is a flat group of its own at both ends, cut alike."""
    vpp = ("parallel.pipeline.vpp=2",) if schedule == "interleaved" else ()
    _check(pm, FOUR + ("model.tie_embeddings=true",), "parallel.pp=2", f"parallel.zero.stage={stage}",
           f"parallel.pipeline.schedule={schedule}", *vpp)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("stage, schedule", [(2, "1f1b"), (3, "interleaved")])
def test_tied_embeddings_with_hierarchical_zero(world, pm, stage, schedule):
    """``shard_group=node`` with tied embeddings, pp 2 x dp 4 on 4 emulated
    nodes of 2 ranks: each stage's dp group spans 2 nodes, ZeRO cuts its
    flat groups over a node's 2 ranks and replicates them across the nodes,
    and the two ends' tied-table shards still meet element for element."""

    vpp = ("parallel.pipeline.vpp=2",) if schedule == "interleaved" else ()
    model = FOUR + ("model.tie_embeddings=true",)
    layout = ("parallel.pp=2", f"parallel.zero.stage={stage}", "parallel.zero.shard_group=node",
              f"parallel.pipeline.schedule={schedule}", *vpp)
    trainer = world_trainer(pm, *BASE, *model, *layout, rank_nodes=[r // 2 for r in range(world.Get_size())])
    flats = trainer.data_handle.flats
    assert flats and all(fg.group.size == 2 and fg.replicas.size == 2 for fg in flats)
    assert_parity(record(trainer, STEPS), one_process(*model), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)


# zb-h1 as well: its weight pass writes .grad by hand and marks it ready
# with the gradient-sync engine (views under dp, copy-in under ZeRO-1), and
# under tp its B and W both run tp's custom autograd functions
AROUND = ["1f1b", "zb-h1"]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule", AROUND)
def test_pp2_with_data_parallelism(world, pm, schedule):
    trainer = _check(pm, FOUR, "parallel.pp=2", f"parallel.pipeline.schedule={schedule}")
    assert trainer.mesh.sizes["dp"] == world.Get_size() // 2


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule", AROUND)
def test_pp2_with_tensor_parallelism(world, pm, schedule):
    _check(pm, FOUR, "parallel.pp=2", "parallel.tp=2", f"parallel.pipeline.schedule={schedule}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule", AROUND)
def test_pp2_with_zero1(world, pm, schedule):
    _check(pm, FOUR, "parallel.pp=2", "parallel.zero.stage=1", f"parallel.pipeline.schedule={schedule}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage, schedule", [(2, "1f1b"), (2, "interleaved"), (3, "gpipe"), (3, "1f1b"),
                                             (3, "interleaved"), (3, "zb-h1")])
def test_pp2_with_zero23(world, pm, stage, schedule):
    """ZeRO-2/3 under a pipeline: gradients accumulate whole through the step
    (the stages' backwards interleave) and are reduce-scattered once after the
    last; stage 3 gathers each unit, interleaved chunks' units included. The
    bytes held after the steps are the plugin's formula (in flight: at most).

    The planner's memory for this rank's stage agrees: its model states to
    the byte (the tiny model's flat groups need no padding here); its buffers
    are the whole gradient plus, at stage 3, three gathered blocks (the
    current, the prefetched and the stage's last, kept for its backward),
    where the plugin gathers its actual units (the embedding and the head
    are smaller than a block): an upper bound within one block."""
    from hpctrain.planner.arch import Arch
    from hpctrain.planner.estimate import Workload, stage_memory
    from hpctrain.planner.layouts import Layout
    from hpctrain.planner.memory import HPCTRAIN

    from hpctrain_zero.memory import measured

    vpp = ("parallel.pipeline.vpp=2",) if schedule == "interleaved" else ()
    trainer = _check(pm, FOUR, "parallel.pp=2", f"parallel.zero.stage={stage}",
                     f"parallel.pipeline.schedule={schedule}", *vpp)
    setup = trainer.data_handle
    want, seen = setup.memory, measured(setup, trainer.model, trainer.optimizer)
    assert (seen.params, seen.grads, seen.optimizer) == (want.params, want.grads, want.optimizer)
    assert 0 < seen.in_flight <= want.in_flight

    cfg = trainer.cfg
    arch = Arch.from_model_config(cfg.model)
    lay = Layout(tp=1, cp=1, ep=1, dp=world.Get_size() // 2, pp=2, micro_batch=cfg.trainer.micro_batch_size,
                 zero=stage, schedule=schedule, vpp=len(vpp) + 1)
    planned = stage_memory(arch, lay, Workload(cfg.trainer.global_batch_size, cfg.trainer.seq_len, "fp32", HPCTRAIN),
                           trainer.mesh.coords["pp"])
    assert not setup.unsharded
    assert (planned.weights, planned.grads, planned.optimizer) == (want.params, want.grads, want.optimizer)
    block = 4 * arch.layer_params_per_rank(1, 1)
    if stage == 2:
        assert planned.buffers == want.in_flight  # the whole gradient
    else:
        assert want.in_flight <= planned.buffers <= want.in_flight + block
