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
   ``hpctrain.train.outer``; its dp replicas train alone, so ``dp`` is put
   in ``Mesh.alone_axes`` before step 1 and step 6 reduces over cp x ep
   only), and **schedule** (the pipeline's, or gradient accumulation).

Each axis of size > 1 is implemented by the plugin ``hpctrain.plugins.
axis_plugin`` chooses from the config (``parallel.impl.<axis>``, a claim,
or the one that serves it); its ``hpctrain_parallelize`` returns a handle
(``hpctrain.parallel.handles``). The result, ``Parallelized``, is what the
trainer holds; ``finalize.finalize_grads`` finishes each step's gradients
with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, cast

import torch
from torch import nn

from hpctrain.errors import PluginError
from hpctrain.grad_sync.presummed import scale_presummed
from hpctrain.mesh import Mesh
from hpctrain.model.build import build_model, logical_param_count, materialize
from hpctrain.model.compile import CompiledRegions as Regions
from hpctrain.model.compile import compile_regions
from hpctrain.model.recompute import set_recompute
from hpctrain.optimizers.build import build_optimizer
from hpctrain.parallel.handles import AxisHandle, DataHandle, LocalData, PipelineHandle, tied_parameters
from hpctrain.plugins import axis_plugin, parallelize_caller
from hpctrain.train.outer import OUTER_AXIS, DiLoCo
from hpctrain.train.step_runner import GradAccumulation
from hpctrain.train.step_runner import StepRunner as StepSchedule


@dataclass
class Parallelized:
    """A layout, built: what the trainer holds."""

    model: nn.Module
    """What this rank runs: the whole model, one pipeline stage, or an interleaved rank's chunks."""
    params: List[nn.Parameter]
    """Its trainable parameters."""
    data: DataHandle
    """How the data axes reduce gradients (``LocalData`` with one data rank)."""
    optimizer: torch.optim.Optimizer
    schedule: StepSchedule
    logical_params: int
    """Parameters of the whole logical model (before a pipeline keeps a stage)."""
    handles: Dict[str, AxisHandle] = field(default_factory=dict)
    """Every axis implementation of this layout, by axis."""
    compiled: Optional[Regions] = None
    """The compiled regions (``trainer.compile``), None when eager."""


def _apply(axis: str, model: nn.Module, cfg: Any, mesh: Mesh, pm: Any,
           handles: Dict[str, AxisHandle]) -> nn.Module:
    """Axis ``axis``'s transform by the plugin chosen for it (nothing at size 1)."""
    # the data axes a gradient is averaged over (DiLoCo's replicas train alone: not dp)
    size = math.prod(mesh.size(a) for a in mesh.reduction_axes(())) if axis == "dp" else mesh.size(axis)
    if size == 1:
        return model
    name = axis_plugin(pm, cfg, axis)
    if name is None:
        if axis == "ep":  # a model without experts: ep is only a data axis
            return model
        raise PluginError(f"no installed plugin implements axis {axis!r} (size {size})")
    handle = parallelize_caller(pm, name)(model=model, axis=axis, mesh=mesh, cfg=cfg)
    if handle is None:
        raise PluginError(f"plugin {name!r} was chosen for axis {axis!r} (size {size}) but declined it")
    if not isinstance(handle, AxisHandle):
        raise PluginError(f"plugin {name!r}'s hpctrain_parallelize for axis {axis!r} returned a "
                          f"{type(handle).__name__}; it must return an hpctrain.parallel.handles.AxisHandle")
    handles[axis] = handle
    return handle.model


def given_weights(cfg: Any, pm: Any) -> Optional["_GivenWeights"]:
    """Where ``checkpoint.init_from`` takes the weights from (each rank reads its pieces), or None:
    ``hf:DIR`` is read here (``hpctrain.hf.weights``), any other path by the checkpoint format's plugin
    (``hpctrain_weight_source``)."""
    src = cfg.checkpoint.get("init_from")
    if not src:
        return None
    from hpctrain.hf.weights import hf_weights_for
    from hpctrain.log import log_rank0

    reader: Any = hf_weights_for(cfg)
    if reader is None:
        reader = pm.hook.hpctrain_weight_source(path=str(src), cfg=cfg) if pm is not None else None
        if reader is None:
            raise PluginError(f"checkpoint.init_from={src}: no installed plugin reads it (checkpoint.format="
                              f"{cfg.checkpoint.format}); give hf:DIR or one of our checkpoints")
    log_rank0("weights from checkpoint.init_from=%s (fresh optimizer, step 0, data from its start)", src)
    return _GivenWeights(reader)


class _GivenWeights:
    """A weight reader as ``materialize``'s source; ``close`` lets go of its files."""

    def __init__(self, reader: Any):
        self.reader = reader

    def __call__(self, spec: Any, piece_box: Any) -> Optional[torch.Tensor]:
        reader = self.reader
        return reader.box(spec.logical_name, piece_box) if reader.where(spec.logical_name) is not None else None

    def close(self) -> None:
        getattr(self.reader, "close", lambda: None)()


def parallelize(cfg: Any, mesh: Mesh, pm: Any, device: torch.device) -> Parallelized:
    """Build this rank's part of the model for ``mesh`` (the module docstring, in order)."""
    handles: Dict[str, AxisHandle] = {}
    diloco = cfg.optim.outer.name == "diloco"
    mesh.alone_axes = (OUTER_AXIS,) if diloco else ()     # (step 8) replicas that train alone
    model: nn.Module = build_model(cfg, pm, mesh)         # the one-process model, meta device
    logical = logical_param_count(model)
    model = _apply("tp", model, cfg, mesh, pm, handles)   # 1. tensor
    model = _apply("cp", model, cfg, mesh, pm, handles)   # 2. context
    model = _apply("ep", model, cfg, mesh, pm, handles)   # 3. expert
    model = _apply("pp", model, cfg, mesh, pm, handles)   # 4. pipeline split
    set_recompute(model, cfg.model.recompute)             # 5. recomputation
    compiled = (compile_regions(model, str(cfg.trainer.compile_backend), bool(cfg.trainer.deterministic),
                                mesh.world_rank == 0) if cfg.trainer.compile else None)  # and compilation
    model = _apply("dp", model, cfg, mesh, pm, handles)   # 6. data axes
    if tied_parameters(model, mesh):
        mesh.pp_ends()  # made now: no group is created once the mesh is sealed
    given = given_weights(cfg, pm)
    materialize(model, device, cfg.trainer.seed, cfg.model.init_std, cfg.model.n_layers,  # 7. weights
                mesh.coords, mesh.sizes, given)
    if given is not None:
        given.close()
    scale_presummed(model.parameters(), mesh)
    for handle in handles.values():
        handle.after_materialize()
    data = handles.get("dp")
    if data is None:
        data = LocalData(model)
    elif not isinstance(data, DataHandle):
        raise PluginError(f"the data axes' plugin returned a {type(data).__name__}, not a DataHandle")
    else:
        model = data.model  # a data handle may wrap the real model (torch's DistributedDataParallel)
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = data.make_optimizer(params, cfg)                                            # 8. optimizer
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
    schedule = pipeline.step_schedule() if pipeline is not None else GradAccumulation()   # and schedule
    return Parallelized(model, params, data, optimizer, schedule, logical, handles, compiled)
