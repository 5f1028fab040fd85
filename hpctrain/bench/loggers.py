"""Logging's cost per step: every logger backend, the log line and the memory gather, against the step.

Run: ``mpiexec -n 2 hpctrain-bench loggers`` (also one process). The real
trainer runs at the data-parallel benchmark's size (``hpctrain-bench dp``:
d_model 256, 4 layers, sequence 64, global batch 8) twice: with every
backend (``logging.backends=[jsonl,tensorboard,wandb,mlflow]``, W&B
offline, MLflow's file store) and, the worst case, a log line and a memory
gather at every step (``trainer.log_every=1``); and with no backend and no
log line or gather before the last step. Two figures: rank 0's time in the
loggers and the log line (``Trainer.logging_s``: rank 0 does all of it) per
step, and the loop's period per step (one step end to the next, so the
gather and everything in between count), median after ``--warmup`` steps,
of both runs side by side. The backends' start (W&B's service, MLflow's
store) happens once, before step 1, and is printed apart. Issue 33's
target: under 1% of the step. The gather's time is not timed alone: it
waits for the slowest rank, a wait the step's own all-reduce has anyway.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from typing import List, Optional

from hpctrain import hookimpl
from hpctrain.bench.common import machine_summary, make_config, print_rank0
from hpctrain.bench.dp import DEFAULT_OVERRIDES
from hpctrain.bootstrap import with_device
from hpctrain.errors import ArgumentParser
from hpctrain.plugins import get_manager
from hpctrain.run import configure_torch, prepare_run

ALL = "logging.backends=[jsonl,tensorboard,wandb,mlflow]"


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench loggers", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out first (default 3)")
    p.add_argument("overrides", nargs="*", help="more hpctrain-train overrides (e.g. model.d_model=512)")
    return p


def _one(cfg, rt, pm, warmup: int):
    """(median loop period s, rank 0's logging s per step, the backends' start s) of one run."""
    comm = rt.mpi_comm if rt.world_size > 1 else None
    run_dir = tempfile.mkdtemp(prefix="hpctrain-bench-loggers-") if rt.world_rank == 0 else None
    run_dir = comm.bcast(run_dir, root=0) if comm is not None else run_dir
    t0 = time.perf_counter()
    trainer = prepare_run(cfg, run_dir)
    start = time.perf_counter() - t0
    logged: List[float] = []
    ends: List[float] = []

    def watch(state, step, metrics):  # after the step's log calls
        logged.append(trainer.logging_s)
        ends.append(time.perf_counter())

    class Watch:
        hpctrain_on_step_end = staticmethod(watch)

    hookimpl(Watch.hpctrain_on_step_end)
    pm.register(Watch, name="bench-loggers-watch")
    try:
        history = trainer.fit()
    finally:
        pm.unregister(name="bench-loggers-watch")
    assert len(history) == len(ends)
    periods = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    per_step = (logged[-1] - logged[warmup]) / max(1, len(periods))
    values = (statistics.median(periods), per_step, start)
    values = comm.bcast(values, root=0) if comm is not None else values  # (every rank is done with the run)
    if run_dir is not None and rt.world_rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)  # the run's logs and metrics: only its times are wanted
    return values


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rt = with_device("cpu")
    pm = get_manager()
    comm = rt.mpi_comm if rt.world_size > 1 else None
    base = list(DEFAULT_OVERRIDES) + [f"trainer.steps={args.warmup + args.steps + 1}", "trainer.log_every=1",
                                      "trainer.progress=off", "reliability.straggler_every=0"] + args.overrides
    rows = []
    runs = (("every backend", [ALL]), ("no backend", ["logging.backends=[]", f"trainer.log_every={10**6}"]))
    for label, extra in runs:
        cfg = make_config(base + extra, pm, rt)
        configure_torch(cfg, rt)
        step, logging_s, start = _one(cfg, rt, pm, args.warmup)
        rows.append((label, step, logging_s, start))
    print_rank0(comm, machine_summary(comm), "")
    print_rank0(comm, f"{'run':<14} {'step period':>12} {'rank 0 logging':>15} {'share':>7} {'start':>8}")
    for label, period, logging_s, start in rows:
        print_rank0(comm, f"{label:<14} {period * 1e3:>9.1f} ms {logging_s * 1e3:>12.2f} ms "
                          f"{100 * logging_s / period:>6.2f}% {start:>6.1f} s")
    (_, with_all, _, _), (_, without, _, _) = rows
    print_rank0(comm, f"period with every backend / without: {with_all / without:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
