"""Data-parallel plugin: bucketed gradient averaging overlapped with backward.

Parameters stay replicated over ``dp`` (their ShardSpec says so already, and
the layout-independent init makes replicas identical without a broadcast).
``hpctrain_parallelize`` returns the model unchanged (no wrapper, so
parameter names and checkpoints are the same as in one process) and records
the dp group and options on it. The reducer (``reducer.GradReducer``) is
attached lazily, at the first ``hpctrain_before_backward``: parallelize runs
on the meta-device model and materialisation replaces every parameter
object, so hooks registered earlier would sit on dead meta tensors. It is
re-attached if the parameter set ever changes.

Options: ``comm.bucket_mb`` (core) sets the bucket size;
``comm.dp.compress`` (none | bf16 | fp16) and ``comm.dp.overlap`` come from
this plugin's config section (``config.DataParallelConfig``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from omegaconf import OmegaConf

from hpctrain import hookimpl
from hpctrain.mesh import Group

from hpctrain_dp.buckets import cap_bytes_from_mb
from hpctrain_dp.config import WIRE_DTYPES, DataParallelConfig, wire_dtype
from hpctrain_dp.reducer import GradReducer

STATE_ATTR = "_hpctrain_dp"


class DataParallel:
    """What ``hpctrain_parallelize`` leaves on the model: the group, the
    options, and (once the parameters exist) the reducer."""

    def __init__(self, group: Group, bucket_mb: float, compress: str = "none", overlap: bool = True):
        self.group = group
        self.cap_bytes = cap_bytes_from_mb(bucket_mb)
        self.wire_dtype = wire_dtype(compress)
        self.overlap = overlap
        self.reducer: Optional[GradReducer] = None

    def reducer_for(self, model: torch.nn.Module) -> GradReducer:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.reducer is None or not self.reducer.matches(params):
            if self.reducer is not None:
                self.reducer.detach()
            self.reducer = GradReducer(self.group.communicator(), self.cap_bytes, self.wire_dtype, self.overlap)
            self.reducer.attach(params)
        return self.reducer


def state_of(model: torch.nn.Module) -> Optional[DataParallel]:
    """The data-parallel state of a model this plugin parallelised (else None)."""
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
    if cfg.comm.bucket_mb < 0:
        problems.append(f"comm.bucket_mb={cfg.comm.bucket_mb} must be >= 0 (0: one bucket per parameter)")
    return problems or None


@hookimpl
def hpctrain_parallelize(model: torch.nn.Module, axis: str, mesh, cfg: Any) -> Optional[torch.nn.Module]:
    if axis != "dp":
        return None
    state = DataParallel(
        group=mesh.group("dp"),
        bucket_mb=float(cfg.comm.bucket_mb),
        compress=OmegaConf.select(cfg, "comm.dp.compress", default="none"),
        overlap=bool(OmegaConf.select(cfg, "comm.dp.overlap", default=True)),
    )
    setattr(model, STATE_ATTR, state)
    return model


@hookimpl
def hpctrain_before_backward(model: torch.nn.Module, microbatch: int, num_microbatches: int) -> None:
    state = state_of(model)
    if state is not None and state.group.size > 1:
        state.reducer_for(model).begin_microbatch(microbatch, num_microbatches)


@hookimpl
def hpctrain_after_backward(model: torch.nn.Module, mesh) -> None:
    state = state_of(model)
    if state is not None and state.group.size > 1:
        state.reducer_for(model).finish()
