"""Pipeline parallelism against ``torch.distributed.pipelining``: step time per schedule; our bubble vs theory.

Step times are taken on the same stages for both.

Run under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench pp``; every rank
is one pipeline rank (pp = the world size); extra ``key=value`` arguments
are Hydra overrides of the run config.

Each schedule runs twice, on the same stages (our ``Transformer.part`` of
the same model, init and data; ``parallel.pipeline.layers`` splits both):

- ``torch <Schedule>``: ``PipelineStage`` + ``ScheduleGPipe``,
  ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` (vpp 2) or
  ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1's setting),
  on gloo, with the step our trainer takes around it (AdamW, the schedule's
  learning rate, clipping by the norm over all stages);
- ``ours <schedule>``: ``Trainer.train_step()`` with that
  ``parallel.pipeline.schedule`` on ``comm.backend`` (default mpi; add
  torch with ``--backends mpi,torch``).

Contenders run round-robin, one step each in turn
(``common.time_interleaved``); each step counts as its slowest rank's. The
first table gives medians and the ratio ours / torch per schedule (of
medians, and the median of per-round ratios) and the last loss, which must
agree. The second gives our measured bubble (``timeline``: idle over
compute per rank, mean over ranks, median of ``--bubble-steps`` steps)
against the published formula (equal stages) and against the simulator's
play of the same programs with each rank's measured mean F, B and W times
(unequal stages, free messages): measured minus simulated is what the
executor and the wire add.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from hpctrain.bench.common import (
    Column,
    Table,
    loss_reader,
    machine_summary,
    metric_reader,
    print_rank0,
    time_interleaved,
)
from hpctrain.bench.torch_peer import fill_from_init, start
from hpctrain.data import DataCursor, SampleOrder, open_source
from hpctrain.errors import ArgumentParser
from hpctrain.model.build import build_model, logical_param_count
from hpctrain.model.shapes import ModelShape
from hpctrain.optimizers.adamw import build_adamw
from hpctrain.pipeline.bubble import formula_bubble
from hpctrain.pipeline.split import model_end_cost, stage_layers
from hpctrain.run import build_mesh
from hpctrain.shard import get_spec
from hpctrain.train.lr_schedule import lr_at, set_lr
from hpctrain.train.trainer import Trainer

DEFAULT_OVERRIDES = (  # 8 blocks of d_model 256: 2 per virtual stage at pp 2 x vpp 2; 8 micro-batches per step
    "model.d_model=256", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=4",
    "trainer.seq_len=128", "trainer.global_batch_size=16", "trainer.micro_batch_size=2", "optim.warmup_steps=2",
)
SCHEDULES = {  # ours -> (torch's schedule class, model chunks per rank)
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zb-h1": ("ScheduleInterleavedZeroBubble", 1),
}


class _Stage(nn.Module):
    """One of our stage parts with torch's stage signature: hidden (or token ids) in, hidden (or logits) out."""

    def __init__(self, part: nn.Module):
        super().__init__()
        self.part = part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part(x)


