"""One training run, on every rank: validate, agree, build the mesh, train.

``run`` is what the CLI calls after composing the config, and what the
multi-rank tests call directly inside their MPI processes.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import torch

from hpctrain import eager
from hpctrain.bootstrap import Runtime, get_runtime, idle_wait, with_device
from hpctrain.comm.delay import delayed
from hpctrain.comm.protocol import Communicator, LocalCommunicator
from hpctrain.comm.watch import OpBoard
from hpctrain.config.validate import validate
from hpctrain.errors import ConfigError, HpctrainError, PluginError
from hpctrain.log import add_file_log, get_logger, log_rank0, remove_file_log
from hpctrain.mesh import AXES, Group, Mesh
from hpctrain.plugins import capabilities, get_manager
from hpctrain.train import elastic
from hpctrain.train.loggers import Loggers, open_loggers
from hpctrain.train.outer import alone_axes
from hpctrain.train.profile import OutOfMemoryWithSnapshot
from hpctrain.train.state import TrainState
from hpctrain.train.trainer import Trainer
from hpctrain.train.watchdog import JobStopped, Watchdog

log = get_logger(__name__)


def agree_on_problems(problems: List[str], rt: Runtime) -> List[str]:
    """Share every rank's validation problems (one MPI allgather) so all
    ranks stop together. A problem seen on only some ranks names them.
    The ranks that finish validating first wait with sleeps (``idle_wait``)."""
    if rt.world_size == 1:
        return problems
    idle_wait(rt.mpi_comm, poll_s=0.002)
    everyone = rt.mpi_comm.allgather(problems)
    merged: Dict[str, List[int]] = {}
    for rank, found in enumerate(everyone):
        for p in found:
            merged.setdefault(p, []).append(rank)
    return [p if len(ranks) == rt.world_size else f"{p} (on ranks {ranks})" for p, ranks in merged.items()]


def configure_torch(cfg: Any, rt: Runtime) -> None:
    """Threads per rank and determinism, before any tensor work."""
    if "OMP_NUM_THREADS" not in os.environ and rt.device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // rt.local_size))
    if not cfg.trainer.compile:
        eager.defer_torch_marks()  # torch's compiler stays unloaded (hpctrain.eager)
    if cfg.trainer.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if cfg.trainer.compile:
            torch.use_deterministic_algorithms(True, warn_only=True)
        else:  # the same switch without importing inductor for its own flag (set by model.compile when compiling)
            torch._C._set_deterministic_algorithms(True, warn_only=True)
        # torch would then fill every new tensor with NaN (so that a read of memory never
        # written shows): one more write of every activation and buffer, off unless asked for
        torch.utils.deterministic.fill_uninitialized_memory = bool(cfg.debug.fill_uninitialized)  # type: ignore[attr-defined]


def resolve_backend_name(name: str, device: torch.device, pm) -> str:
    """``auto`` -> nccl on GPU; on CPU mpi when a plugin serves it (the faster
    CPU path here), else torch (gloo). Other names pass through."""
    if name != "auto":
        return name

    served = capabilities(pm).get("comm.backend", [])
    if device.type == "cuda" and "nccl" in served:
        return "nccl"
    return "mpi" if "mpi" in served else "torch"


def backend_factory(cfg: Any, pm, device: torch.device):
    def make(group: Group) -> Communicator:
        # A backend makes a group's communicator collectively over the world,
        # once per partition; a one-rank group may only skip that when every
        # group of its partition has one rank (pp_ends: the middle stages are
        # alone while the ends pair up, and all must join the split).
        if all(len(ranks) == 1 for ranks in group.partition):
            return LocalCommunicator()
        names = {resolve_backend_name(cfg.comm.per_axis.get(a, cfg.comm.backend), device, pm) for a in group.axes}
        if len(names) > 1:
            raise ConfigError(f"group {group.name} spans axes with different comm.per_axis backends {sorted(names)}")
        name = names.pop()
        comm = pm.hook.hpctrain_make_backend(name=name, group=group, cfg=cfg)
        if comm is None:
            raise PluginError(f"comm backend {name!r} was declared but its plugin returned no communicator "
                              f"for {group.name}")
        # debug.comm_delay_*: a slow link under every group that crosses that axis
        return delayed(comm, group.axes, cfg.debug.comm_delay_axis, float(cfg.debug.comm_delay_ms))

    return make


def build_mesh(cfg: Any, rt: Runtime, pm, board: Optional[OpBoard] = None) -> Mesh:
    mesh = Mesh({a: cfg.parallel[a] for a in AXES}, rt.world_rank, rt.world_size, cfg.parallel.order,
                rank_nodes=rt.rank_nodes or None, board=board, alone_axes=alone_axes(cfg))
    mesh.attach_backends(backend_factory(cfg, pm, rt.device))
    return mesh


def run(cfg: Any, run_dir: Optional[str] = None, pm=None, evaluate_only: bool = False,
        watchdog_holder: Optional[List[Any]] = None) -> List[Dict[str, float]]:
    """Train according to ``cfg``; returns the per-step metrics (every rank).
    ``evaluate_only`` (``hpctrain-eval``): build the layout, load
    ``checkpoint.resume`` and run one validation instead of training.

    With ``reliability.hang_timeout_s`` > 0 on more than one rank, the hang
    watchdog runs from after validation to the end (``hpctrain.train.watchdog``).
    A caller that passes its own ``watchdog_holder`` (a list) gets the watchdog
    in it and stops it itself: ``hpctrain-tune`` keeps it watching while the
    ranks agree on a failed layout, so a failure on some ranks only still ends
    the job with the watchdog's line.
    """
    holder: List[Any] = [] if watchdog_holder is None else watchdog_holder
    done = False
    try:
        if evaluate_only:
            _check_evaluation(cfg)  # a config problem: before any collective
            # it saves nothing, so it reads without the directory's lock: a running training job may hold it
            cfg.checkpoint.every, cfg.checkpoint.save_on_stop = 0, False
        # hpctrain-eval writes validation.json only: no logger backend run (no training step to log)
        trainer = prepare_run(cfg, run_dir, pm, watchdog_holder=holder, loggers=not evaluate_only,
                              trains=not evaluate_only)
        history = evaluate(trainer, run_dir) if evaluate_only else trainer.fit()
        done = True
        return history
    except Exception as e:
        if holder and not isinstance(e, (HpctrainError, OutOfMemoryWithSnapshot)):
            # a failure caused by another rank's fault: the watchdog has (or is about to have) named it
            # (an out-of-memory in a step is this rank's own)
            verdict = holder[0].wait_for_verdict(5.0)
            if verdict is not None:
                raise JobStopped(verdict) from e
        raise
    finally:
        if holder and watchdog_holder is None:
            holder[0].stop("done" if done else "error")
        if run_dir:
            remove_file_log()  # the next point of a sweep in this process logs to its own train.log


def evaluate(trainer: Any, run_dir: Optional[str] = None) -> List[Dict[str, float]]:
    """One validation of the trainer's weights (``hpctrain-eval``); rank 0 writes
    ``validation.json`` in the run directory."""

    if trainer.step == 0:  # the same on every rank: checkpoint.resume=auto found nothing
        raise ConfigError(f"hpctrain-eval: checkpoint.resume={trainer.cfg.checkpoint.resume} found no checkpoint "
                          f"in {trainer.cfg.checkpoint.dir}; name a checkpoint file or the run's checkpoint.dir")
    out = {"step": trainer.step, **trainer.validate()}
    if run_dir and trainer.mesh.world_rank == 0:
        with open(os.path.join(run_dir, "validation.json"), "w") as f:
            json.dump(out, f, indent=1)
    return [out]


def _check_evaluation(cfg: Any) -> None:
    """What ``hpctrain-eval`` needs beyond a training config: a checkpoint and validation data."""
    problems = []
    if not cfg.checkpoint.resume:
        problems.append("hpctrain-eval needs the checkpoint to validate: checkpoint.resume=<file>, or "
                        "checkpoint.resume=auto with the run's checkpoint.dir")
    if cfg.data.source != "indexed" or not (cfg.data.split or cfg.data.validation.paths):
        problems.append("hpctrain-eval needs validation data: data.source=indexed with data.split=<fraction> "
                        "(the training run's) or data.validation.paths=[<shards>]")
    if problems:
        raise ConfigError("\n".join(problems))


def start_watchdog(cfg: Any, rt: Runtime, run_dir: Optional[str] = None):
    """The hang watchdog for this job, or None (off, or one rank); its verdict is
    recorded in ``run_dir`` (``hpctrain.train.recovery``)."""
    timeout = float(cfg.reliability.hang_timeout_s)
    if rt.world_size == 1 or timeout <= 0:
        return None

    return Watchdog(rt.mpi_comm, timeout, run_dir=run_dir)


def prepare_run(cfg: Any, run_dir: Optional[str] = None, pm=None, watchdog_holder: Optional[List[Any]] = None,
                loggers: bool = True, trains: bool = True):
    """Validate (agreed over all ranks), build the mesh and the Trainer; no step yet; with ``loggers``,
    open the logger backends (else the trainer opens them at its first logged step, if any). Without
    ``trains`` (``hpctrain-eval``) a checkpoint of another optimizer is accepted: no step is taken.

    With ``watchdog_holder`` (a list), the hang watchdog is started after
    validation and appended to it; the caller stops it."""

    rt = get_runtime()
    pm = pm or get_manager()
    notes = elastic.adapt(cfg, rt.world_size, rt.num_nodes)  # the same change on every rank, before validation
    problems = agree_on_problems(validate(cfg, rt.world_size, pm, run_dir), rt)
    if problems:
        raise ConfigError("\n".join(problems))
    rt = with_device(cfg.trainer.device)
    configure_torch(cfg, rt)
    if run_dir and rt.is_main:
        os.makedirs(run_dir, exist_ok=True)
        add_file_log(os.path.join(run_dir, "train.log"))
    board = None
    if watchdog_holder is not None:
        watchdog = start_watchdog(cfg, rt, run_dir)
        if watchdog is not None:
            watchdog_holder.append(watchdog)
            board = watchdog.board
    mesh = build_mesh(cfg, rt, pm, board)
    if cfg.trainer.elastic:
        for line in [*notes, elastic.describe(cfg, mesh)]:
            log_rank0("%s", line)
    trainer = Trainer(cfg, mesh, pm, rt.device, run_dir)
    if trains:
        trainer.checkpointing.refuse_another_optimizer()
    if loggers:  # after the set-up (a checkpoint that does not fit leaves no metrics.jsonl), before step 1
        trainer.loggers = open_loggers_agreed(cfg, rt, pm, run_dir)
    return trainer


def open_loggers_agreed(cfg: Any, rt: Runtime, pm, run_dir: Optional[str]):
    """Rank 0's logger backends, opened before step 1; a backend that cannot
    start (a package missing, a directory it cannot write) stops every rank
    with rank 0's one line (its verdict broadcast over MPI, like validation's)."""

    loggers, problem = Loggers(), None
    if rt.is_main and run_dir:
        try:
            loggers = open_loggers(cfg, pm, run_dir)
        except ConfigError as e:
            problem = str(e)
    if rt.world_size > 1:
        problem = rt.mpi_comm.bcast(problem, root=0)
    if problem:
        raise ConfigError(problem)
    return loggers


def reference_trainer(cfg: Any, pm=None, run_dir: Optional[str] = None):
    """A Trainer for ``cfg`` in this process alone, as a one-process job would build it,
    whatever the MPI world is: every axis size 1, local communicators.

    This is the reference every parallel layout is compared with (the
    parity tests call it inside each MPI rank). ``parallel.*`` in ``cfg`` is
    ignored; the global batch, seed and data order are the same.
    """

    pm = pm or get_manager()
    mesh = Mesh({a: 1 for a in AXES}, 0, 1, alone_axes=alone_axes(cfg))
    mesh.attach_backends(lambda group: LocalCommunicator())
    return Trainer(cfg, mesh, pm, torch.device("cpu"), run_dir)


def reference_state(cfg: Any, pm=None) -> TrainState:
    """The ``TrainState`` of ``reference_trainer(cfg, pm)`` at step 0 (its weights as ``cfg`` initialises them,
    ``checkpoint.init_from`` included): what a tool saves as a checkpoint without training."""
    return reference_trainer(cfg, pm).state


def reference_run(cfg: Any, pm=None, run_dir: Optional[str] = None) -> List[Dict[str, float]]:
    """``reference_trainer(...).fit()``: the one-process losses."""
    return reference_trainer(cfg, pm, run_dir).fit()
