"""Optimizers over sharded state: Muon, LAMB and LARS against AdamW at dp N and tp N; DiLoCo against plain dp.

Run under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench optim``; extra
``key=value`` arguments are Hydra overrides of the run config. Sections run
in order (``SECTIONS``; ``--part NAME`` picks one), each printing its own
table:

- ``step``: for each layout (``dp``: every rank a data-parallel rank with
  ZeRO-1; ``tp``: every rank a tensor-parallel rank), ``Trainer.train_step``
  with each optimizer, run round-robin one step each in turn
  (``common.time_interleaved``; a step counts as its slowest rank's). The
  table gives the median step, its ratio to AdamW's, the median time of the
  optimizer's step alone (Muon's includes assembling its matrices and the
  Newton-Schulz share of this rank), Muon's share (matrices this rank
  orthogonalises / matrices of the stage), the bus bytes of the layout's
  group per step and the last loss.
- ``diloco``: ``optim.outer=diloco`` against plain data parallelism, step
  time and ``comm_bytes.dp`` per step (``hpctrain.bench._optim_outer``).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

from hpctrain.bench._optim_outer import diloco_section as table
from hpctrain.bench.common import (
    Column,
    Table,
    machine_summary,
    make_config,
    metric_reader,
    print_rank0,
    time_interleaved,
)
from hpctrain.bench.torch_peer import start
from hpctrain.errors import ArgumentParser
from hpctrain.run import build_mesh
from hpctrain.train.trainer import Trainer

DEFAULT_OVERRIDES = (  # the tp bench's 3.3M-parameter model, one micro-batch of 8 per step
    "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
    "trainer.seq_len=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "optim.warmup_steps=2",
)
OPTIMIZERS = ("adamw", "lamb", "lars", "muon")
LAYOUTS = {"dp": ("parallel.zero.stage=1",), "tp": ()}
"""Layout name -> overrides besides its axis size (the world)."""


class TimedStep:
    """Wraps ``optimizer.step`` to keep the duration of the last call."""

    def __init__(self, optimizer: Any):
        self.last = 0.0
        self._step = optimizer.step

        def step(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = self._step(*a, **k)
            self.last = time.perf_counter() - t0
            return out

        optimizer.step = step


def _trainer(cfg: Any, rt: Any, pm: Any, name: str, layout: str):
    del cfg  # composed again per optimizer and layout: the preset sets lr, momentum...
    c = copy.deepcopy(make_config([*_overrides(rt.world_size, layout), f"optim={name}"], pm, rt))
    return Trainer(c, build_mesh(c, rt, pm), pm, rt.device)


ARGS = argparse.Namespace(overrides=[], warmup=2, steps=10)


def _overrides(n: int, layout: str) -> List[str]:
    micro = [f"trainer.micro_batch_size={max(1, 8 // n)}"] if layout == "dp" else []  # 8 samples over dp
    return [*DEFAULT_OVERRIDES, f"trainer.steps={ARGS.warmup + ARGS.steps + 1}", f"parallel.{layout}={n}",
            *LAYOUTS[layout], *micro, *ARGS.overrides]


def _share(trainer: Any) -> str:
    opt = trainer.optimizer
    opt = opt.optimizers[0] if hasattr(opt, "optimizers") else opt
    if not hasattr(opt, "plan"):
        return "-"
    return f"{len(opt.owned())}/{len(opt.plan.owner)}"


def _runner(trainer: Any, timer: TimedStep, times: List[float]) -> Callable[[], None]:
    def step() -> None:
        trainer.train_step()
        times.append(timer.last)
    return step


def step_section(args: argparse.Namespace, cfg: Any, rt: Any, pm: Any) -> int:
    world = rt.mpi_comm
    for layout in LAYOUTS:
        trainers = {name: _trainer(cfg, rt, pm, name, layout) for name in args.optimizers}
        timers = {name: TimedStep(tr.optimizer) for name, tr in trainers.items()}
        opt_times: Dict[str, List[float]] = {name: [] for name in trainers}

        names = list(trainers)
        steps = [_runner(trainers[n], timers[n], opt_times[n]) for n in names]
        timings = time_interleaved(steps, world, args.warmup, args.steps)
        med = {n: statistics.median(t.samples) for n, t in zip(names, timings)}
        base = med.get("adamw", med[names[0]])
        group = "dp" if layout == "dp" else "tp"
        table = Table([Column("optimizer", "{}", "<"), Column("step (ms)", "{:.1f}"), Column("vs adamw", "{:.3f}"),
                       Column("optimizer step (ms)", "{:.1f}"), Column("NS share", "{}"),
                       Column(f"{group} MB/step", "{:.2f}"), Column("last loss", "{:.6f}")])
        for n in names:
            tr = trainers[n]
            table.add(n, med[n] * 1e3, med[n] / base, statistics.median(opt_times[n][-args.steps:]) * 1e3,
                      _share(tr), metric_reader(tr, f"comm_bytes.{group}")() / 1e6, metric_reader(tr, "loss")())
        print_rank0(world, "", f"## step time at {layout} {rt.world_size} (rank 0's share of Muon's matrices)",
                    table.render(args.markdown))
    return 0


def diloco_section(args: argparse.Namespace, cfg: Any, rt: Any, pm: Any) -> int:
    """DiLoCo's step time and dp bytes against plain data parallelism (``hpctrain.bench._optim_outer``)."""
    del cfg  # its own model (the dp benchmark's), composed per contender
    print_rank0(rt.mpi_comm, "", "## " + table(rt.mpi_comm, args.overrides, iters=args.steps, warmup=args.warmup,
                                                 markdown=args.markdown))
    return 0


SECTIONS: Dict[str, Callable[[argparse.Namespace, Any, Any, Any], int]] = {
    "step": step_section,
    "diloco": diloco_section,
}
"""Sections in the order ``--part all`` runs them: name -> fn(args, cfg, runtime, plugins) -> exit status."""


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench optim", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    p.add_argument("--part", default="all", choices=["all", *SECTIONS], help="one section (default: all)")
    p.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS),
                   help="optimizers to time (default adamw,lamb,lars,muon)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (default 2)")
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    ARGS.overrides, ARGS.warmup, ARGS.steps = args.overrides, args.warmup, args.steps
    started = start("optim", lambda n: _overrides(n, "dp"))
    if started is None:
        return 2
    cfg, rt, pm = started
    print_rank0(rt.mpi_comm, f"# {machine_summary(rt.mpi_comm)}",
                f"# {args.warmup} warm-up steps, median of {args.steps} (round-robin)")
    for name, section in SECTIONS.items():
        if args.part in ("all", name):
            status = section(args, cfg, rt, pm)
            if status:
                return status
    return 0
