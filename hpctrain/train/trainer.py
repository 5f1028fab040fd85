"""The trainer: build the layout, then step.

Set-up: ``hpctrain.parallel.compose.parallelize`` builds this rank's part of
the model for the mesh (each axis by the plugin chosen for it, in one fixed
order), its optimizer and its step runner; then come the data cursor
(samples over dp x ep, tokens over cp), the run's ``TrainState``
(``hpctrain.train.state``: what checkpointers save and load and lifecycle
hooks read) and its checkpointing (``hpctrain.train.checkpointing``: the
persistent and node-local tiers, and the resume rule); the mesh is then
sealed (no group is created after set-up).

Per step (``train_step``): the data cursor hands this rank its
micro-batches; the step runner runs forward/backward, telling the data
axes' handle about each backward, and returns its loss sum and token count
(``_forward_backward``); ``hpctrain.parallel.finalize.finalize_grads``
finishes the gradients (data axes, tied embeddings; with
``trainer.precision=fp16`` the backward ran on the loss times the loss
scale, which comes off here, ``hpctrain.train.loss_scale``); one all-reduce
over the world gives the global gradient norm and mean loss
(``grad_norm.reduce_totals``) and whether any rank overflowed
(``_finish_gradients``); the update is skipped on every rank alike for an
fp16 overflow or a non-finite step (``_update_allowed``); gradients are
clipped (DiLoCo's replicas each by their own norm, ``hpctrain.train.outer``),
saves in flight finish copying what the update changes, the optimizer
steps, and each axis handle then updates what is not a gradient
(``AxisHandle.after_update``: MoE's router biases) (``_update``). The
step's metrics come last (``_metrics``): the core's, the axis handles' and
plugins' (``hpctrain_step_metrics``), and the bytes each group's
communicator moved (``comm_bytes.<group>``, from the first step a group
moves anything).

The loop (``fit``) adds validation, logging, checkpoints at the step
boundary (``Checkpointing.maybe_save_local`` before the step's line,
``maybe_save`` after it) and stops (signals, the clock,
stragglers), agreed over the ranks.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from hpctrain.bootstrap import get_runtime
from hpctrain.checkpoint import Checkpointer
from hpctrain.data import DataCursor, SampleOrder
from hpctrain.data.orders import Orders, sample_orders
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.sequence import cp_positions
from hpctrain.data.stage import StageReport, stage, stageable
from hpctrain.errors import PluginError
from hpctrain.log import get_logger, log_rank0
from hpctrain.mesh import AXES, Mesh
from hpctrain.model import amp
from hpctrain.model.aux import objective_scale
from hpctrain.model.compile import report_once
from hpctrain.model.transformer import Transformer
from hpctrain.parallel.compose import parallelize
from hpctrain.parallel.finalize import finalize_grads
from hpctrain.plugins import call_each
from hpctrain.train.checkpointing import Checkpointing
from hpctrain.train.evaluate import validate
from hpctrain.train.faults import FaultInjector
from hpctrain.train.grad_norm import StepTotals, clip_, gradient_pairs, reduce_totals
from hpctrain.train.guard import LossSpikes, NonFiniteGuard
from hpctrain.train.health import ForwardClock, Stragglers, check_replicas
from hpctrain.train.loggers import Loggers, open_loggers
from hpctrain.train.loss_scale import DynamicLossScale
from hpctrain.train.lr_schedule import lr_at, set_lr
from hpctrain.train.memory import gather_peaks, peak_rss_bytes, summarise
from hpctrain.train.metrics import Progress, log_step
from hpctrain.train.profile import StepProfiler
from hpctrain.train.recovery import Recovery, write_failure
from hpctrain.train.state import TrainState
from hpctrain.train.step_runner import StepResult, as_step_result, weigh_masked
from hpctrain.train.stopping import (
    StopRequested,
    StopRequests,
    StragglerStop,
    requeue_if_slurm,
    stop_message,
    straggler_stop_reason,
    why_no_stop_save,
)
from hpctrain.train.throughput import flops_per_token, throughput
from hpctrain.train.usage import Usage, usage_line

log = get_logger(__name__)

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``trainer.precision`` -> the autocast dtype (fp32: none)."""


