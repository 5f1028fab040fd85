"""The trainer: build the layout, then step.

Set-up: ``hpctrain.parallel.compose.parallelize`` builds this rank's part of
the model for the mesh (each axis by the plugin chosen for it, in one fixed
order), its optimizer and its step schedule; then come the data cursor
(samples over dp x ep, tokens over cp) and the checkpointer; the mesh is
then sealed (no group is created after set-up).

Per step: the data cursor hands this rank its micro-batches; the step
schedule runs forward/backward, telling the data axes' handle about each
backward, and returns its loss sum and token count;
``hpctrain.parallel.finalize.finalize_grads`` finishes the gradients (data
axes, tied embeddings; with ``trainer.precision=fp16`` the backward ran on
the loss times the loss scale, which comes off here,
``hpctrain.train.loss_scale``); one all-reduce over the world gives the
global gradient norm and mean loss (``grad_norm.reduce_totals``) and
whether any rank overflowed (fp16: the step is then skipped on every rank
and the scale lowered); gradients are clipped (DiLoCo's replicas each by
their own norm, ``hpctrain.train.outer``); the checkpointer's ``before_update`` waits for an async save still
copying state to host memory; the optimizer steps;
``hpctrain_after_optimizer_step`` lets plugins update what is not a
gradient (MoE's router biases); plugins add metrics
(``hpctrain_step_metrics``), and the bytes each group's communicator moved
in the step are logged as ``comm_bytes.<group>`` (from the first step a
group moves anything).

Checkpoints: the persistent one (``checkpoint.every``, a format plugin) and
the node-local tier (``checkpoint.local.every``, ``hpctrain.localckpt``),
saved at the step boundary. On ``checkpoint.resume=auto`` the persistent
checkpoint is loaded first, then the local tier's newest complete step
replaces it when newer; the first step after a recorded failure reports its
cost (``hpctrain.train.recovery``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Dict, List, Optional

import torch

from hpctrain.data import DataCursor, SampleOrder
from hpctrain.data.orders import Orders, sample_orders
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.sequence import cp_positions
from hpctrain.errors import ConfigError, PluginError
from hpctrain.log import get_logger, log_rank0
from hpctrain.mesh import Mesh
from hpctrain.model.aux import objective_scale
from hpctrain.model.compile import report_once
from hpctrain.model.transformer import Transformer
from hpctrain.parallel.compose import parallelize
from hpctrain.parallel.finalize import finalize_grads
from hpctrain.plugins import call_each
from hpctrain.train.faults import FaultInjector
from hpctrain.train.grad_norm import clip_, gradient_pairs, reduce_totals
from hpctrain.train.guard import LossSpikes, NonFiniteGuard
from hpctrain.train.health import ForwardClock, Stragglers, check_replicas
from hpctrain.train.loggers import Loggers, open_loggers
from hpctrain.train.loss_scale import DynamicLossScale
from hpctrain.train.lr_schedule import lr_at, set_lr
from hpctrain.train.memory import gather_peaks, peak_rss_bytes, summarise
from hpctrain.train.metrics import Progress, log_step
from hpctrain.train.profile import StepProfiler
from hpctrain.train.recovery import Recovery, write_failure
from hpctrain.train.step_runner import as_step_result
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

log = get_logger(__name__)

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``trainer.precision`` -> the autocast dtype (fp32: none)."""


__all__ = ["Trainer", "peak_rss_bytes"]


