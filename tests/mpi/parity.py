"""Parity with one process, for every parallel feature's multi-rank tests.

``record(trainer, steps)`` (``hpctrain.parity.record``, gathered to every
rank) trains ``steps`` steps and returns, per step, the logged loss and
gradient norm and the gradient of every parameter as a logical tensor;
pieces that several ranks hold must agree exactly. The same call on
``hpctrain.run.reference_trainer(cfg)`` (one process inside this rank) gives
the reference; ``assert_parity`` compares the two elementwise.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from mpi4py import MPI

from hpctrain.parity import StepRecord, on_rank0
from hpctrain.parity import record as _record


def data_parallel(model, mesh, cfg, pm):
    """The data axes' handle for ``model`` (real tensors, any nn.Module) set up
    as the trainer's composition sets up its model: ShardSpecs, the chosen
    plugin's ``hpctrain_parallelize``, then ``after_materialize`` (which
    attaches the gradient-sync engine). Drive it with ``before_backward``
    and ``reduce_gradients``; ``handle.model`` is the model."""
    from hpctrain.model.build import assign_specs
    from hpctrain.plugins import axis_plugin, parallelize_caller

    assign_specs(model)
    handle = parallelize_caller(pm, axis_plugin(pm, cfg, "dp"))(model=model, axis="dp", mesh=mesh, cfg=cfg,
                                                                run_dir=None)
    handle.after_materialize()
    return handle


def record(trainer, steps: int, comm=None) -> List[StepRecord]:
    """``hpctrain.parity.record`` to every rank; replicas of a piece must agree exactly."""
    out = _record(trainer, steps, comm)
    for step, r in enumerate(out, start=1):
        assert not r.replica_diffs, f"step {step}: replicas of one piece differ: {r.replica_diffs}"
    return out


_REFERENCES: Dict[Tuple[Tuple[str, ...], int], List["StepRecord"]] = {}


def shared_reference(overrides: Tuple[str, ...], steps: int) -> List["StepRecord"]:
    """``reference`` of the config these overrides compose, computed once per
    MPI job (several test modules compare layouts with the same model)."""
    key = (tuple(overrides), steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_of(overrides, steps)
    return _REFERENCES[key]


def agreed_config(pm, *overrides: str):
    """The typed config for ``overrides``, composed on rank 0 and received by the
    others, as a job's ranks get it (``compose_agreed``). Collective."""
    from hpctrain.config import compose_agreed

    return compose_agreed(overrides, pm, MPI.COMM_WORLD)


def world_trainer(pm, *overrides: str, rank_nodes: Optional[Sequence[int]] = None):
    """A Trainer on the whole MPI world for these overrides (CPU), the config
    validated as a run validates it. ``rank_nodes`` (the node of every world
    rank) emulates a node layout for this trainer alone."""
    from hpctrain.bootstrap import with_device
    from hpctrain.config.validate import validate
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    cfg = agreed_config(pm, *overrides)
    rt = with_device("cpu")
    if rank_nodes is not None:
        rt = dataclasses.replace(rt, rank_nodes=tuple(rank_nodes))
    assert validate(cfg, rt.world_size, pm) == []
    configure_torch(cfg, rt)
    return Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)


def reference_of(overrides: Sequence[str], steps: int, pm=None) -> List[StepRecord]:
    """``reference`` of the config ``overrides`` compose (with the plugins'
    schema: ``model.moe`` and the like), composed on rank 0 alone, which runs it."""
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import get_manager

    return on_rank0(MPI.COMM_WORLD, lambda: _record_alone(compose_resolved(tuple(overrides), pm or get_manager()),
                                                          steps, pm))


def reference(cfg, steps: int, pm=None) -> List[StepRecord]:
    """``record`` of the one-process run of ``cfg``, on every rank: rank 0 runs it
    while the others sleep (every rank running the same one-process run would take
    the world size times the cores of one)."""
    return on_rank0(MPI.COMM_WORLD, lambda: _record_alone(cfg, steps, pm))


def _record_alone(cfg, steps: int, pm) -> List[StepRecord]:
    from hpctrain.run import reference_trainer

    return record(reference_trainer(cfg, pm), steps, MPI.COMM_SELF)


ADAM_DRIFT = 1e-4
"""Gradient tolerance after the first optimizer step, times the reference
gradient's largest element. The first AdamW step moves every weight by
lr * g / (|g| + eps): for an element whose gradient is near eps (1e-8) a
reassociation difference of 1e-10 in g changes its update by ~1e-2 of lr, so
the weights of two layouts that agree to fp32 rounding at step 1 differ
slightly afterwards, and their next gradients by up to ~1.5e-5 of the
largest element (measured with the tensor-parallel example; data
parallelism stays below 1e-6). A real error (a missing reduction, a wrong
shard, a token seen twice) is off by 1e-3 or more."""


def assert_parity(got: List[StepRecord], want: List[StepRecord], loss_rtol: float, grad_rtol: float,
                  grad_atol_scale: float, later_atol_scale: float = ADAM_DRIFT) -> None:
    """Same per-step losses (relative ``loss_rtol``) and, for every
    parameter, the same gradient: elementwise within ``grad_rtol`` relative
    plus ``grad_atol_scale`` times the reference gradient's largest element
    at step 1 (same weights on both sides), ``later_atol_scale`` times it
    afterwards (see ``ADAM_DRIFT``)."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        scale = grad_atol_scale if step == 1 else max(grad_atol_scale, later_atol_scale)
        assert abs(g.loss - w.loss) <= loss_rtol * abs(w.loss), f"step {step}: loss {g.loss!r} != {w.loss!r}"
        assert set(g.grads) == set(w.grads), \
            f"step {step}: gradients of {sorted(set(g.grads) ^ set(w.grads))} differ in presence"
        for name, ref in w.grads.items():
            torch.testing.assert_close(g.grads[name], ref, rtol=grad_rtol,
                                       atol=scale * float(ref.abs().max()),
                                       msg=lambda m, name=name, step=step: f"step {step}, gradient of {name}: {m}")


def logical_params(trainer, comm=None) -> Dict[str, torch.Tensor]:
    """Every parameter of ``trainer`` as its logical tensor, gathered to every
    rank of ``comm`` (default the MPI world; a one-process trainer passes
    ``MPI.COMM_SELF``) from the pieces each rank holds (a ZeRO-3 shard's
    included); replicas of a piece must agree exactly."""
    from hpctrain.parity import assemble_gathered
    from hpctrain.shard import get_spec

    mesh = trainer.mesh
    mine = []
    for p in trainer.model.parameters():
        spec = get_spec(p)
        for piece in spec.pieces(mesh.coords, mesh.sizes):
            mine.append((spec.logical_name, spec.global_shape, piece.box,
                         piece.take(p.detach()).to("cpu", torch.float32).clone()))
    out, diffs = assemble_gathered((comm or MPI.COMM_WORLD).allgather(mine))
    assert not diffs, f"replicas of one parameter piece differ: {diffs}"
    return out