__all__ = ["Trainer", "peak_rss_bytes"]


class Trainer:
    def __init__(self, cfg: Any, mesh: Mesh, pm, device: torch.device, run_dir: Optional[str] = None,
                 loggers: Optional[Loggers] = None):
        t0, cpu0 = time.perf_counter(), time.process_time()  # the set-up counts in the run's usage
        self.cfg, self.mesh, self.pm, self.device = cfg, mesh, pm, device
        self.loggers = loggers
        """Rank 0's logger backends (``hpctrain.train.loggers``); None: opened by ``fit``."""
        self.flops_per_token = flops_per_token(cfg)
        """Model FLOPs per trained token, the planner's formula (``hpctrain.train.throughput``)."""
        self.peaks_per_rank: Dict[str, List[float]] = {}
        """Every rank's peak memory, by metric, as last gathered (``hpctrain.train.memory``)."""
        self.profiler = StepProfiler(cfg.trainer.profile, mesh.world_rank, device, run_dir)
        self.logging_s = 0.0
        """Seconds this rank spent in the loggers and the log line (``hpctrain-bench loggers``)."""
        self.parallel = parallelize(cfg, mesh, pm, device, run_dir)
        """The layout, built: model, handles, optimizer and step runner (``hpctrain.parallel.compose``)."""
        self.model = self.parallel.model
        self.params: List[torch.nn.Parameter] = self.parallel.params
        self.optimizer = self.parallel.optimizer
        self.step_runner = self.parallel.step_runner
        """Runs a step's micro-batches (``hpctrain.train.step_runner``; a pipeline's schedule)."""
        self.data_handle = self.parallel.data_handle
        """The data axes' handle: gradient reduction (``hpctrain.parallel.handles.DataHandle``)."""
        self.logical_params = self.parallel.logical_params
        alone = mesh.alone_axes  # DiLoCo's replicas: each clips with its own gradient norm
        self.replicas = (mesh.index_on(alone), math.prod(mesh.size(a) for a in alone)) if alone else (0, 1)
        """(this rank's replica, replicas training alone) for the gradient norm (``hpctrain.train.outer``)."""
        self.stage_report: Optional[StageReport] = None
        """What data staging did (``data.stage.dir``), else None."""
        self.orders = self._sample_orders()
        """The training and validation sample orders (``hpctrain.data.orders``)."""
        self.cursor = self.cursor_over(self.orders.train, self.orders.weights)
        self.cursor.defer_short_reads = True  # agreed in reduce_totals (hpctrain.data.tokenfile)
        self.cursor.allow_batch_change = bool(cfg.checkpoint.allow_batch_change)  # the rule: DataCursor.load_state_dict
        self.prefetch = Prefetcher(self.cursor) if cfg.data.prefetch else None
        """Reads the next step's data while a step computes (``data.prefetch``)."""
        self.metrics: Dict[str, float] = {}
        rel = cfg.reliability
        self.guard = NonFiniteGuard(rel.nonfinite, rel.max_skips)
        self.spikes = LossSpikes(rel.spike_window, rel.spike_zscore)
        outer = cfg.optim.outer
        if outer.name == "diloco" and cfg.trainer.steps % outer.every:
            log_rank0("optim.outer.every=%d does not divide trainer.steps=%d: the run ends between outer steps, "
                      "with replicas that differ (a checkpoint keeps each replica's; its /model tensors are each "
                      "some replica's); make trainer.steps a multiple of it to end on the shared weights",
                      outer.every, cfg.trainer.steps)
        self.loss_scale = DynamicLossScale(cfg.trainer.loss_scale) if cfg.trainer.precision == "fp16" else None
        """fp16's dynamic loss scale (``hpctrain.train.loss_scale``), else None."""
        self.stragglers = Stragglers(rel.straggler_factor, rel.straggler_min_s)
        # every model (part) this rank runs: the whole model, or a pipeline's stages
        self.forward_clock = ForwardClock(m for m in self.model.modules() if isinstance(m, Transformer))
        self.faults = FaultInjector(cfg.debug, mesh.world_rank)
        self.history: List[Dict[str, float]] = []
        self.state = TrainState(cfg, mesh, device, self.model, self.optimizer, self.cursor, self.parallel.handles,
                                run_dir, extra={"loss_scale": self.loss_scale} if self.loss_scale is not None else {})
        """What checkpointers save and load, and lifecycle hooks and axis handles read."""
        self.checkpointing = Checkpointing(self.state, pm, self.faults)
        """The persistent and node-local checkpoint tiers and the resume rule."""
        mesh.seal()
        # a one-process trainer inside an MPI job (the parity tests' reference) gathers with no one
        self.usage = Usage(cfg, None if mesh.world_size == 1 else get_runtime().mpi_comm, mesh.world_size, device,
                           t0, cpu0)
        """Rank-hours, CPU-hours and energy (``hpctrain.train.usage``; usage.* metrics every log_every steps)."""
        self._comm_seen = self._comm_totals()
        self._comm_logged: set = set()
        self.checkpointing.resume()

    @property
    def step(self) -> int:
        """Optimizer steps taken (``TrainState.step``)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def run_dir(self) -> Optional[str]:
        """The run's directory (``TrainState.run_dir``): rank 0 writes metrics, the layout and the axis
        handles' files there; None for runs without one."""
        return self.state.run_dir

    @run_dir.setter
    def run_dir(self, value: Optional[str]) -> None:
        self.state.run_dir = value

    @property
    def checkpointer(self) -> Optional[Checkpointer]:
        """The persistent tier's checkpointer, None while the run has none."""
        return self.checkpointing.persistent

    def validate(self) -> Dict[str, float]:
        """The validation losses now (``hpctrain.train.evaluate``; collective), logged by rank 0."""
        self.mesh.board.phase = "validation"
        out = validate(self)
        self.mesh.board.phase = "training"
        if out:
            per_source = ", ".join(f"{k.split('.', 1)[1]} {v:.4f}" for k, v in out.items() if k.startswith("val_loss."))
            log_rank0("step %d: validation loss %.4f, perplexity %.2f%s", self.step, out["val_loss"], out["val_ppl"],
                      f" ({per_source})" if per_source else "")
        return out

    def _sample_orders(self) -> Orders:
        """The data's sample orders; an indexed source's tables come from rank 0
        (one broadcast over the world, a numbered op for the hang watchdog)."""
        cfg, mesh = self.cfg, self.mesh
        alone = mesh.world_size == 1
        comm = None if alone else get_runtime().mpi_comm
        with mesh.board.collective("data index", "data", tuple(range(mesh.world_size))):
            orders = sample_orders(cfg.data, cfg.trainer.seq_len, int(cfg.model.vocab_size), comm,
                                   alone or mesh.world_rank == 0)
        if stageable(cfg.data):  # node-local copies of the shards (hpctrain.data.stage; collective)
            with mesh.board.collective("data staging", "data", tuple(range(mesh.world_size))):
                self.stage_report = stage(orders, cfg.data, cfg.trainer.steps, cfg.trainer.global_batch_size,
                                          mesh.sample_size, mesh.sample_rank, get_runtime())
        return orders

    def cursor_over(self, orders: List[SampleOrder], weights: Optional[List[float]] = None) -> DataCursor:
        """A cursor over ``orders`` at this rank's place (samples over dp x ep, tokens over cp)."""
        t, mesh = self.cfg.trainer, self.mesh
        return DataCursor(orders, t.global_batch_size, t.micro_batch_size, mesh.sample_rank, mesh.sample_size,
                          positions=cp_positions(mesh.rank("cp"), mesh.size("cp"), t.seq_len), weights=weights,
                          document_mask=bool(self.cfg.data.document_mask))

    def save_checkpoint(self, path: Optional[str] = None) -> Optional[str]:
        """Save the persistent tier now (collective); None when the run has no checkpointer."""
        return self.checkpointing.save(path)

    def _comm_totals(self) -> Dict[str, float]:
        return {g.name: float(getattr(getattr(g.comm, "counter", None), "bytes", 0.0))
                for g in self.mesh.distinct_groups if g.size > 1}

    def autocast(self):
        dtype = AUTOCAST.get(self.cfg.trainer.precision)
        if dtype is not None:
            return amp.autocast(self.device.type, dtype)  # (torch's; the dry run's meta device: an emulation)
        return contextlib.nullcontext()

    # -- one step --------------------------------------------------------------------
    def train_step(self) -> Dict[str, float]:
        t0 = time.perf_counter()
        step = self.step + 1
        board = self.mesh.board
        board.step, board.phase = step, "training"
        self.faults.before_step(step, [m for m in self.model.modules() if isinstance(m, Transformer)])
        self.profiler.before_step(step)
        lr = lr_at(self.step, self.cfg.optim, self.cfg.trainer.steps)
        set_lr(self.optimizer, lr)
        scale = self.loss_scale.scale if self.loss_scale is not None else None
        result, data_wait = self._forward_backward(scale)
        pairs, totals = self._finish_gradients(step, result, scale)
        loss_value, norm_value = float(totals.loss), float(totals.grad_norm)
        local_wait = 0.0
        if self._update_allowed(step, loss_value, norm_value, totals.overflow, scale):
            local_wait = self._update(step, pairs, totals)
        self.step = step
        rel = self.cfg.reliability
        if rel.weight_check_every and step % rel.weight_check_every == 0:
            check_replicas(self.params, self.mesh, self.device, step)  # collective; raises on every rank
        dt = time.perf_counter() - t0
        self.profiler.after_step(step)
        self.metrics = self._metrics(step, loss_value, norm_value, lr, dt, data_wait, local_wait, scale)
        return self.metrics

    def _forward_backward(self, scale: Optional[float]) -> Tuple[StepResult, float]:
        """This step's micro-batches through forward and backward (the step runner); the result and the
        seconds spent waiting for data (with the prefetcher, what its read-ahead did not hide)."""
        t_data = time.perf_counter()
        step_data = self.prefetch.next_step() if self.prefetch is not None else self.cursor.next_step()
        data_wait = time.perf_counter() - t_data
        if self.cursor.loss_mask:  # the global batch's counted targets (one all-reduce; every rank alike)
            step_data = weigh_masked(step_data, self.mesh, self.device)
        microbatches = [mb.to(self.device) for mb in step_data]
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        with objective_scale(scale):
            result = as_step_result(self.step_runner.run(self.model, microbatches, self.data_handle, self.autocast),
                                    microbatches)
        self.forward_clock.take()  # this step's forwards join the straggler check's window
        report_once(self.parallel.compiled)  # the first step compiled the regions (trainer.compile)
        return result, data_wait

    def _finish_gradients(self, step: int, result: StepResult, scale: Optional[float]) -> Tuple[list, StepTotals]:
        """Reduced, true gradients and the global totals (loss, norm, overflow; one all-reduce)."""
        finalize_grads(self.model, self.data_handle, self.mesh)
        pairs = gradient_pairs(self.params, self.optimizer)
        if scale is not None and pairs:
            torch._foreach_mul_([g for g, _ in pairs], 1.0 / scale)  # the true gradients (inf stays inf)
        self.faults.after_finalize(step, [g for g, _ in pairs])
        self.pm.hook.hpctrain_after_finalize_grads(state=self.state, step=step)
        loss_sum = result.loss_sum * self.faults.loss_scale(step)
        totals = reduce_totals(pairs, loss_sum, result.tokens, self.mesh, self.device, self.cursor.short_reads,
                               self.replicas)
        self.cursor.raise_if_short(totals.short_reads, step)  # every rank alike, before the update
        return pairs, totals

    def _update_allowed(self, step: int, loss: float, norm: float, overflow: int, scale: Optional[float]) -> bool:
        """Whether this step updates the weights, from global values: every rank decides the same
        (the guard raises to stop the run)."""
        scaler = self.loss_scale
        if scaler is not None and scale is not None and overflow and scaler.handles_overflow():
            # the scale's doing, not a divergence (hpctrain.train.loss_scale)
            log_rank0("step %d: fp16 gradient overflow on %d rank(s) at loss scale %g: update skipped, scale %g",
                      step, overflow, scale, scale * scaler.backoff)
            scaler.update(True)
            return False
        allowed = self.guard.update_allowed(step, loss, norm)
        if not allowed:
            log_rank0("step %d: loss %s, gradient norm %s: update skipped (%d in a row, %d in all; "
                      "reliability.nonfinite=skip)", step, loss, norm, self.guard.in_a_row, self.guard.skipped)
        elif scaler is not None:
            scaler.update(False)
        return allowed

    def _update(self, step: int, pairs: list, totals: StepTotals) -> float:
        """Clip, wait for saves in flight, step the optimizer, let the axis handles and plugins update
        what is not a gradient. The seconds the local checkpoint tier's host copy held the step."""
        own = totals.replica_norm if totals.replica_norm is not None else totals.grad_norm
        clip_(pairs, own, self.cfg.optim.grad_clip)
        local_wait = self.checkpointing.before_update()  # a save may still be copying parameters to host
        self.optimizer.step()
        self.faults.after_update(step, self.params)
        for axis in AXES:  # every rank holds the same axes' handles: the same order everywhere
            handle = self.parallel.handles.get(axis)
            if handle is not None:
                handle.after_update(self.state, step)
        self.pm.hook.hpctrain_after_optimizer_step(state=self.state, step=step)
        return local_wait

    def _metrics(self, step: int, loss: float, norm: float, lr: float, dt: float, data_wait: float,
                 local_wait: float, scale: Optional[float]) -> Dict[str, float]:
        """The step's metrics: the core's, then the axis handles' and plugins' (collectives on every rank)."""
        cfg, mesh = self.cfg, self.mesh
        self.usage.tick()
        tokens = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        metrics: Dict[str, float] = {
            "step": step,
            "loss": loss,
            "grad_norm": norm,
            "lr": lr,
            **throughput(tokens, dt, mesh.world_size, self.flops_per_token, float(cfg.cluster.peak_tflops)),
            "step_time_s": dt,
            "consumed_samples": self.cursor.consumed_samples,
            "data_wait_s": data_wait,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        if self.guard.skipped:
            metrics["skipped_steps"] = self.guard.skipped
        if local_wait:
            metrics["local_ckpt_wait_s"] = local_wait
        outer_steps = getattr(self.optimizer, "outer_steps", None)
        if outer_steps is not None:
            metrics["outer_steps"] = outer_steps
        if self.loss_scale is not None and scale is not None:
            metrics["loss_scale"] = scale
            metrics["loss_scale_skips"] = self.loss_scale.skipped
        rel = cfg.reliability
        if rel.straggler_every and step % rel.straggler_every == 0:
            metrics.update(self.stragglers.check(mesh, self.device, step, dt,
                                                 self.forward_clock.take_window()))  # median since the last check
        z = self.spikes.check(loss)
        if z is not None:
            metrics["loss_spike"] = 1
            log_rank0("step %d: loss spike: %.4f is %.1f standard deviations above the last %d steps' mean",
                      step, loss, z, len(self.spikes.recent))
        # bytes per group in this step; a group appears from the first step it moves anything
        now = self._comm_totals()
        for name, total in now.items():
            moved = total - self._comm_seen.get(name, 0.0)
            if moved or name in self._comm_logged:
                self._comm_logged.add(name)
                metrics[f"comm_bytes.{name}"] = moved
        self._comm_seen = now
        if step % cfg.trainer.log_every == 0 or step == cfg.trainer.steps:
            # every rank's peaks for the log line (collective, the same steps on every rank); its bytes
            # are logging's, not training's, so they stay out of comm_bytes
            self.peaks_per_rank = gather_peaks(mesh, self.device)
            metrics.update(summarise(self.peaks_per_rank))
            metrics.update(self.usage.measure())  # one all-reduce, the same steps
            self._comm_seen = self._comm_totals()
        for axis in AXES:
            handle = self.parallel.handles.get(axis)
            if handle is not None:
                self._add_metrics(metrics, f"the {axis} axis's handle", handle.step_metrics(self.state, step))
        for plugin, extra in call_each(self.pm, "hpctrain_step_metrics", name_errors=False, state=self.state,
                                       step=step, metrics=dict(metrics)):
            self._add_metrics(metrics, f"plugin {plugin!r}: its hpctrain_step_metrics", extra)
        return metrics

    @staticmethod
    def _add_metrics(metrics: Dict[str, float], who: str, extra: Optional[Dict[str, float]]) -> None:
        for key, value in (extra or {}).items():
            if key in metrics:
                raise PluginError(f"{who} returned {key!r}, which is already a metric; prefix plugin metrics "
                                  f"with the plugin's name")
            metrics[key] = value

    # -- the loop --------------------------------------------------------------------
    def fit(self) -> List[Dict[str, float]]:
        cfg, hook = self.cfg, self.pm.hook
        total = cfg.trainer.steps
        is_main = self.mesh.world_rank == 0
        if self.loggers is None:
            self.loggers = open_loggers(cfg, self.pm, self.run_dir) if is_main and self.run_dir else Loggers()
        loggers = self.loggers
        backends = [n for n in cfg.logging.backends if n != "jsonl"]
        where = ", ".join(([loggers.jsonl_path] if loggers.jsonl_path else []) + backends) if loggers.loggers else ""
        staged = self.stage_report
        log_rank0("model %s: %s parameters | layout %s | %d micro-batches of %d per step | %s%s",
                  cfg.model.name, f"{self.logical_params:,}", self.mesh.describe(),
                  self.cursor.num_microbatches, cfg.trainer.micro_batch_size, self.device,
                  f" | data staged in {staged.seconds:.2f} s ({staged.copied_bytes / 2**20:.1f} MiB copied)"
                  if staged is not None else "")
        if is_main and self.run_dir:
            write_layout(self.run_dir, self.mesh, self.logical_params, str(self.device))
        if self.step == 0 and cfg.checkpoint.resume:  # said here, not by hpctrain-eval, which trains nothing
            log_rank0("checkpoint.resume=%s: nothing to resume from; starting from step 0", cfg.checkpoint.resume)
        hook.hpctrain_on_train_start(state=self.state)
        progress = Progress(is_main, total, cfg.trainer.progress)
        unsaved = why_no_stop_save(cfg, self.pm, self.checkpointer is not None)  # None: a stop saves
        stops = StopRequests(cfg, is_main, catch_sigint=unsaved is None)
        stops.install()
        stopped = None  # (reason, checkpoint, stragglers to leave) when a signal, the clock or stragglers end the run
        recovery = Recovery(self.run_dir, is_main)
        first, resumed_at = True, self.step
        self.usage.training_started()
        try:
            while self.step < total:
                try:
                    m = self.train_step()
                except torch.cuda.OutOfMemoryError as e:
                    raise self.profiler.out_of_memory(e, self.step + 1) from e
                every = cfg.trainer.eval_every
                if self.orders.valid and (self.step == total or (every and self.step % every == 0)):
                    m.update(self.validate())  # collective: the same steps on every rank
                m.update(self.checkpointing.maybe_save_local(self.step))  # collective: the same steps everywhere
                if first:
                    first = False
                    if self.stage_report is not None:
                        m.update(self.stage_report.metrics())
                    recovery.after_first_step(m, resumed_at, self.checkpointing.resumed.tier)
                self.history.append(m)
                t_log = time.perf_counter()
                loggers.log(m)
                progress.update(self.step, m)
                if self.step % cfg.trainer.log_every == 0 or self.step == total:
                    log_step(self.step, total, m)
                    loggers.flush()
                self.logging_s += time.perf_counter() - t_log
                hook.hpctrain_on_step_end(state=self.state, step=self.step, metrics=m)
                saved = self.checkpointing.maybe_save(self.step)  # collective: the same steps on every rank
                # collective: the same on every rank; rank 0 weighs the time left (hpctrain.train.deadline)
                reason = stops.agree(self.mesh, self.device, m["step_time_s"], self.checkpointing.save_seconds(),
                                     self.checkpointing.take_blocked(), self.checkpointing.failure_flags())
                self.checkpointing.after_failures(stops.flags)  # a failed background save: report, go on or stop
                leave = self._stragglers_to_leave()  # decided from gathered times: the same on every rank
                if (reason or leave) and self.step < total:
                    why = stops.describe(reason) if reason else straggler_stop_reason(
                        leave, cfg.reliability.straggler_stop_after)
                    log_rank0("step %d: %s: %s", self.step, why,
                              "saving and stopping" if unsaved is None else "stopping")
                    if unsaved is None and saved is None:
                        saved = self.checkpointing.save(for_stop=True)
                    stopped = (reason, saved, leave)
                    break
            self.checkpointing.finish_local()  # the last local save is complete before the run ends
        finally:
            stops.uninstall()
            progress.close()
            loggers.close()
            self.profiler.close()
            if is_main and self.run_dir and self.peaks_per_rank:
                write_peaks(self.run_dir, self.peaks_per_rank)
            self.checkpointing.close()
        if stopped is not None:
            self._raise_stop(*stopped, stops, unsaved)
        for axis in AXES:
            handle = self.parallel.handles.get(axis)
            if handle is not None:
                handle.after_training(self.state)
        hook.hpctrain_on_train_end(state=self.state, metrics=self.metrics)
        if self.history and where:
            log_rank0("done: %d steps, loss %.4f -> %.4f; metrics in %s", len(self.history),
                      self.history[0]["loss"], self.history[-1]["loss"], where)
        if "usage.rank_hours" in self.metrics:
            log_rank0("%s", usage_line(self.metrics, cfg))
        return self.history

    def _raise_stop(self, reason: int, saved: Optional[str], leave: List[int], stops: StopRequests,
                    unsaved: Optional[str]) -> None:
        """The run stopped early: a straggler stop (its nodes recorded) or a signal's or the clock's."""
        cfg, is_main = self.cfg, self.mesh.world_rank == 0
        if leave and not reason:
            why = straggler_stop_reason(leave, cfg.reliability.straggler_stop_after)
            hosts = self._hosts()
            if is_main:
                write_failure(self.run_dir, f"step {self.step}: {why}", leave, [hosts[r] for r in leave],
                              self.step)
            raise StragglerStop(stop_message(self.step, why, saved, None, unsaved) + f" (nodes: "
                                f"{', '.join(sorted({hosts[r] for r in leave}))})")
        requeued = requeue_if_slurm(reason) if is_main and saved else None
        raise StopRequested(stop_message(self.step, stops.describe(reason), saved, requeued, unsaved))

    def _stragglers_to_leave(self) -> List[int]:
        """The ranks ``reliability.straggler_stop_after`` reports in a row have named (empty: go on)."""
        after = self.cfg.reliability.straggler_stop_after
        return self.stragglers.named_at_least(after) if after else []

    def _hosts(self) -> List[str]:
        """Every rank's node as Slurm names it (``SLURMD_NODENAME``, else the host name). Collective."""
        mine = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        rt = get_runtime()
        return rt.mpi_comm.allgather(mine) if rt.world_size > 1 else [mine]


PEAKS_FILE = "memory_per_rank.json"
"""Every rank's peak memory at the end of the run (rank 0 writes it; ``hpctrain-report`` draws it)."""


def write_peaks(run_dir: str, peaks: Dict[str, List[float]]) -> None:
    with open(os.path.join(run_dir, PEAKS_FILE), "w") as f:
        json.dump(peaks, f, indent=1)


LAYOUT_FILE = "layout.json"
"""The run's mesh: world size, axis sizes and order, every axis's groups (rank 0 writes it; ``hpctrain-report``)."""


def write_layout(run_dir: str, mesh: Mesh, params: int, device: str) -> None:
    groups = {a: [list(g) for g in mesh.partition(a)] for a in AXES if mesh.size(a) > 1}
    with open(os.path.join(run_dir, LAYOUT_FILE), "w") as f:
        json.dump({"world_size": mesh.world_size, "sizes": dict(mesh.sizes), "order": "-".join(mesh.order),
                   "groups": groups, "parameters": params, "device": device}, f, indent=1)
