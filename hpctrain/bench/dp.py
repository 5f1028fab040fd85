"""Step time of hpctrain's data parallelism against torch DDP on the same model, data and ranks.

Run under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench dp``; extra
arguments of the form ``key=value`` are Hydra overrides of the run config
(``model.d_model=512 trainer.seq_len=128``).

Every contender runs the *same* training step (``StepLoop``), so the
comparison isolates the data-parallel implementation: the same model and
init, its own data cursor over the same sample stream, gradient accumulation
over the rank's micro-batches, global-norm clipping, AdamW with the
learning-rate schedule, and the dp average of the loss that the trainer logs.
Only the gradient synchronisation differs:
- ``hpctrain[<backend>]``: our dp plugin, through its hooks
  (``hpctrain_parallelize``'s data handle: ``before_backward`` before each
  micro-batch's backward, ``reduce_gradients`` after), once per backend a
  plugin serves that can run here (``--backends`` to choose);
- ``torch DDP``: ``DistributedDataParallel`` on gloo, ``bucket_cap_mb`` =
  ``comm.bucket_mb``, ``no_sync()`` on all micro-batches but the last;
- ``local (no comm)``: the bare model, no communication: the compute floor,
  so ``step - floor`` is what synchronising costs.
``--trainer`` adds, per backend, the full ``Trainer.train_step()`` (the core's
clipping and metrics included), for reference. ``--compile`` adds those rows
and, per backend, the same Trainer with ``trainer.compile=true``
(``--compile-backend``, default inductor), and a second table: compiled
against eager step time (compilation happens in the warm-up steps).

Contenders run round-robin, one step each in turn
(``common.time_interleaved``), so they share the machine's load; each step
counts as its slowest rank's time. Reported: median step, hpctrain / DDP as the
ratio of medians and as the median of per-round ratios (each round's steps
are adjacent in time, so this one drifts less with a shared machine's load;
< 1 is faster), cost over the floor, as milliseconds and as the per-round
ratio to it, and the last loss, which must agree across the contenders (same
model, same data) as a check that they do the same work. ``--phases`` adds
where the time goes: per phase of the step (forward, the first, middle and
last micro-batches' backwards, the sync after backward, clip and optimizer,
the loss average), the floor's median and each contender's difference to it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpctrain.bench.comm import make_backends
from hpctrain.bench.common import (
    COMPILED,
    Column,
    Table,
    compile_table,
    loss_reader,
    machine_summary,
    make_config,
    metric_reader,
    paired_ratio,
    print_rank0,
    refuse,
    time_interleaved,
)
from hpctrain.bootstrap import init_torch_distributed, with_device
from hpctrain.comm.protocol import ReduceOp
from hpctrain.data import DataCursor, SampleOrder, open_source
from hpctrain.errors import ArgumentParser
from hpctrain.model.build import build_model, logical_param_count, materialize
from hpctrain.optimizers.adamw import build_adamw
from hpctrain.parallel.handles import LocalData
from hpctrain.plugins import axis_plugin, get_manager, parallelize_caller
from hpctrain.run import build_mesh, configure_torch
from hpctrain.train.lr_schedule import lr_at, set_lr
from hpctrain.train.trainer import Trainer

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.mesh import Mesh

# A wider tiny model than the default (3.3M parameters, 12.8 MiB of gradients,
# so communication is a visible share of the step), with a small batch so one
# step takes a fraction of a second on one core. Valid for 2, 4 and 8 ranks.
DEFAULT_OVERRIDES = (
    "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
    "trainer.seq_len=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
    "optim.warmup_steps=2",
)


class StepLoop:
    """One training step in plain torch; ``sync`` says how gradients are averaged:
    ``"ddp"``, ``"local"`` (not at all) or ``"hpctrain"`` (the dp plugin over ``mesh``)."""

    def __init__(self, cfg: Any, rt, pm, sync: str, mesh: Optional[Mesh] = None):
        self.cfg, self.pm, self.sync, self.mesh, self.dist = cfg, pm, sync, mesh, dist
        model = build_model(cfg, pm)
        self.data = LocalData(model)
        if sync == "hpctrain":  # on the meta model, as the composition does: the data axes' handle
            name = axis_plugin(pm, cfg, "dp")
            assert name is not None  # hpctrain installs its dp plugin
            self.data = parallelize_caller(pm, name)(model=model, axis="dp", mesh=mesh, cfg=cfg, run_dir=None)
        materialize(model, rt.device, cfg.trainer.seed, cfg.model.init_std, cfg.model.n_layers)
        self.data.after_materialize()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_adamw(self.params, cfg.optim)
        self.model = DistributedDataParallel(model, bucket_cap_mb=cfg.comm.bucket_mb) if sync == "ddp" else model
        t = cfg.trainer
        order = SampleOrder(open_source(cfg.data), t.seq_len, cfg.data.seed)
        if sync == "local":  # this rank's share of the batch, as if alone: same compute per rank
            self.cursor = DataCursor(order, t.global_batch_size // rt.world_size, t.micro_batch_size, 0, 1)
        else:
            self.cursor = DataCursor(order, t.global_batch_size, t.micro_batch_size, rt.world_rank, rt.world_size)
        self.step_count = 0
        self.last_loss: Optional[float] = None
        self.phases: List[Dict[str, float]] = []
        """Per step (warm-up included): seconds spent in each of ``PHASES``."""

    def step(self) -> None:
        cfg = self.cfg
        clock = PhaseClock()
        micro = self.cursor.next_step()
        set_lr(self.optimizer, lr_at(self.step_count, cfg.optim, cfg.trainer.steps))
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        clock.mark(PHASES[0])
        n, total = len(micro), None
        for i, (x, y, *_) in enumerate(micro):
            ddp = self.model if isinstance(self.model, DistributedDataParallel) else None  # sync == "ddp"
            quiet = ddp.no_sync() if ddp is not None and i < n - 1 else contextlib.nullcontext()
            with quiet:
                loss = self.model(x, y)
                clock.mark(PHASES[1])
                self.data.before_backward(i, n)
                (loss / n).backward()
                clock.mark(PHASES[4] if i == n - 1 else PHASES[2] if i == 0 else PHASES[3])
            total = loss.detach() if total is None else total + loss.detach()
        self.data.reduce_gradients()
        clock.mark(PHASES[5])
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip, foreach=True)
        self.optimizer.step()
        clock.mark(PHASES[6])
        assert total is not None  # a step has micro-batches
        loss = total / n
        if self.sync == "ddp":
            self.dist.all_reduce(loss)
            loss /= self.dist.get_world_size()
        elif self.sync == "hpctrain":
            assert self.mesh is not None  # given with sync="hpctrain"
            self.mesh.group("dp").communicator().all_reduce(loss, ReduceOp.AVG)
        clock.mark(PHASES[7])
        self.phases.append(clock.spent)
        self.step_count += 1
        self.last_loss = float(loss) if self.sync != "local" else None  # local saw other samples


PHASES = ("set-up", "forward", "backward: first micro-batch", "backward: middle micro-batches",
          "backward: last micro-batch", "after backward (reduce_gradients)", "clip + optimizer", "loss average")
"""What ``StepLoop`` times within each step (the forwards of all micro-batches add up in one)."""


class PhaseClock:
    """Seconds spent per phase of one step: each ``mark(phase)`` adds the time since the last mark."""

    def __init__(self) -> None:
        self.spent: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] += now - self._last
        self._last = now


Contender = Tuple[str, Callable[[], Any], Callable[[], Optional[float]], Optional[List[Dict[str, float]]]]
"""(label, one step, its last loss, its per-step phases: ``StepLoop.phases``, None for the Trainer rows)."""


def contenders(args, cfg, rt, pm) -> Tuple[List[Contender], List[str]]:
    init_torch_distributed("gloo", cfg.comm.timeout_s)
    comms, notes = make_backends(args.backends, rt, pm)
    out: List[Contender] = []
    for name in comms:
        c = copy.deepcopy(cfg)
        c.comm.backend = name
        loop = StepLoop(c, rt, pm, "hpctrain", build_mesh(c, rt, pm))
        out.append((f"hpctrain[{name}]", loop.step, loss_reader(loop), loop.phases))
    ddp, local = StepLoop(cfg, rt, pm, "ddp"), StepLoop(cfg, rt, pm, "local")
    out += [("torch DDP", ddp.step, lambda: ddp.last_loss, ddp.phases),
            (FLOOR, local.step, lambda: local.last_loss, local.phases)]
    if args.trainer or args.compile:
        for name in comms:
            for compiled in ([False, True] if args.compile else [False]):
                c = copy.deepcopy(cfg)
                c.comm.backend = name
                c.trainer.compile, c.trainer.compile_backend = compiled, args.compile_backend
                tr = Trainer(c, build_mesh(c, rt, pm), pm, rt.device)
                out.append((f"Trainer[{name}]" + (COMPILED if compiled else ""), tr.train_step,
                            metric_reader(tr, "loss"), None))
    return out, notes


def run(args, cfg, rt, pm) -> Table:
    world = rt.mpi_comm
    runners, notes = contenders(args, cfg, rt, pm)
    params = logical_param_count(build_model(cfg))
    t = cfg.trainer
    print_rank0(world, f"# {machine_summary(world)}",
                f"# model d_model={cfg.model.d_model} n_layers={cfg.model.n_layers}: {params:,} parameters "
                f"({params * 4 / 2**20:.1f} MiB of fp32 gradients); global batch {t.global_batch_size} x seq "
                f"{t.seq_len}, micro-batch {t.micro_batch_size}; comm.bucket_mb={cfg.comm.bucket_mb:g}, "
                f"comm.dp.compress={cfg.comm.dp.compress}, comm.dp.overlap={cfg.comm.dp.overlap}",
                f"# {args.warmup} warm-up steps, median of {args.steps} (round-robin)",
                *[f"# {n}" for n in notes])
    timings = time_interleaved([step for _, step, _, _ in runners], world, args.warmup, args.steps)
    samples: Dict[str, List[float]] = {label: t.samples for (label, _, _, _), t in zip(runners, timings)}
    med = {label: statistics.median(s) for label, s in samples.items()}
    ddp, floor = med["torch DDP"], med[FLOOR]
    table = Table([Column("contender", "{}", "<"), Column("step (ms)", "{:.1f}"), Column("min (ms)", "{:.1f}"),
                   Column("vs DDP", "{:.3f}"), Column("paired vs DDP", "{:.3f}"), Column("over floor (ms)", "{:+.1f}"),
                   Column("paired vs floor", "{:.3f}"), Column("last loss", "{:.6f}")])
    for label, _, loss, _ in runners:
        table.add(label, med[label] * 1e3, min(samples[label]) * 1e3, med[label] / ddp,
                  paired_ratio(samples[label], samples["torch DDP"]), (med[label] - floor) * 1e3,
                  paired_ratio(samples[label], samples[FLOOR]), loss())
    print_rank0(world, "", f"## data-parallel step time ({rt.world_size} ranks)", table.render(args.markdown))
    if args.phases:
        phases = phase_table(runners, world, args.warmup)
        print_rank0(world, "", "## where the time goes: each phase's median per step, and over the floor's",
                    phases.render(args.markdown))
    if args.compile:
        compiled = compile_table(samples, {label: loss() for label, _, loss, _ in runners}, args.compile_backend)
        print_rank0(world, "", f"## trainer.compile: compiled vs eager ({rt.world_size} ranks)",
                    compiled.render(args.markdown))
    return table


FLOOR = "local (no comm)"


def phase_table(runners: List[Contender], world: Any, warmup: int) -> Table:
    """Per phase of the step (``PHASES``): the floor's median milliseconds per step
    and each contender's difference to it. Each phase's time of a step is the
    slowest rank's; the warm-up steps are left out. Collective."""
    timed = [(label, phases) for label, _, _, phases in runners if phases is not None]
    everyone = world.allgather([phases[warmup:] for _, phases in timed])

    def per_step(i: int, phase: str) -> List[float]:
        return [max(rank[i][k][phase] for rank in everyone) for k in range(len(everyone[0][i]))]

    labels = [label for label, _ in timed]
    f = labels.index(FLOOR)
    others = [i for i in range(len(labels)) if i != f]
    table = Table([Column("phase", "{}", "<"), Column("floor (ms)", "{:.2f}"),
                   *[Column(f"{labels[i]} - floor", "{:+.2f}") for i in others]])
    for phase in PHASES:
        base = statistics.median(per_step(f, phase))
        table.add(phase, base * 1e3, *[(statistics.median(per_step(i, phase)) - base) * 1e3 for i in others])
    return table


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench dp", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config, e.g. comm.bucket_mb=4")
    p.add_argument("--backends", type=lambda s: s.split(","), default=None,
                   help="comma list of hpctrain backends (default: every one a plugin serves that can run here)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (default 3)")
    p.add_argument("--trainer", action="store_true", help="also time the full Trainer.train_step() per backend")
    p.add_argument("--compile", action="store_true",
                   help="also time the Trainer with trainer.compile=true against it eager, per backend")
    p.add_argument("--compile-backend", default="inductor", help="trainer.compile_backend with --compile")
    p.add_argument("--phases", action="store_true",
                   help="also print where each step's time goes (forward, each backward, the sync after it, "
                        "clip and optimizer, the loss average), each contender against the floor")
    p.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rt = with_device("cpu")
    if rt.world_size < 2:
        return refuse(None, "hpctrain-bench dp needs at least 2 ranks; run it as mpiexec -n 2 hpctrain-bench dp")
    pm = get_manager()
    steps = [f"trainer.steps={args.warmup + args.steps}"]  # the learning-rate schedule's length
    cfg = make_config(list(DEFAULT_OVERRIDES) + steps + args.overrides, pm, rt)
    configure_torch(cfg, rt)
    run(args, cfg, rt, pm)
    return 0
