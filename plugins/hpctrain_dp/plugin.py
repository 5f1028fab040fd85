"""Data-parallel plugin: replicated parameters, gradients averaged over the
data axes by the core's gradient-sync engine (``hpctrain.grad_sync``).

The core asks this plugin to parallelise axis ``dp`` whenever the data
axes (``cp x ep x dp``) hold more than one rank. ``hpctrain_parallelize``
leaves the model unchanged (no wrapper, so parameter names and checkpoints
are the same as in one process; the layout-independent init makes replicas
identical without a broadcast) and records the options on it;
``hpctrain_after_materialize`` attaches the engine to the real parameters:
each is averaged over the data axes it is not split on, in buckets
launched during backward. The engine is driven per micro-batch from
``hpctrain_before_backward`` and finished in ``hpctrain_after_backward``.

Options: ``comm.bucket_mb`` (core) sets the bucket size;
``comm.dp.compress`` (none | bf16 | fp16) and ``comm.dp.overlap`` come from
this plugin's config section (``config.DataParallelConfig``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from omegaconf import OmegaConf

from hpctrain import grad_sync, hookimpl

from hpctrain.grad_sync.buckets import cap_bytes_from_mb

from hpctrain_dp.config import WIRE_DTYPES, DataParallelConfig, wire_dtype

STATE_ATTR = "_hpctrain_dp"


@dataclass
class DataParallel:
    """What ``hpctrain_parallelize`` leaves on the model."""

    bucket_mb: float
    compress: str = "none"
    overlap: bool = True


def state_of(model: torch.nn.Module) -> Optional[DataParallel]:
    """The options of a model this plugin parallelised (else None)."""
    return getattr(model, STATE_ATTR, None)


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["dp"]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"comm.dp": DataParallelConfig}


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> Optional[List[str]]:
    problems = []
    compress = OmegaConf.select(cfg, "comm.dp.compress", default="none")
    if compress not in WIRE_DTYPES:
        problems.append(f"comm.dp.compress={compress!r} is not one of {', '.join(WIRE_DTYPES)}")
    return problems or None


@hookimpl
def hpctrain_parallelize(model: torch.nn.Module, axis: str, mesh, cfg: Any) -> Optional[torch.nn.Module]:
    if axis != "dp":
        return None
    setattr(model, STATE_ATTR, DataParallel(
        bucket_mb=float(cfg.comm.bucket_mb),
        compress=OmegaConf.select(cfg, "comm.dp.compress", default="none"),
        overlap=bool(OmegaConf.select(cfg, "comm.dp.overlap", default=True)),
    ))
    return model


@hookimpl
def hpctrain_after_materialize(model: torch.nn.Module, mesh, cfg: Any) -> None:
    state = state_of(model)
    if state is None:
        return
    engine = grad_sync.GradSync(grad_sync.reduction_comm(mesh), cap_bytes_from_mb(state.bucket_mb),
                                wire_dtype(state.compress), state.overlap)
    grad_sync.attach_to(model, engine.attach([p for p in model.parameters() if p.requires_grad]))


@hookimpl
def hpctrain_before_backward(model: torch.nn.Module, microbatch: int, num_microbatches: int) -> None:
    if state_of(model) is not None:
        engine = grad_sync.of(model)
        if engine is not None:
            engine.begin_microbatch(microbatch, num_microbatches)


@hookimpl
def hpctrain_after_backward(model: torch.nn.Module, mesh) -> None:
    if state_of(model) is not None:
        engine = grad_sync.of(model)
        if engine is not None:
            engine.finish()
