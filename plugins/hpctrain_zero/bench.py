"""ZeRO stages against PyTorch FSDP2: step time, peak memory per rank and wire bytes, on the same model and ranks.

Run under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench zero``; extra
``key=value`` arguments are Hydra overrides of the run config.

The contenders train the same model (same init: FSDP2's shards are filled
from the same per-tile init as ours, never a whole model per rank), the
same data and the same step: gradient accumulation over the rank's
micro-batches, global-norm clipping, AdamW with the schedule, the loss
averaged for the log.
- ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on each block and on the
  root (embedding and head), on gloo, with ``MixedPrecisionPolicy`` matching
  ``--param-dtype`` (reduce in fp32); built on the meta device and sharded
  before any memory is used, as FSDP2 recommends;
- ``zero-<s>[<backend>]``: ``Trainer.train_step()`` with
  ``parallel.zero.stage=s`` (stage 0 is plain data parallelism), on the mpi
  backend, and stage 3 also on torch (gloo: the transport FSDP2 uses here).

Step time: contenders run round-robin, one step each in turn
(``common.time_interleaved``); each step counts as its slowest rank's; the
table gives medians, the ratio to FSDP2 (of medians, and the median of
per-round ratios), and the last loss, which must agree (the same work).

Peak memory: a process's peak resident set cannot be shared between
contenders, so rank 0 starts one job per contender (``--only``, the same
ranks, ``--rss-steps`` steps) and reads back the largest ``ru_maxrss`` over
its ranks. Set ``--rss-model`` to a bigger model than the timing one: peak
RSS of identical runs varies (allocator, page timing; docs/benchmarks.md),
so model states must dwarf that.

Wire bytes: our communicators count bus bytes per step (``comm_bytes``);
the ratio to stage 0 is ZeRO's 1 (stages 1, 2) and 1.5 (stage 3: an
all-gather in forward, another in backward, a reduce-scatter, against one
all-reduce), a little under for stage 3 because the last unit's forward
gather serves its backward. FSDP2's traffic goes through torch and is not
counted.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.device_mesh import init_device_mesh

from hpctrain.bench.common import (
    Column,
    Table,
    loss_reader,
    machine_summary,
    metric_reader,
    paired_ratio,
    print_rank0,
    time_interleaved,
)
from hpctrain.bench.torch_peer import PeerLoop, fill_from_init, start
from hpctrain.errors import ArgumentParser
from hpctrain.model.build import build_model, logical_param_count
from hpctrain.run import build_mesh
from hpctrain.shard import get_spec
from hpctrain.train.trainer import Trainer
from hpctrain.train.trainer import peak_rss_bytes as mine

DEFAULT_OVERRIDES = (  # as hpctrain-bench dp: 3.3M parameters, a step well under a second per core
    "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
    "trainer.seq_len=64", "trainer.global_batch_size=8", "optim.warmup_steps=2",
)
"""Plus ``trainer.micro_batch_size`` = 8 / ranks: one micro-batch per rank, the
case ZeRO's communication figures are stated for (stages 2 and 3 reduce-
scatter every micro-batch and stage 3 gathers twice per micro-batch, so
with accumulation they move more; FSDP2 does the same by default)."""
RSS_MODEL = ("model.d_model=1024", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8")
"""51M parameters: 16 bytes each of model state (818 MB) per rank at stage 0."""


class Fsdp2Loop(PeerLoop):
    """One training step of the model under FSDP2 (see the module docstring)."""

    def __init__(self, cfg: Any, rt: Any, pm: Any, param_dtype: Optional[torch.dtype]):
        # heavy: ~1 s of torch.distributed, only for the torch peer
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = build_model(cfg, pm)  # meta device
        specs = {name: get_spec(p) for name, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (rt.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        fill_from_init(model, specs, cfg)
        super().__init__(cfg, model, rt.world_rank, rt.world_size)


def _zero_trainer(cfg: Any, rt: Any, pm: Any, stage: int, backend: str, param_dtype: str):
    c = copy.deepcopy(cfg)
    c.parallel.zero.stage = stage
    c.parallel.zero.param_dtype = param_dtype
    c.comm.backend = backend
    return Trainer(c, build_mesh(c, rt, pm), pm, rt.device)


Contender = Tuple[str, Callable[[], Any], Callable[[], Optional[float]], Callable[[], float]]


def contenders(args: Any, cfg: Any, rt: Any, pm: Any) -> List[Contender]:
    """(label, step, last loss, bytes on the wire in the last step) per contender."""
    wanted = args.only.split(",") if args.only else None
    dtype = {"none": None, "bf16": torch.bfloat16}[args.param_dtype]
    out: List[Contender] = []
    if wanted is None or "FSDP2" in wanted:
        loop = Fsdp2Loop(cfg, rt, pm, dtype)
        out.append(("FSDP2", loop.step, loss_reader(loop), lambda: float("nan")))
    runs = [(s, args.backend) for s in args.stages] + ([(3, "torch")] if 3 in args.stages and args.backend != "torch"
                                                        else [])
    for stage, backend in runs:
        label = f"zero-{stage}[{backend}]"
        if wanted is not None and label not in wanted:
            continue
        tr = _zero_trainer(cfg, rt, pm, stage, backend, args.param_dtype)

        def wire(t: Any = tr) -> float:
            return sum(v for k, v in t.metrics.items() if k.startswith("comm_bytes."))

        out.append((label, tr.train_step, metric_reader(tr, "loss"), wire))
    return out


def peak_rss_bytes(world: Any) -> int:
    return max(world.allgather(mine()))


def measure_rss(args: Any, labels: List[str], overrides: List[str], rt: Any) -> Dict[str, int]:
    """Rank 0 runs one job per contender (same ranks) and reads its peak RSS."""
    out: Dict[str, int] = {}
    if rt.world_rank == 0:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1")
        launcher = os.environ.get("HPCTRAIN_MPIEXEC", "mpiexec.openmpi")
        for label in labels:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [launcher, "-n", str(rt.world_size), sys.executable, "-m", "hpctrain.bench", "zero",
                       "--only", label, "--steps", str(args.rss_steps), "--warmup", "0", "--no-rss",
                       "--param-dtype", args.param_dtype, "--backend", args.backend, "--rss-out", f.name,
                       "--stages", ",".join(str(s) for s in args.stages), *overrides]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
                out[label] = json.load(open(f.name))["peak_rss_bytes"]
    return rt.mpi_comm.bcast(out, root=0)


def run(args: Any, cfg: Any, rt: Any, pm: Any, overrides: List[str]) -> None:
    world = rt.mpi_comm
    runners = contenders(args, cfg, rt, pm)
    if args.rss_out:  # a child job of measure_rss: just train and report the peak
        for _ in range(args.steps):
            for _, step, _, _ in runners:
                step()
        peak = peak_rss_bytes(world)
        if rt.world_rank == 0:
            json.dump({"peak_rss_bytes": peak}, open(args.rss_out, "w"))
        return
    params = logical_param_count(build_model(cfg))
    t = cfg.trainer
    print_rank0(world, f"# {machine_summary(world)}",
                f"# model d_model={cfg.model.d_model} n_layers={cfg.model.n_layers}: {params:,} parameters; global "
                f"batch {t.global_batch_size} x seq {t.seq_len}, micro-batch {t.micro_batch_size}; param dtype "
                f"{args.param_dtype}, reduce fp32",
                f"# {args.warmup} warm-up steps, median of {args.steps} (round-robin)")
    timings = time_interleaved([step for _, step, _, _ in runners], world, args.warmup, args.steps)
    samples = {label: tm.samples for (label, _, _, _), tm in zip(runners, timings)}
    med = {label: statistics.median(s) for label, s in samples.items()}
    wire = {label: w() for label, _, _, w in runners}
    base = wire.get(f"zero-0[{args.backend}]")
    table = Table([Column("contender", "{}", "<"), Column("step (ms)", "{:.1f}"), Column("vs FSDP2", "{:.3f}"),
                   Column("paired", "{:.3f}"), Column("wire MB/step", "{:.2f}"), Column("wire vs zero-0", "{:.3f}"),
                   Column("last loss", "{:.6f}")])
    for label, _, loss, _ in runners:
        paired = paired_ratio(samples[label], samples["FSDP2"]) if "FSDP2" in samples \
            else float("nan")
        table.add(label, med[label] * 1e3, med[label] / med.get("FSDP2", float("nan")), paired, wire[label] / 1e6,
                  wire[label] / base if base else float("nan"), loss())
    print_rank0(world, "", f"## step time and wire bytes ({rt.world_size} ranks)", table.render(args.markdown))
    if args.no_rss:
        return
    labels = [label for label, _, _, _ in runners]
    rss_overrides = [o for o in overrides if not o.startswith("model.")] + list(args.rss_model)
    peaks = measure_rss(args, labels, rss_overrides, rt)
    mem = Table([Column("contender", "{}", "<"), Column("peak RSS per rank (MiB)", "{:.1f}"),
                 Column("vs FSDP2", "{:.3f}")])
    for label in labels:
        mem.add(label, peaks[label] / 2**20, peaks[label] / peaks["FSDP2"] if "FSDP2" in peaks else float("nan"))
    print_rank0(world, "", f"## peak resident memory, one job per contender ({rt.world_size} ranks, "
                           f"{' '.join(args.rss_model)}, {args.rss_steps} steps)", mem.render(args.markdown))


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench zero", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3],
                   help="ZeRO stages to run (default 0,1,2,3)")
    p.add_argument("--backend", default="mpi", help="comm.backend of our contenders (default mpi)")
    p.add_argument("--param-dtype", default="none", choices=["none", "bf16"],
                   help="parameters' compute dtype, ours and FSDP2's (default none: fp32)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (default 3)")
    p.add_argument("--rss-steps", type=int, default=3, help="steps of each peak-memory job (default 3)")
    p.add_argument("--rss-model", type=lambda s: s.split(), default=list(RSS_MODEL),
                   help="model overrides of the peak-memory jobs (default: d_model 1024, 4 layers)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-memory jobs")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rss-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    started = start("zero", lambda n: [*DEFAULT_OVERRIDES, f"trainer.steps={args.warmup + args.steps}",
                                       f"trainer.micro_batch_size={max(1, 8 // n)}", *args.overrides])
    if started is None:
        return 2
    cfg, rt, pm = started
    run(args, cfg, rt, pm, args.overrides)
    return 0
