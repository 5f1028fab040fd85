"""Data-parallel plugin: replicated parameters, gradients averaged over the
data axes by the core's gradient-sync engine (``hpctrain.grad_sync``).

The core asks this plugin to parallelise axis ``dp`` whenever the data
axes (``cp x ep x dp``) hold more than one rank. ``hpctrain_parallelize``
leaves the model unchanged (no wrapper, so parameter names and checkpoints
are the same as in one process; the layout-independent init makes replicas
identical without a broadcast) and returns a ``DataParallel`` handle; once
the weights are real the handle attaches the engine: each parameter is
averaged over the data axes it is not split on, in buckets launched during
backward. The step schedule drives the engine per micro-batch through the
handle (``before_backward``, ``no_sync``, ``mark_ready``), and the core's
``finalize_grads`` finishes it (``reduce_gradients``).

Options: ``comm.bucket_mb`` (core) sets the bucket size;
``comm.dp.compress`` (none | bf16 | fp16) and ``comm.dp.overlap`` come from
this plugin's config section (``config.DataParallelConfig``).
"""
from __future__ import annotations

from typing import Any, ContextManager, Dict, List, Optional

from omegaconf import OmegaConf
from torch import nn

from hpctrain import grad_sync, hookimpl
from hpctrain.grad_sync.buckets import cap_bytes_from_mb
from hpctrain.mesh import Mesh
from hpctrain.parallel.handles import DataHandle

from hpctrain_dp.config import WIRE_DTYPES, DataParallelConfig, wire_dtype


class DataParallel(DataHandle):
    """Replicas averaging their gradients through the core's engine."""

    def __init__(self, model: nn.Module, mesh: Mesh, bucket_mb: float, compress: str = "none", overlap: bool = True):
        super().__init__(model)
        self.mesh = mesh
        self.config = grad_sync.SyncConfig(cap_bytes=cap_bytes_from_mb(bucket_mb), wire_dtype=wire_dtype(compress),
                                           overlap=overlap)
        self.engine: Optional[grad_sync.GradSync] = None
        """The gradient-sync engine (after ``after_materialize``)."""

    def after_materialize(self) -> None:
        self.engine = grad_sync.GradSync(grad_sync.reduction_comm(self.mesh), self.config)
        self.engine.attach([p for p in self.model.parameters() if p.requires_grad])

    def _engine(self) -> grad_sync.GradSync:
        assert self.engine is not None, "after_materialize attaches the engine"
        return self.engine

    def before_backward(self, microbatch: int, num_microbatches: int) -> None:
        self._engine().begin_microbatch(microbatch, num_microbatches)

    def no_sync(self) -> ContextManager[None]:
        return self._engine().no_sync()

    def mark_ready(self, param: nn.Parameter) -> None:
        self._engine().mark_ready(param)

    def reduce_gradients(self) -> None:
        self._engine().finish()


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
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any) -> Optional[DataParallel]:
    return DataParallel(model, mesh, float(cfg.comm.bucket_mb),
                        compress=OmegaConf.select(cfg, "comm.dp.compress", default="none"),
                        overlap=bool(OmegaConf.select(cfg, "comm.dp.overlap", default=True)))