class Trainer:
    def __init__(self, cfg: Any, mesh: Mesh, pm, device: torch.device, run_dir: Optional[str] = None,
                 loggers: Optional[Loggers] = None):
        self.cfg, self.mesh, self.pm, self.device, self.run_dir = cfg, mesh, pm, device, run_dir
        self.loggers = loggers
        """Rank 0's logger backends (``hpctrain.train.loggers``); None: opened by ``fit``."""
        self.flops_per_token = flops_per_token(cfg)
        """Model FLOPs per trained token, the planner's formula (``hpctrain.train.throughput``)."""
        self.peaks_per_rank: Dict[str, List[float]] = {}
        """Every rank's peak memory, by metric, as last gathered (``hpctrain.train.memory``)."""
        self.profiler = StepProfiler(cfg.trainer.profile, mesh.world_rank, device, run_dir)
        self.logging_s = 0.0
        """Seconds this rank spent in the loggers and the log line (``hpctrain-bench loggers``)."""
        self.step = 0
        self.parallel = parallelize(cfg, mesh, pm, device)
        """The layout, built: model, handles, optimizer and schedule (``hpctrain.parallel.compose``)."""
        self.model = self.parallel.model
        self.params: List[torch.nn.Parameter] = self.parallel.params
        self.optimizer = self.parallel.optimizer
        self.schedule = self.parallel.schedule
        self.data = self.parallel.data
        """The data axes' handle (``hpctrain.parallel.handles.DataHandle``)."""
        self.logical_params = self.parallel.logical_params
        alone = mesh.alone_axes  # DiLoCo's replicas: each clips with its own gradient norm
        self.replicas = (mesh.index_on(alone), math.prod(mesh.size(a) for a in alone)) if alone else (0, 1)
        """(this rank's replica, replicas training alone) for the gradient norm (``hpctrain.train.outer``)."""
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
        self.checkpointer = self._make_checkpointer()
        self.local_tier = self._make_local_tier()
        """The node-local tier with partner copies (``hpctrain.localckpt``), or None."""
        mesh.seal()
        self._comm_seen = self._comm_totals()
        self._comm_logged: set = set()
        self.resumed_from = "none"
        """The tier this run resumed from: local, persistent or none (``hpctrain.train.recovery``)."""
        self.resumed_checkpoint: Optional[str] = None
        """The persistent checkpoint this run resumed from."""
        self.resumed_optimizer: Optional[str] = None
        """The ``optim.name`` that saved it, where its checkpointer records one (``refuse_another_optimizer``)."""
        if self.checkpointer is not None and cfg.checkpoint.resume:
            path = self.checkpointer.resolve(str(cfg.checkpoint.resume))
            if path is not None:
                # load may fall back to an older checkpoint (resume=auto) and returns what it loaded
                path = self.checkpointer.load(self, path) or path
                self.resumed_from, self.resumed_checkpoint = "persistent", path
                log_rank0("resumed from %s at step %d (%d samples consumed)", path, self.step,
                          self.cursor.consumed_samples)
        if self.local_tier is not None:
            self._resume_local()

    def refuse_another_optimizer(self) -> None:
        """A ConfigError, on every rank alike, when the checkpoint resumed was saved by
        another optimizer: its state is not this one's (AdamW fails at its first step
        without its moments; LARS would carry AdamW's along into every later save).
        Asked before training, not by ``hpctrain-eval``, which takes no step."""
        saved, now = self.resumed_optimizer, str(self.cfg.optim.name)
        if saved is None or saved == now:
            return
        path = self.resumed_checkpoint
        raise ConfigError(f"checkpoint {path} holds the optimizer state of optim.name={saved!r}, and this run uses "
                          f"{now!r}; resume with optim={saved}, or start {now} from its weights alone in another "
                          f"checkpoint.dir with checkpoint.init_from={path} (step 0, a fresh optimizer state)")

    def extra_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the loop besides tensors, step and cursor (the same on every rank)."""
        return {"loss_scale": self.loss_scale.state_dict()} if self.loss_scale is not None else {}

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        """Restore ``extra_state`` (a checkpoint without it, or an fp32 one: the scale starts fresh)."""
        if self.loss_scale is not None and "loss_scale" in state:
            self.loss_scale.load_state_dict(state["loss_scale"])

    def validate(self) -> Dict[str, float]:
        """The validation losses now (``hpctrain.train.evaluate``; collective), logged by rank 0."""
        from hpctrain.train.evaluate import validate

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
        from hpctrain.bootstrap import get_runtime

        cfg, mesh = self.cfg, self.mesh
        alone = mesh.world_size == 1
        comm = None if alone else get_runtime().mpi_comm
        with mesh.board.collective("data index", "data", tuple(range(mesh.world_size))):
            return sample_orders(cfg.data, cfg.trainer.seq_len, int(cfg.model.vocab_size), comm,
                                 alone or mesh.world_rank == 0)

    def cursor_over(self, orders: List[SampleOrder], weights: Optional[List[float]] = None) -> DataCursor:
        """A cursor over ``orders`` at this rank's place (samples over dp x ep, tokens over cp)."""
        t, mesh = self.cfg.trainer, self.mesh
        return DataCursor(orders, t.global_batch_size, t.micro_batch_size, mesh.sample_rank, mesh.sample_size,
                          positions=cp_positions(mesh.rank("cp"), mesh.size("cp"), t.seq_len), weights=weights,
                          document_mask=bool(self.cfg.data.document_mask))

    def _make_checkpointer(self, for_stop: bool = False):
        """The checkpoint format plugin's checkpointer: at set-up when the run
        saves periodically or resumes; otherwise only when a stop is about to
        save (``for_stop``), on every rank at once (the ranks agreed to stop),
        so a run that is never stopped makes none (the plugin's is collective
        over the world, which a one-process reference inside an MPI job is not)."""
        ck = self.cfg.checkpoint
        if not (ck.every or ck.resume or for_stop):
            return None
        made = self.pm.hook.hpctrain_make_checkpointer(name=ck.format, mesh=self.mesh, cfg=self.cfg)
        if made is None:
            raise PluginError(f"checkpoint.format={ck.format!r}: no plugin made a checkpointer")
        return made

    def _make_local_tier(self):
        """The local tier when ``checkpoint.local.every`` is set and this trainer is the whole job (a
        one-process reference inside an MPI job keeps none)."""
        from hpctrain.bootstrap import get_runtime

        if not self.cfg.checkpoint.local.every:
            return None
        rt = get_runtime()
        if rt.world_size != self.mesh.world_size:
            return None
        from hpctrain.localckpt import LocalTier

        return LocalTier(self.cfg, self.mesh, rt)

    def _resume_local(self) -> None:
        """With ``checkpoint.resume=auto``: the local tier's newest complete step when it is newer than what the
        persistent checkpoint gave (collective). Steps after the one resumed from are forgotten (all of them on
        a fresh start), so a later failure never mixes two histories."""
        tier = self.local_tier
        assert tier is not None
        if str(self.cfg.checkpoint.resume) == "auto":
            elastic = bool(self.cfg.trainer.elastic)
            found = tier.agree(self, elastic)
            if found.refused is not None:
                log_rank0("local tier (%s): %s; trainer.elastic=true reshards the local tier over dp only, so "
                          "this step is not used", tier.base, found.refused)
            if found.other_layout is not None:
                log_rank0("local tier (%s): step %d was written by another layout or experiment; not used, "
                          "falling back to the persistent checkpoint", tier.base, found.other_layout)
            if found.step is None:
                log_rank0("local tier (%s): no step that every rank's state is held for", tier.base)
            elif found.step <= self.step:
                log_rank0("local tier (%s): its newest complete step %d is not newer than the persistent "
                          "checkpoint's step %d; using the persistent checkpoint", tier.base, found.step, self.step)
            else:
                tier.load(self, found)
                self.resumed_from = "local"
                log_rank0("resumed from the local tier (%s) at step %d (%d samples consumed); %d rank(s)' state "
                          "fetched from partner nodes", tier.base, self.step, self.cursor.consumed_samples, found.lost)
                if found.resharded_from is not None:
                    old = found.resharded_from
                    log_rank0("local tier: step %d was written at dp(%d) on %d ranks, resharded to dp(%d) on %d "
                              "(trainer.elastic=true: each rank loads a data-parallel replica's state)", self.step,
                              int(old["sizes"]["dp"]), int(old["world_size"]), self.mesh.size("dp"),
                              self.mesh.world_size)
        tier.forget_after(self.step)

    def save_checkpoint(self, path: Optional[str] = None) -> Optional[str]:
        """Save now (collective); used by ``checkpoint.every`` and on demand (preemption)."""
        if self.checkpointer is None:
            return None
        self.faults.before_checkpoint(self.step)
        board = self.mesh.board
        board.phase = "checkpoint save"
        # one numbered op over the world: a rank that never enters is named by the hang watchdog
        with board.collective("checkpoint save", "checkpoint", tuple(range(self.mesh.world_size))):
            saved = self.checkpointer.save(self, path)
        board.phase = "training"
        self.pm.hook.hpctrain_on_checkpoint(trainer=self, path=saved)
        return saved

    def _comm_totals(self) -> Dict[str, float]:
        return {g.name: float(getattr(getattr(g.comm, "counter", None), "bytes", 0.0))
                for g in self.mesh.distinct_groups if g.size > 1}

    def autocast(self):
        dtype = AUTOCAST.get(self.cfg.trainer.precision)
        if dtype is not None:
            return torch.autocast(device_type=self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def train_step(self) -> Dict[str, float]:
        cfg, mesh = self.cfg, self.mesh
        t0 = time.perf_counter()
        board = self.mesh.board
        board.step, board.phase = self.step + 1, "training"
        self.faults.before_step(self.step + 1, [m for m in self.model.modules() if isinstance(m, Transformer)])
        self.profiler.before_step(self.step + 1)
        t_data = time.perf_counter()
        step_data = self.prefetch.next_step() if self.prefetch is not None else self.cursor.next_step()
        data_wait = time.perf_counter() - t_data  # with the prefetcher, what its read-ahead did not hide
        microbatches = [mb.to(self.device) for mb in step_data]
        lr = lr_at(self.step, cfg.optim, cfg.trainer.steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        scaler = self.loss_scale
        local_wait = 0.0
        scale = scaler.scale if scaler is not None else None
        with objective_scale(scale):
            result = as_step_result(self.schedule.run(self.model, microbatches, self.data, self.autocast),
                                    microbatches)
        self.forward_clock.take()  # this step's forwards join the straggler check's window
        report_once(self.parallel.compiled)  # the first step compiled the regions (trainer.compile)
        finalize_grads(self.model, self.data, mesh)
        pairs = gradient_pairs(self.params, self.optimizer)
        if scale is not None and pairs:
            torch._foreach_mul_([g for g, _ in pairs], 1.0 / scale)  # the true gradients (inf stays inf)
        self.faults.after_finalize(self.step + 1, [g for g, _ in pairs])
        self.pm.hook.hpctrain_after_finalize_grads(trainer=self)
        loss_sum = result.loss_sum * self.faults.loss_scale(self.step + 1)
        totals = reduce_totals(pairs, loss_sum, result.tokens, mesh, self.device, self.cursor.short_reads,
                               self.replicas)
        self.cursor.raise_if_short(totals.short_reads, self.step + 1)  # every rank alike, before the update
        loss_value, norm_value = float(totals.loss), float(totals.grad_norm)
        # global values: every rank decides the same (raises to stop the run)
        if scaler is not None and scale is not None and totals.overflow and scaler.handles_overflow():
            update = False  # the scale's doing, not a divergence (hpctrain.train.loss_scale)
            log_rank0("step %d: fp16 gradient overflow on %d rank(s) at loss scale %g: update skipped, scale %g",
                      self.step + 1, totals.overflow, scale, scale * scaler.backoff)
            scaler.update(True)
        else:
            update = self.guard.update_allowed(self.step + 1, loss_value, norm_value)
            if scaler is not None and update:
                scaler.update(False)
        if update:
            own = totals.replica_norm if totals.replica_norm is not None else totals.grad_norm
            clip_(pairs, own, cfg.optim.grad_clip)
            # an async save may still be copying parameters and optimizer state to host
            before_update = getattr(self.checkpointer, "before_update", None)
            if before_update is not None:
                before_update()
            if self.local_tier is not None:  # and the local tier's copy of the last save
                local_wait = self.local_tier.before_update()
            self.optimizer.step()
            self.faults.after_update(self.step + 1, self.params)
            self.pm.hook.hpctrain_after_optimizer_step(trainer=self, step=self.step + 1)
        else:
            log_rank0("step %d: loss %s, gradient norm %s: update skipped (%d in a row, %d in all; "
                      "reliability.nonfinite=skip)", self.step + 1, loss_value, norm_value, self.guard.in_a_row,
                      self.guard.skipped)
        self.step += 1
        rel = cfg.reliability
        if rel.weight_check_every and self.step % rel.weight_check_every == 0:
            check_replicas(self.params, mesh, self.device, self.step)  # collective; raises on every rank
        dt = time.perf_counter() - t0
        self.profiler.after_step(self.step)
        tokens = cfg.trainer.global_batch_size * cfg.trainer.seq_len
        self.metrics = {
            "step": self.step,
            "loss": loss_value,
            "grad_norm": norm_value,
            "lr": lr,
            **throughput(tokens, dt, mesh.world_size, self.flops_per_token, float(cfg.cluster.peak_tflops)),
            "step_time_s": dt,
            "consumed_samples": self.cursor.consumed_samples,
            "data_wait_s": data_wait,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        if self.guard.skipped:
            self.metrics["skipped_steps"] = self.guard.skipped
        if local_wait:
            self.metrics["local_ckpt_wait_s"] = local_wait
        outer_steps = getattr(self.optimizer, "outer_steps", None)
        if outer_steps is not None:
            self.metrics["outer_steps"] = outer_steps
        if scaler is not None and scale is not None:
            self.metrics["loss_scale"] = scale
            self.metrics["loss_scale_skips"] = scaler.skipped
        if rel.straggler_every and self.step % rel.straggler_every == 0:
            self.metrics.update(self.stragglers.check(mesh, self.device, self.step, dt,
                                                      self.forward_clock.take_window()))  # median since the last check
        z = self.spikes.check(loss_value)
        if z is not None:
            self.metrics["loss_spike"] = 1
            log_rank0("step %d: loss spike: %.4f is %.1f standard deviations above the last %d steps' mean",
                      self.step, loss_value, z, len(self.spikes.recent))
        # bytes per group in this step; a group appears from the first step it moves anything
        now = self._comm_totals()
        for name, total in now.items():
            moved = total - self._comm_seen.get(name, 0.0)
            if moved or name in self._comm_logged:
                self._comm_logged.add(name)
                self.metrics[f"comm_bytes.{name}"] = moved
        self._comm_seen = now
        if self.step % cfg.trainer.log_every == 0 or self.step == cfg.trainer.steps:
            # every rank's peaks for the log line (collective, the same steps on every rank); its bytes
            # are logging's, not training's, so they stay out of comm_bytes
            self.peaks_per_rank = gather_peaks(mesh, self.device)
            self.metrics.update(summarise(self.peaks_per_rank))
            self._comm_seen = self._comm_totals()
        for plugin, extra in call_each(self.pm, "hpctrain_step_metrics", name_errors=False, trainer=self,
                                       step=self.step, metrics=dict(self.metrics)):
            for key, value in (extra or {}).items():
                if key in self.metrics:
                    raise PluginError(f"plugin {plugin!r}: its hpctrain_step_metrics returned {key!r}, which is "
                                      f"already a metric; prefix plugin metrics with the plugin's name")
                self.metrics[key] = value
        return self.metrics

    def fit(self) -> List[Dict[str, float]]:
        cfg, hook = self.cfg, self.pm.hook
        total = cfg.trainer.steps
        is_main = self.mesh.world_rank == 0
        if self.loggers is None:
            self.loggers = open_loggers(cfg, self.pm, self.run_dir) if is_main and self.run_dir else Loggers()
        loggers = self.loggers
        backends = [n for n in cfg.logging.backends if n != "jsonl"]
        where = ", ".join(([loggers.jsonl_path] if loggers.jsonl_path else []) + backends) if loggers.loggers else ""
        log_rank0("model %s: %s parameters | layout %s | %d micro-batches of %d per step | %s",
                  cfg.model.name, f"{self.logical_params:,}", self.mesh.describe(),
                  self.cursor.num_microbatches, cfg.trainer.micro_batch_size, self.device)
        if is_main and self.run_dir:
            write_layout(self.run_dir, self.mesh, self.logical_params, str(self.device))
        if self.step == 0 and cfg.checkpoint.resume:  # said here, not by hpctrain-eval, which trains nothing
            log_rank0("checkpoint.resume=%s: nothing to resume from; starting from step 0", cfg.checkpoint.resume)
        hook.hpctrain_on_train_start(trainer=self)
        progress = Progress(is_main, total, cfg.trainer.progress)
        unsaved = why_no_stop_save(cfg, self.pm, self.checkpointer is not None)  # None: a stop saves
        stops = StopRequests(cfg, is_main, catch_sigint=unsaved is None)
        stops.install()
        stopped = None  # (reason, checkpoint) when a signal or the clock ends the run early
        recovery = Recovery(self.run_dir, is_main)
        first, resumed_at = True, self.step
        try:
            while self.step < total:
                try:
                    m = self.train_step()
                except torch.cuda.OutOfMemoryError as e:
                    raise self.profiler.out_of_memory(e, self.step + 1) from e
                every = cfg.trainer.eval_every
                if self.orders.valid and (self.step == total or (every and self.step % every == 0)):
                    m.update(self.validate())  # collective: the same steps on every rank
                if self.local_tier is not None and self.local_tier.due(self.step):
                    m["local_ckpt_blocking_s"] = self.local_tier.save(self)
                if first:
                    first = False
                    recovery.after_first_step(m, resumed_at, self.resumed_from)
                self.history.append(m)
                t_log = time.perf_counter()
                loggers.log(m)
                progress.update(self.step, m)
                if self.step % cfg.trainer.log_every == 0 or self.step == total:
                    log_step(self.step, total, m)
                    loggers.flush()
                self.logging_s += time.perf_counter() - t_log
                hook.hpctrain_on_step_end(trainer=self, step=self.step, metrics=m)
                saved = None
                if self.checkpointer is not None and cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    saved = self.save_checkpoint()
                reason = stops.agree(self.mesh, self.device, m["step_time_s"])  # collective: the same on every rank
                leave = self._stragglers_to_leave()  # decided from gathered times: the same on every rank
                if (reason or leave) and self.step < total:
                    why = stops.describe(reason) if reason else straggler_stop_reason(
                        leave, cfg.reliability.straggler_stop_after)
                    log_rank0("step %d: %s: %s", self.step, why,
                              "saving and stopping" if unsaved is None else "stopping")
                    if unsaved is None and saved is None:
                        if self.checkpointer is None:
                            self.checkpointer = self._make_checkpointer(for_stop=True)
                        saved = self.save_checkpoint()
                    stopped = (reason, saved, leave)
                    break
            if self.local_tier is not None:
                self.local_tier.close()  # the last local save is complete before the run ends
        finally:
            stops.uninstall()
            progress.close()
            loggers.close()
            self.profiler.close()
            if is_main and self.run_dir and self.peaks_per_rank:
                write_peaks(self.run_dir, self.peaks_per_rank)
            if self.checkpointer is not None:
                self.mesh.board.phase = "checkpoint finish"
                # wait for a background save; a checkpointer with close() also lets go of its directory
                finish = getattr(self.checkpointer, "close", self.checkpointer.wait)
                with self.mesh.board.collective("checkpoint finish", "checkpoint", tuple(range(self.mesh.world_size))):
                    finish()
        if stopped is not None:
            reason, saved, leave = stopped
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
        hook.hpctrain_on_train_end(trainer=self, metrics=self.metrics)
        if self.history and where:
            log_rank0("done: %d steps, loss %.4f -> %.4f; metrics in %s", len(self.history),
                      self.history[0]["loss"], self.history[-1]["loss"], where)
        return self.history


    def _stragglers_to_leave(self) -> List[int]:
        """The ranks ``reliability.straggler_stop_after`` reports in a row have named (empty: go on)."""
        after = self.cfg.reliability.straggler_stop_after
        return self.stragglers.named_at_least(after) if after else []

    def _hosts(self) -> List[str]:
        """Every rank's node as Slurm names it (``SLURMD_NODENAME``, else the host name). Collective."""
        import socket

        from hpctrain.bootstrap import get_runtime

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
    from hpctrain.mesh import AXES

    groups = {a: [list(g) for g in mesh.partition(a)] for a in AXES if mesh.size(a) > 1}
    with open(os.path.join(run_dir, LAYOUT_FILE), "w") as f:
        json.dump({"world_size": mesh.world_size, "sizes": dict(mesh.sizes), "order": "-".join(mesh.order),
                   "groups": groups, "parameters": params, "device": device}, f, indent=1)
