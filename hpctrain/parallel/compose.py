"""How a layout is built: one function, top to bottom.

``parallelize`` takes the one-process model on the meta device and applies
each axis's implementation in a fixed order, inside out, then makes the
weights real, then the optimizer and the step schedule:

1. **tensor** (``tp``): cut the projections, embedding and head; fill the
   model's projection and norm seams;
2. **context** (``cp``): replace the attention core (ring or all-gather);
3. **expert** (``ep``): keep this rank's experts;
4. **pipeline** (``pp``): keep this rank's stage(s); the pipeline's handle
   gives the step schedule;
5. **recomputation** (``model.recompute``): on the blocks this rank runs;
   then **compilation** (``trainer.compile``): each block's forward and the
   loss, inside the recomputation's checkpoint (``hpctrain.model.compile``);
6. **data** (``dp``, standing for the data axes ``cp x ep x dp``): how
   gradients are reduced (plain data parallelism, ZeRO, or a third party's);
7. **weights**: allocate this rank's pieces and fill them from the
   layout-independent init; gradients of weights a forward collective
   already sums over a data axis are scaled to an average
   (``grad_sync.presummed``); the handles attach what needs real weights;
8. **optimizer** (the data handle's, e.g. ZeRO's sharded one; else an
   optimizer plugin's, ``hpctrain_make_optimizer``; else the core's
   ``optim.name``: AdamW, LAMB, LARS or Muon, ``hpctrain.optimizers``),
   wrapped by the outer optimizer when there is one (``optim.outer=diloco``:
   ``hpctrain.train.outer``; its dp replicas train alone: the mesh was built
   with ``dp`` in ``Mesh.alone_axes``, so step 6 reduces over cp x ep only),
   and the **step runner** (the pipeline's schedule, or gradient
   accumulation).

Each axis of size > 1 is implemented by the plugin ``hpctrain.plugins.
axis_plugin`` chooses from the config (``parallel.impl.<axis>``, a claim,
or the one that serves it), and only that plugin is asked; its
``hpctrain_parallelize`` returns a handle (``hpctrain.parallel.handles``).
The expert axis's plugin is asked at size 1 too when it claims the axis
(a model with experts: its handle owns the routers' per-run state). Where
the first weights come from (``checkpoint.init_from``) is
``hpctrain.weights``'s. The result, ``Parallelized``, is what the trainer
holds; ``finalize.finalize_grads`` finishes each step's gradients with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Optional, cast

import torch
from torch import nn

from hpctrain.errors import PluginError
from hpctrain.grad_sync.presummed import scale_presummed
from hpctrain.mesh import Mesh
from hpctrain.model.build import build_model, logical_param_count, materialize
from hpctrain.model.compile import CompiledRegions, compile_regions
from hpctrain.model.recompute import set_recompute
from hpctrain.optimizers.build import build_optimizer
from hpctrain.parallel.handles import AxisHandle, DataHandle, LocalData, PipelineHandle
from hpctrain.plugins import axis_claims, axis_plugin, parallelize_caller
from hpctrain.train.outer import DiLoCo
from hpctrain.train.step_runner import GradAccumulation, StepRunner
from hpctrain.weights import given_weights


@dataclass
class Parallelized:
    """A layout, built: what the trainer holds."""

    model: nn.Module
    """What this rank runs: the whole model, one pipeline stage, or an interleaved rank's chunks."""
    params: List[nn.Parameter]
    """Its trainable parameters."""
    data_handle: DataHandle
    """How the data axes reduce gradients (``LocalData`` with one data rank)."""
    optimizer: torch.optim.Optimizer
    step_runner: StepRunner
    """Runs a step's micro-batches: the pipeline's schedule, or gradient accumulation."""
    logical_params: int
    """Parameters of the whole logical model (before a pipeline keeps a stage)."""
    handles: Dict[str, AxisHandle] = field(default_factory=dict)
    """Every axis implementation of this layout, by axis."""
    compiled: Optional[CompiledRegions] = None
    """The compiled regions (``trainer.compile``), None when eager."""


ASKED_AT_SIZE_ONE = ("ep",)
"""Axes whose plugin is asked even at size 1 when it claims the axis for the config (``hpctrain_claim_axis``):
the expert plugin owns the routers' per-run state (balance biases, loads) in its handle, whatever ``ep`` is."""


