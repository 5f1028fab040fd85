"""Tensor parallelism against torch's tensor-parallel API: step time on the same model and ranks.

Run under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench tp``; every rank
is one tp rank (tp = the world size); extra ``key=value`` arguments are
Hydra overrides of the run config.

The contenders train the same model (the same class, init, data and step:
accumulation, clipping, AdamW and the schedule, ``bench.torch_peer``):

- ``torch-TP``: ``parallelize_module`` with ColwiseParallel for Q/K/V and
  gate/up, RowwiseParallel for the attention output and down projection,
  SequenceParallel norms, a vocab-parallel embedding and output, and
  ``loss_parallel`` (the plan torchtitan uses for Llama), on gloo;
- ``tp[<backend>]``: ``Trainer.train_step()`` with ``parallel.tp`` = the
  world size and sequence parallelism, on the mpi backend and on torch
  (gloo: the transport torch-TP uses here).

``--compile`` adds ``tp[<backend>] +compile``: the same Trainer with
``trainer.compile=true`` (``--compile-backend``, default inductor), and a
second table of compiled against eager step time (compilation happens in
the warm-up steps).

Contenders run round-robin, one step each in turn
(``common.time_interleaved``); each step counts as its slowest rank's; the
table gives medians, the ratio to torch-TP (of medians, and the median of
per-round ratios), our bus bytes per step (``comm_bytes.tp``) and the last
loss, which must agree.
"""
from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any, Callable, List, Optional, Tuple

from torch.distributed.device_mesh import init_device_mesh

from hpctrain.bench.common import (
    COMPILED,
    Column,
    Table,
    compile_table,
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

DEFAULT_OVERRIDES = (  # the dp/zero benches' 3.3M-parameter model, one micro-batch of 8 per step
    "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
    "trainer.seq_len=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "optim.warmup_steps=2",
)


class TorchTpLoop(PeerLoop):
    """The model under torch's tensor-parallel API (see the module docstring)."""

    def __init__(self, cfg: Any, rt: Any, pm: Any):
        # heavy: ~1 s of torch.distributed, only for the torch peer
        from torch.distributed.tensor import Replicate, Shard

        # heavy: ~1 s of torch.distributed, only for the torch peer
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            loss_parallel,
            parallelize_module,
        )

        model = build_model(cfg, pm)  # meta device
        specs = {name: get_spec(p) for name, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (rt.world_size,))
        parallelize_module(model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
        for block in model.layers:
            parallelize_module(block, mesh, {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
                "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
                "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        fill_from_init(model, specs, cfg)
        super().__init__(cfg, model, 0, 1, loss_context=loss_parallel)


def _our_trainer(cfg: Any, rt: Any, pm: Any, backend: str, compile_backend: Optional[str] = None):
    c = copy.deepcopy(cfg)
    c.comm.backend = backend
    if compile_backend is not None:
        c.trainer.compile, c.trainer.compile_backend = True, compile_backend
    return Trainer(c, build_mesh(c, rt, pm), pm, rt.device)


Contender = Tuple[str, Callable[[], Any], Callable[[], Optional[float]], Callable[[], float]]


def contenders(args: Any, cfg: Any, rt: Any, pm: Any) -> List[Contender]:
    """(label, step, last loss, our bus bytes in the last step) per contender."""
    loop = TorchTpLoop(cfg, rt, pm)
    out: List[Contender] = [("torch-TP", loop.step, lambda: loop.last_loss, lambda: float("nan"))]
    for backend in args.backends:
        for compiled in ([None, args.compile_backend] if args.compile else [None]):
            tr = _our_trainer(cfg, rt, pm, backend, compiled)
            out.append((f"tp[{backend}]" + (COMPILED if compiled else ""), tr.train_step, metric_reader(tr, "loss"),
                        metric_reader(tr, "comm_bytes.tp")))
    return out


def run(args: Any, cfg: Any, rt: Any, pm: Any) -> None:
    world = rt.mpi_comm
    runners = contenders(args, cfg, rt, pm)
    t = cfg.trainer
    print_rank0(world, f"# {machine_summary(world)}",
                f"# model d_model={cfg.model.d_model} n_layers={cfg.model.n_layers}: "
                f"{logical_param_count(build_model(cfg)):,} parameters; tp={rt.world_size}, sequence parallel; "
                f"global batch {t.global_batch_size} x seq {t.seq_len}, micro-batch {t.micro_batch_size}",
                f"# {args.warmup} warm-up steps, median of {args.steps} (round-robin)")
    timings = time_interleaved([step for _, step, _, _ in runners], world, args.warmup, args.steps)
    samples = {label: tm.samples for (label, _, _, _), tm in zip(runners, timings)}
    med = {label: statistics.median(s) for label, s in samples.items()}
    table = Table([Column("contender", "{}", "<"), Column("step (ms)", "{:.1f}"), Column("vs torch-TP", "{:.3f}"),
                   Column("paired", "{:.3f}"), Column("tp MB/step", "{:.2f}"), Column("last loss", "{:.6f}")])
    for label, _, loss, wire in runners:
        table.add(label, med[label] * 1e3, med[label] / med["torch-TP"],
                  paired_ratio(samples[label], samples["torch-TP"]), wire() / 1e6, loss())
    print_rank0(world, "", f"## step time ({rt.world_size} ranks)", table.render(args.markdown))
    if args.compile:
        compiled = compile_table(samples, {label: loss() for label, _, loss, _ in runners}, args.compile_backend)
        print_rank0(world, "", f"## trainer.compile: compiled vs eager ({rt.world_size} ranks)",
                    compiled.render(args.markdown))
        for label, step, _, _ in runners:  # graphs and graph breaks per region (the trainers' start-up lines)
            regions = getattr(getattr(getattr(step, "__self__", None), "parallel", None), "compiled", None)
            if regions is not None:
                print_rank0(world, f"# {label}: {regions.report()}")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench tp", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["mpi", "torch"],
                   help="comm.backend of our contenders (default mpi,torch)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (default 3)")
    p.add_argument("--compile", action="store_true",
                   help="also time each contender of ours with trainer.compile=true against it eager")
    p.add_argument("--compile-backend", default="inductor", help="trainer.compile_backend with --compile")
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    started = start("tp", lambda n: [*DEFAULT_OVERRIDES, f"trainer.steps={args.warmup + args.steps}",
                                     f"parallel.tp={n}", *args.overrides])
    if started is None:
        return 2
    run(args, *started)
    return 0
