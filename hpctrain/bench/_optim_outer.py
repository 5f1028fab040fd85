"""The DiLoCo section of ``hpctrain-bench optim``: step time and dp bytes of
``optim.outer=diloco`` against plain data parallelism (``diloco_section``).

Contenders, built side by side in the same job on the whole world as data
parallelism (``parallel.dp=-1``, so run it under ``mpiexec -n 2`` or more):
plain dp (AdamW, gradients averaged every step), then DiLoCo for each
``every`` with the deltas in fp32 and in bf16 on the wire. Each timed call
runs ``lcm(every...)`` whole steps of the real ``Trainer.train_step`` (so
every DiLoCo contender completes whole rounds, outer step included), in
rounds that rotate the contenders (``common.time_interleaved``: they share
the machine's drift); a call counts as its slowest rank's time. Reported
per contender: the median step time (call time / steps), its ratio to plain
dp's, ``comm_bytes.dp`` per step (the mean over the call's steps) and its
ratio to plain dp's (theory: 1/every, 1/(2 every) in bf16), and the last
loss (DiLoCo trains a different, not a worse-by-definition, model).
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Sequence

from hpctrain.bench.common import Column, Table, time_interleaved
from hpctrain.bootstrap import get_runtime
from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.errors import ConfigError
from hpctrain.plugins import get_manager
from hpctrain.run import build_mesh, configure_torch
from hpctrain.train.trainer import Trainer

DEFAULT_OVERRIDES = (
    "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
    "trainer.seq_len=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.steps=100000",
    "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100000", "reliability.straggler_every=0",
    "reliability.weight_check_every=0", "parallel.dp=-1",
)
"""The dp benchmark's model (3.3M parameters: communication is a visible share of a CPU step)."""


def _trainer(overrides: Sequence[str], pm: Any) -> Any:
    cfg = compose_resolved(list(overrides), pm)
    rt = get_runtime()
    problems = validate(cfg, rt.world_size, pm)
    if problems:
        raise ConfigError("\n".join(problems))
    configure_torch(cfg, rt)
    return Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)


class _Steps:
    """``steps`` train steps of one trainer per call; the dp bytes they moved."""

    def __init__(self, trainer: Any, steps: int):
        self.trainer, self.steps = trainer, steps
        self.bytes: List[float] = []

    def __call__(self) -> None:
        for _ in range(self.steps):
            self.bytes.append(float(self.trainer.train_step().get("comm_bytes.dp", 0.0)))


def diloco_section(mpi_comm: Any, overrides: Sequence[str] = (), every: Sequence[int] = (4, 16),
                   iters: int = 5, warmup: int = 1, markdown: bool = False) -> str:
    """The table (text or markdown) of DiLoCo against plain dp; collective over ``mpi_comm``
    (the world). ``overrides`` follow ``DEFAULT_OVERRIDES``."""
    pm = get_manager()
    base = list(DEFAULT_OVERRIDES) + list(overrides)
    steps = math.lcm(*every)
    names = ["plain dp"]
    runs = [_Steps(_trainer(base, pm), steps)]
    for h in every:
        for dtype in ("fp32", "bf16"):
            names.append(f"DiLoCo every={h} ({dtype})")
            runs.append(_Steps(_trainer(base + ["optim.outer=diloco", f"optim.outer.every={h}",
                                                f"optim.outer.dtype={dtype}"], pm), steps))
    fns: List[Callable[[], Any]] = list(runs)
    timings = time_interleaved(fns, mpi_comm, warmup=warmup, iters=iters)
    table = Table([Column("contender", align="<"), Column("step ms", "{:.1f}"), Column("vs plain dp", "{:.2f}"),
                   Column("dp bytes/step", "{:,.0f}"), Column("bytes vs plain dp", "{:.4f}"),
                   Column("last loss", "{:.4f}")])
    plain_step = timings[0].median / steps
    plain_bytes = sum(runs[0].bytes) / len(runs[0].bytes)
    for name, run, timing in zip(names, runs, timings):
        step = timing.median / steps
        per_step = sum(run.bytes) / len(run.bytes)
        table.add(name, step * 1e3, step / plain_step, per_step, per_step / plain_bytes if plain_bytes else math.nan,
                  run.trainer.metrics["loss"])
    world = mpi_comm.Get_size()
    head = (f"DiLoCo against plain data parallelism: dp {world}, {steps} steps per timed call, "
            f"median of {iters} calls (slowest rank)")
    return head + "\n" + table.render(markdown)