def _apply(axis: str, size: int, model: nn.Module, *, cfg: Any, mesh: Mesh, pm: Any, run_dir: Optional[str],
           handles: Dict[str, AxisHandle]) -> nn.Module:
    """Axis ``axis``'s transform by the plugin chosen for it (nothing at ``size`` 1, unless claimed there)."""
    if size == 1 and axis not in ASKED_AT_SIZE_ONE:
        return model
    name = axis_plugin(pm, cfg, axis)
    if size == 1 and not (name is not None and axis_claims(pm, cfg, axis).get(name)):
        return model
    if name is None:
        if axis == "ep":  # a model without experts: ep is only a data axis
            return model
        raise PluginError(f"no installed plugin implements axis {axis!r} (size {size})")
    handle = parallelize_caller(pm, name)(model=model, axis=axis, mesh=mesh, cfg=cfg, run_dir=run_dir)
    if handle is None:
        raise PluginError(f"plugin {name!r} was chosen for axis {axis!r} (size {size}) but declined it")
    if not isinstance(handle, AxisHandle):
        raise PluginError(f"plugin {name!r}'s hpctrain_parallelize for axis {axis!r} returned a "
                          f"{type(handle).__name__}; it must return an hpctrain.parallel.handles.AxisHandle")
    handles[axis] = handle
    return handle.model


def parallelize(cfg: Any, mesh: Mesh, pm: Any, device: torch.device, run_dir: Optional[str] = None) -> Parallelized:
    """Build this rank's part of the model for ``mesh`` (the module docstring, in order). ``mesh`` comes
    with its alone axes (``Mesh.alone_axes``: DiLoCo's replicas); ``run_dir`` is passed to each axis's
    plugin for the files it writes."""
    handles: Dict[str, AxisHandle] = {}
    model: nn.Module = build_model(cfg, pm, mesh)  # the one-process model, meta device
    logical = logical_param_count(model)

    apply = partial(_apply, cfg=cfg, mesh=mesh, pm=pm, run_dir=run_dir, handles=handles)
    model = apply("tp", mesh.size("tp"), model)           # 1. tensor
    model = apply("cp", mesh.size("cp"), model)           # 2. context
    model = apply("ep", mesh.size("ep"), model)           # 3. expert
    model = apply("pp", mesh.size("pp"), model)           # 4. pipeline split
    set_recompute(model, cfg.model.recompute)             # 5. recomputation
    compiled = (compile_regions(model, str(cfg.trainer.compile_backend), bool(cfg.trainer.deterministic),
                                mesh.world_rank == 0, bool(cfg.trainer.compile_fullgraph))
                if cfg.trainer.compile else None)  # and compilation
    model = apply("dp", mesh.averaged_data_size, model)   # 6. data axes (less DiLoCo's replicas)
    given = given_weights(cfg, pm)
    materialize(model, device, cfg.trainer.seed, cfg.model.init_std, cfg.model.n_layers,  # 7. weights
                mesh.coords, mesh.sizes, given)
    if given is not None:
        given.close()
    scale_presummed(model.parameters(), mesh)
    for handle in handles.values():
        handle.after_materialize()
    data_handle = handles.get("dp")
    if data_handle is None:
        data_handle = LocalData(model)
    elif not isinstance(data_handle, DataHandle):
        raise PluginError(f"the data axes' plugin returned a {type(data_handle).__name__}, not a DataHandle")
    else:
        model = data_handle.model  # a data handle may wrap the real model (torch's DistributedDataParallel)
    params = [p for p in model.parameters() if p.requires_grad]
    diloco = cfg.optim.outer.name == "diloco"
    sharded = data_handle.make_optimizer(params, cfg)                                     # 8. optimizer
    if sharded is not None and diloco:
        raise PluginError("optim.outer=diloco: the data axes' plugin made a sharded optimizer; DiLoCo's replicas "
                          "train alone and need their whole optimizer state (use parallel.zero.stage=0)")
    optimizer = (sharded
                 or pm.hook.hpctrain_make_optimizer(params=params, model=model, mesh=mesh, cfg=cfg)
                 or build_optimizer(params, cfg.optim, mesh))
    if diloco:
        # (cast: DiLoCo has what the core calls of a torch optimizer, like ZeRO's)
        optimizer = cast(torch.optim.Optimizer, DiLoCo(optimizer, params, mesh, cfg.optim.outer))
    pipeline: Optional[AxisHandle] = handles.get("pp")
    if pipeline is not None and not isinstance(pipeline, PipelineHandle):
        raise PluginError(f"the pipeline plugin returned a {type(pipeline).__name__}, not a PipelineHandle")
    runner = pipeline.step_runner() if pipeline is not None else GradAccumulation()  # and the step runner
    return Parallelized(model, params, data_handle, optimizer, runner, logical, handles, compiled)
