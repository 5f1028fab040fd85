"""One layout trained for a few steps in this job, through ``hpctrain.run.run`` (what
``hpctrain-train`` runs after composing): validation agreed over the ranks, the mesh and its
groups, the model, optimizer and data built for this layout, then freed.

Rank 0 composes the config and broadcasts it (as ``hpctrain-train`` does), so a composition error
is every rank's. A failure raised on every rank (a validation error, before any collective, or an
out-of-memory in the same step everywhere) is recorded with its reason after one allgather of
every rank's verdict, and the tuning goes on. A failure on some ranks only leaves the others
inside a collective: the failed ranks keep this layout's hang watchdog (``reliability.hang_timeout_s``)
running through that allgather, marked as having left with an error, so after the timeout rank 0
names them and the operation the others wait in and ends the job (exit status 5), as in training
(nothing hangs silently; with the watchdog off it hangs).

Measured: step time (median of the steps after the first, which warms up), peak memory (CUDA:
the allocator's maximum allocated bytes since this layout began; CPU: the process's peak resident
set, reset per layout through /proc/self/clear_refs where Linux allows it), both the maximum over
ranks, and bytes on the wire per group per step (the trainer's ``comm_bytes.<group>`` metrics,
median over the same steps).
"""
from __future__ import annotations

import gc
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from hpctrain.config import compose_agreed
from hpctrain.errors import HpctrainError
from hpctrain.run import run
from hpctrain.train.memory import peak_rss_bytes
from hpctrain.train.profile import OutOfMemoryWithSnapshot
from hpctrain.train.watchdog import JobStopped

TRIAL_OVERRIDES = ("trainer.progress=off", "checkpoint.every=0", "trainer.eval_every=0")
"""Tuning trains to measure: no progress bar, no checkpoints, no validation passes."""


@dataclass
class Trial:
    """What one layout did."""

    label: str
    overrides: List[str]
    ok: bool = False
    reason: str = ""
    step_times: List[float] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    median_step_s: Optional[float] = None
    peak_bytes: Optional[float] = None
    comm_bytes: Dict[str, float] = field(default_factory=dict)
    run_dir: Optional[str] = None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak resident set (VmHWM), Linux >= 4.0
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass

    return float(peak_rss_bytes())


def summarise(history: List[Dict[str, float]], trial: Trial) -> None:
    """Fill ``trial``'s measurements from the per-step metrics (the first step is warm-up when there are more)."""
    trial.losses = [float(m["loss"]) for m in history]
    trial.step_times = [float(m["step_time_s"]) for m in history]
    timed = history[1:] if len(history) > 1 else history
    trial.median_step_s = statistics.median(float(m["step_time_s"]) for m in timed)
    groups = sorted({k for m in timed for k in m if k.startswith("comm_bytes.")})
    trial.comm_bytes = {k.split(".", 1)[1]: statistics.median(float(m.get(k, 0.0)) for m in timed) for k in groups}


def run_trial(label: str, overrides: List[str], steps: int, run_dir: Optional[str], rt: Any, pm) -> Trial:
    """Train ``overrides`` for ``steps`` steps on the whole world. Collective."""
    trial = Trial(label, list(overrides), run_dir=run_dir)
    watchdog: List[Any] = []  # run() puts this layout's hang watchdog here; it watches the agreement below too
    try:
        reason, peak = _train(trial, _trial_overrides(overrides, steps), run_dir, rt, pm, watchdog)
        if watchdog and reason:
            watchdog[0].failed()  # ranks still inside this layout's collectives are named, not left waiting
        verdicts = rt.mpi_comm.allgather((reason, peak)) if rt.world_size > 1 else [(reason, peak)]
    finally:
        if watchdog:
            watchdog[0].stop("done" if trial.losses else "error")
    failed = {r: why for r, (why, _) in enumerate(verdicts) if why}
    if failed:
        reasons = sorted(set(failed.values()))
        trial.reason = reasons[0] if len(failed) == len(verdicts) and len(reasons) == 1 else \
            "; ".join(f"{why} (on ranks {[r for r, w in failed.items() if w == why]})" for why in reasons)
        trial.step_times, trial.losses, trial.median_step_s, trial.comm_bytes = [], [], None, {}
        return trial
    trial.ok = True
    trial.peak_bytes = max(p for _, p in verdicts)
    return trial


def _trial_overrides(overrides: List[str], steps: int) -> List[str]:
    """A trial's overrides: the layout's, its step count, and no progress bar, checkpoints or validation."""
    return list(overrides) + [f"trainer.steps={steps}", *TRIAL_OVERRIDES]


def _train(trial: Trial, overrides: List[str], run_dir: Optional[str], rt: Any, pm,
           watchdog: List[Any]) -> Tuple[str, float]:
    """Train on this rank; (why it failed here or "", peak memory). Everything it built is freed."""
    reason, peak = "", 0.0
    try:
        cfg = compose_agreed(overrides, pm, rt.mpi_comm)
        if run_dir and rt.is_main:  # what hpctrain-plan --compare reads, as in a hpctrain-train run directory
            os.makedirs(os.path.join(run_dir, ".hydra"), exist_ok=True)
            with open(os.path.join(run_dir, ".hydra", "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(cfg, resolve=True))
            with open(os.path.join(run_dir, ".hydra", "overrides.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(OmegaConf.create(list(trial.overrides))))
        _reset_peak(rt.device)
        history = run(cfg, run_dir, pm, watchdog_holder=watchdog)
        peak = _peak(rt.device)
        summarise(history, trial)
    except JobStopped:
        raise  # the watchdog is ending the job: a rank died or hangs
    except HpctrainError as e:
        reason = str(e).replace("\n", "; ")
    except OutOfMemoryWithSnapshot as e:  # in a step (the rank's line and snapshot are in its log)
        reason = f"out of memory in step {e.step}: {e.detail}"
    except torch.cuda.OutOfMemoryError as e:  # building the layout
        reason = f"out of memory: {str(e).splitlines()[0] if str(e) else 'CUDA'}"
    except Exception as e:  # noqa: BLE001 - a plugin's error: recorded, the tuning goes on
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    finally:
        gc.collect()  # this layout's model, optimizer, groups and buffers, before the next one is built
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()
    return reason, peak