class TorchPipelineLoop:
    """Our model's stages under ``torch.distributed.pipelining`` (see the module docstring)."""

    def __init__(self, cfg: Any, rt: Any, pm: Any, schedule: str):
        self.cfg, self.dist = cfg, dist
        cls_name, v = SCHEDULES[schedule]
        p, r = rt.world_size, rt.world_rank
        model = build_model(cfg, pm)  # meta device
        specs = {name: get_spec(prm) for name, prm in model.named_parameters()}
        fill_from_init(model, specs, cfg)
        layers = stage_layers(cfg.parallel.pipeline.layers, cfg.model.n_layers, p * v,
                              model_end_cost(ModelShape.from_config(cfg.model)))
        self.stages, self.first, self.last = [], False, False
        for c in range(v):
            s = c * p + r
            part = model.part(layers[s], first=s == 0, last=s == p * v - 1)
            self.first |= s == 0
            self.last |= s == p * v - 1
            self.stages.append(pipelining.PipelineStage(_Stage(part), s, p * v, torch.device("cpu")))
        self.params = [prm for st in self.stages for prm in st.submod.parameters()]
        t = cfg.trainer
        self.m = t.global_batch_size // t.micro_batch_size
        cls = getattr(pipelining, cls_name)
        self.schedule = cls(self.stages if (v > 1 or cls_name.startswith("ScheduleInterleaved")) else self.stages[0],
                            n_microbatches=self.m, loss_fn=_cross_entropy)
        self.optimizer = build_adamw(self.params, cfg.optim)
        self.cursor = DataCursor(SampleOrder(open_source(cfg.data), t.seq_len, cfg.data.seed), t.global_batch_size,
                                 t.micro_batch_size, 0, 1)
        self.step_count = 0
        self.last_loss: Optional[float] = None

    def step(self) -> None:
        cfg = self.cfg
        micro = self.cursor.next_step()
        set_lr(self.optimizer, lr_at(self.step_count, cfg.optim, cfg.trainer.steps))
        self.optimizer.zero_grad(set_to_none=True)
        inputs = torch.cat([mb.inputs for mb in micro]) if self.first else None
        targets = torch.cat([mb.targets for mb in micro]) if self.last else None
        losses: List[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        self.schedule.step(*args, target=targets, losses=losses if self.last else None)
        # clip by the norm over every stage, as our trainer does
        sq = torch.zeros((), dtype=torch.float64)
        for prm in self.params:
            if prm.grad is not None:
                sq += prm.grad.double().pow(2).sum()
        loss = torch.stack(losses).detach().double().mean() if self.last else torch.zeros((), dtype=torch.float64)
        both = torch.stack([sq, loss])
        self.dist.all_reduce(both)
        if cfg.optim.grad_clip > 0:
            coef = min(1.0, cfg.optim.grad_clip / (math.sqrt(float(both[0])) + 1e-6))
            for prm in self.params:
                if prm.grad is not None:
                    prm.grad.mul_(coef)
        self.optimizer.step()
        self.step_count += 1
        self.last_loss = float(both[1])


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _our_trainer(cfg: Any, rt: Any, pm: Any, backend: str, schedule: str):
    c = copy.deepcopy(cfg)
    c.comm.backend = backend
    c.parallel.pipeline.schedule = schedule
    c.parallel.pipeline.vpp = SCHEDULES[schedule][1]
    return Trainer(c, build_mesh(c, rt, pm), pm, rt.device)


Contender = Tuple[str, str, Callable[[], Any], Callable[[], Optional[float]], Any]


def contenders(args: Any, cfg: Any, rt: Any, pm: Any) -> List[Contender]:
    """(label, schedule, step, last loss, our trainer or None) per contender."""
    out: List[Contender] = []
    for schedule in args.schedules:
        loop = TorchPipelineLoop(cfg, rt, pm, schedule)
        out.append((f"torch {SCHEDULES[schedule][0]}", schedule, loop.step, loss_reader(loop), None))
        for backend in args.backends:
            tr = _our_trainer(cfg, rt, pm, backend, schedule)
            out.append((f"ours {schedule}[{backend}]", schedule, tr.train_step, metric_reader(tr, "loss"), tr))
    return out


def measured_bubbles(trainer: Any, steps: int) -> Dict[str, float]:
    """Median over ``steps`` steps of the measured bubble, the formula's and the simulator's with measured times."""
    pipeline = trainer.parallel.handles["pp"]
    measured: List[float] = []
    simulated: List[float] = []
    for _ in range(steps):
        trainer.train_step()
        recorded = pipeline.timeline(trainer.cursor.num_microbatches, None, log=False)
        assert recorded is not None  # the bench's trainers record their timelines
        tl = recorded
        theory = tl.simulated_per_rank()
        measured.append(tl.bubble())
        simulated.append(sum(theory.bubble(r) for r in range(tl.p)) / tl.p)

    return {"measured": statistics.median(measured), "simulated": statistics.median(simulated),
            "formula": formula_bubble(tl.schedule, tl.p, tl.v, tl.m), "m": tl.m, "v": tl.v}


def run(args: Any, cfg: Any, rt: Any, pm: Any) -> None:
    world = rt.mpi_comm
    runners = contenders(args, cfg, rt, pm)
    t = cfg.trainer
    print_rank0(world, f"# {machine_summary(world)}",
                f"# model d_model={cfg.model.d_model} n_layers={cfg.model.n_layers}: "
                f"{logical_param_count(build_model(cfg)):,} parameters; pp={rt.world_size}; "
                f"global batch {t.global_batch_size} x seq {t.seq_len}, micro-batch {t.micro_batch_size}",
                f"# {args.warmup} warm-up steps, median of {args.steps} (round-robin)")
    timings = time_interleaved([step for _, _, step, _, _ in runners], world, args.warmup, args.steps)
    samples = {label: tm.samples for (label, *_), tm in zip(runners, timings)}
    med = {label: statistics.median(s) for label, s in samples.items()}
    peer = {schedule: label for label, schedule, _, _, trainer in runners if trainer is None}
    table = Table([Column("contender", "{}", "<"), Column("step (ms)", "{:.1f}"), Column("vs torch", "{:.3f}"),
                   Column("paired", "{:.3f}"), Column("last loss", "{:.6f}")])
    for label, schedule, _, loss, _ in runners:
        ref = peer[schedule]
        paired = statistics.median(a / b for a, b in zip(samples[label], samples[ref]))
        table.add(label, med[label] * 1e3, med[label] / med[ref], paired, loss())
    print_rank0(world, "", f"## step time (pp={rt.world_size})", table.render(args.markdown))
    bubbles = Table([Column("ours", "{}", "<"), Column("m", "{}"), Column("v", "{}"), Column("measured", "{:.3f}"),
                     Column("formula", "{:.3f}"), Column("simulated", "{:.3f}"),
                     Column("measured - formula", "{:+.3f}"), Column("measured - simulated", "{:+.3f}")])
    for label, _, _, _, trainer in runners:
        if trainer is not None:
            b = measured_bubbles(trainer, args.bubble_steps)
            bubbles.add(label, b["m"], b["v"], b["measured"], b["formula"], b["simulated"],
                        b["measured"] - b["formula"], b["measured"] - b["simulated"])
    print_rank0(world, "", "## bubble: idle / compute per rank, mean over ranks (simulated: the schedule played "
                "with each rank's measured mean F, B, W times and free messages)", bubbles.render(args.markdown))


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench pp", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES),
                   help=f"schedules to compare (default {','.join(SCHEDULES)})")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["mpi"],
                   help="comm.backend of our contenders (default mpi)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (default 3)")
    p.add_argument("--bubble-steps", type=int, default=3, help="steps whose bubble is measured (default 3)")
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        print(f"hpctrain-bench pp: unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
        return 2
    steps = args.warmup + args.steps + args.bubble_steps
    started = start("pp", lambda n: [*DEFAULT_OVERRIDES, f"trainer.steps={steps}", f"parallel.pp={n}",
                                     *args.overrides])
    if started is None:
        return 2
    run(args, *started)
    return 0
