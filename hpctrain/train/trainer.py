"""The trainer: build, parallelise, materialise, then step.

Per step: the data cursor hands this rank its micro-batches; the step
schedule runs forward/backward (``hpctrain_before_backward`` fires before
each backward); ``hpctrain_after_backward`` lets plugins finish gradient
reductions; gradients are clipped by the global norm; the checkpointer's
``before_update`` waits for an async save still copying state to host
memory; the optimizer steps; the loss is averaged over data-parallel ranks
for the metrics.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Optional

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.data import DataCursor, SampleOrder, open_source
from hpctrain.errors import PluginError
from hpctrain.log import get_logger, log_rank0
from hpctrain.mesh import Mesh
from hpctrain.model.build import build_model, logical_param_count, materialize
from hpctrain.train.grad_norm import clip_grad_norm
from hpctrain.train.metrics import MetricsWriter, Progress, log_step, run_dir_file
from hpctrain.train.optim import build_adamw, lr_at, set_lr
from hpctrain.train.schedule import GradAccumulation

# Axis transforms apply inside-out: tensor splits first, then sequence and
# expert splits, then pipeline stages, then data parallelism over the result.
PARALLELIZE_ORDER = ("tp", "cp", "ep", "pp", "dp")

log = get_logger(__name__)


class Trainer:
    def __init__(self, cfg: Any, mesh: Mesh, pm, device: torch.device, run_dir: Optional[str] = None):
        self.cfg, self.mesh, self.pm, self.device, self.run_dir = cfg, mesh, pm, device, run_dir
        t = cfg.trainer
        self.step = 0
        self.model = self._build_model()
        self.params: List[torch.nn.Parameter] = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = pm.hook.hpctrain_make_optimizer(params=self.params, mesh=mesh, cfg=cfg) or build_adamw(self.params, cfg.optim)
        self.schedule = pm.hook.hpctrain_step_schedule(cfg=cfg, mesh=mesh) or GradAccumulation()
        order = SampleOrder(open_source(cfg.data), t.seq_len, cfg.data.seed)
        self.cursor = DataCursor(order, t.global_batch_size, t.micro_batch_size, mesh.rank("dp"), mesh.size("dp"))
        self.metrics: Dict[str, float] = {}
        self.history: List[Dict[str, float]] = []
        self.checkpointer = self._make_checkpointer()
        if self.checkpointer is not None and cfg.checkpoint.resume:
            path = self.checkpointer.resolve(str(cfg.checkpoint.resume))
            if path is not None:
                # load may fall back to an older checkpoint (resume=auto) and returns what it loaded
                path = self.checkpointer.load(self, path) or path
                log_rank0("resumed from %s at step %d (%d samples consumed)", path, self.step, self.cursor.consumed_samples)

    def _make_checkpointer(self):
        ck = self.cfg.checkpoint
        if not (ck.every or ck.resume):
            return None
        made = self.pm.hook.hpctrain_make_checkpointer(name=ck.format, mesh=self.mesh, cfg=self.cfg)
        if made is None:
            raise PluginError(f"checkpoint.format={ck.format!r}: no plugin made a checkpointer")
        return made

    def save_checkpoint(self, path: Optional[str] = None) -> Optional[str]:
        """Save now (collective); used by ``checkpoint.every`` and on demand (preemption)."""
        if self.checkpointer is None:
            return None
        saved = self.checkpointer.save(self, path)
        self.pm.hook.hpctrain_on_checkpoint(trainer=self, path=saved)
        return saved

    def _build_model(self) -> torch.nn.Module:
        cfg, mesh = self.cfg, self.mesh
        model = build_model(cfg, self.pm)
        for axis in PARALLELIZE_ORDER:
            if mesh.size(axis) == 1:
                continue
            out = self.pm.hook.hpctrain_parallelize(model=model, axis=axis, mesh=mesh, cfg=cfg)
            if out is None:
                raise PluginError(f"no plugin parallelised axis {axis!r} (size {mesh.size(axis)})")
            model = out
        materialize(model, self.device, cfg.trainer.seed, cfg.model.init_std, cfg.model.n_layers, mesh.coords, mesh.sizes)
        return model

    def autocast(self):
        if self.cfg.trainer.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> Dict[str, float]:
        cfg, mesh = self.cfg, self.mesh
        t0 = time.perf_counter()
        microbatches = [(x.to(self.device), y.to(self.device)) for x, y in self.cursor.next_step()]
        lr = lr_at(self.step, cfg.optim, cfg.trainer.steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        loss = self.schedule.run(self.model, microbatches, self.pm.hook, self.autocast)
        self.pm.hook.hpctrain_after_backward(model=self.model, mesh=mesh)
        grad_norm = clip_grad_norm(self.params, mesh, cfg.optim.grad_clip)
        # an async save may still be copying parameters and optimizer state to host
        before_update = getattr(self.checkpointer, "before_update", None)
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.step += 1
        loss = loss if loss is not None else torch.zeros((), device=self.device)
        if mesh.size("dp") > 1:
            mesh.group("dp").communicator().all_reduce(loss, ReduceOp.AVG)
        dt = time.perf_counter() - t0
        tokens = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        self.metrics = {
            "step": self.step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            "consumed_samples": self.cursor.consumed_samples,
        }
        return self.metrics

    def fit(self) -> List[Dict[str, float]]:
        cfg, hook = self.cfg, self.pm.hook
        total = cfg.trainer.steps
        is_main = self.mesh.world_rank == 0
        writer = MetricsWriter(run_dir_file(self.run_dir, "metrics.jsonl") if is_main else None)
        log_rank0("model %s: %s parameters | layout %s | %d micro-batches of %d per step | %s",
                  cfg.model.name, f"{logical_param_count(self.model):,}", self.mesh.describe(),
                  self.cursor.num_microbatches, cfg.trainer.micro_batch_size, self.device)
        hook.hpctrain_on_train_start(trainer=self)
        progress = Progress(is_main, total, cfg.trainer.progress)
        try:
            while self.step < total:
                m = self.train_step()
                self.history.append(m)
                writer.write(m)
                progress.update(self.step, m)
                if self.step % cfg.trainer.log_every == 0 or self.step == total:
                    log_step(self.step, total, m)
                    writer.flush()
                hook.hpctrain_on_step_end(trainer=self, step=self.step, metrics=m)
                if self.checkpointer is not None and cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save_checkpoint()
        finally:
            progress.close()
            writer.close()
            if self.checkpointer is not None:
                self.checkpointer.wait()
        hook.hpctrain_on_train_end(trainer=self, metrics=self.metrics)
        if self.history and writer.path:
            log_rank0("done: %d steps, loss %.4f -> %.4f; metrics in %s", len(self.history),
                      self.history[0]["loss"], self.history[-1]["loss"], writer.path)
        return self.history
