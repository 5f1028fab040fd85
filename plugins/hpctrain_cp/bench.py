"""Context parallelism: attention fwd + bwd at cp = world vs one process; each rank's share of the work.

The one process attends over the whole sequence; the shares compare the
zigzag layout with a contiguous one.

Run under the launcher, e.g. ``mpiexec -n 2 --bind-to core hpctrain-bench
cp`` (cp = the world size). One attention layer's core (the part context
parallelism changes): batch 1, ``--heads`` query heads over ``--kv-heads``
key/value heads of ``--head-dim``, a causal sequence of ``--seq`` tokens.

1. Speed-up. Forward + backward of the core at cp = world, each rank on its
   tokens (``ring`` with the zigzag layout the trainer uses, ``ring`` with
   a plain contiguous split, and ``allgather``), against torch's causal
   sdpa on the whole sequence in one process (rank 0 alone, the others
   idle). Each call counts at its slowest rank; medians. The ideal
   speed-up is cp. (torch's own ``context_parallel`` does not run on CPU in
   torch 2.13, so the one-process run is the reference.) The outputs are
   checked against the one-process rows first.
2. Balance. Each rank's CPU seconds inside ring attention's arithmetic
   (``ring.ComputeTime``: thread time, so waits and core sharing do not
   count) per call, for the zigzag and the contiguous layout: max / min
   over ranks. Zigzag gives every rank the same causal work; a contiguous
   split gives the last rank (4cp - 1) / 3 times the first's.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any, List, Optional

import torch

from hpctrain.bench.common import Column, Table, machine_summary, print_rank0, refuse, time_collective
from hpctrain.bootstrap import with_device
from hpctrain.config.store import to_config
from hpctrain.data.sequence import SequenceLayout as Layout
from hpctrain.errors import ArgumentParser
from hpctrain.model.attention import SdpaAttention
from hpctrain.plugins import get_manager
from hpctrain.run import build_mesh

from hpctrain_cp.allgather import AllGatherAttention
from hpctrain_cp.ring import ComputeTime, RingAttention


def _inputs(args: Any, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (1, h, args.seq, args.head_dim)  # noqa: E731
    return (torch.randn(shape(args.heads), generator=g), torch.randn(shape(args.kv_heads), generator=g),
            torch.randn(shape(args.kv_heads), generator=g), torch.randn(shape(args.heads), generator=g))


def _fwd_bwd(core: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = core(q, k, v)
    out.backward(dout)
    return out.detach()


def _one_process(args: Any, world: Any, full) -> float:
    """Median seconds of sdpa forward + backward on the whole sequence (timed on rank 0, given to every rank)."""
    out = None
    if world.Get_rank() == 0:
        core = SdpaAttention()
        for _ in range(args.warmup):
            _fwd_bwd(core, *full)
        runs = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            _fwd_bwd(core, *full)
            runs.append(time.perf_counter() - t0)
        out = statistics.median(runs)
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)
    return world.bcast(out, root=0)


def run(args: Any, rt: Any, pm: Any) -> None:
    world, n = rt.mpi_comm, rt.world_size
    cfg = to_config({"comm": {"backend": args.backend}, "parallel": {"cp": n},
                     "trainer": {"seq_len": args.seq, "global_batch_size": 1, "micro_batch_size": 1}}, pm)
    group = build_mesh(cfg, rt, pm).group("cp")
    chunk = args.seq // (2 * n)
    full = _inputs(args)
    want = SdpaAttention()(*full[:3])
    print_rank0(world, f"# {machine_summary(world)}",
                f"# attention core: batch 1, {args.heads} query / {args.kv_heads} key-value heads of {args.head_dim}, "
                f"causal sequence {args.seq}; cp={n} [{args.backend}]",
                f"# {args.warmup} warm-up calls, median of {args.iters}")
    one = _one_process(args, world, full)
    speed = Table([Column("attention", "{}", "<"), Column("tokens per rank", "{}"), Column("fwd+bwd (ms)", "{:.1f}"),
                   Column("speed-up", "{:.2f}"), Column("ideal", "{}")])
    speed.add("one process (sdpa)", args.seq, one * 1e3, 1.0, 1)
    balance = Table([Column("ring layout", "{}", "<")]
                    + [Column(f"rank {r} (ms)", "{:.1f}") for r in range(n)] + [Column("max / min", "{:.2f}")])
    for label, layout in (("ring, zigzag", Layout.zigzag(n)), ("ring, contiguous", Layout.contiguous(n)),
                          ("allgather, zigzag", Layout.zigzag(n))):
        rows = layout.positions(group.rank, chunk)
        mine = [t[:, :, rows].contiguous() for t in full]
        clock = ComputeTime()
        core = RingAttention(group, layout, clock) if label.startswith("ring") else AllGatherAttention(group, layout)
        got = _fwd_bwd(core, *mine)
        torch.testing.assert_close(got, want[:, :, rows], rtol=1e-4, atol=1e-5)  # same attention as one process
        clock.forward = clock.backward = 0.0
        timing = time_collective(functools.partial(_fwd_bwd, core, *mine), world, args.warmup, args.iters)
        speed.add(f"{label}, cp={n}", len(rows), timing.median * 1e3, one / timing.median, n)
        if label.startswith("ring"):
            per_call = (clock.forward + clock.backward) / (args.warmup + args.iters)
            shares = world.allgather(per_call)
            balance.add(label.split(", ")[1], *[s * 1e3 for s in shares], max(shares) / min(shares))
    print_rank0(world, "", "## forward + backward against one process", speed.render(args.markdown),
                "", "## each rank's compute time per call (thread CPU time in ring attention)",
                balance.render(args.markdown))


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench cp", description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096, help="whole sequence length (default 4096)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--backend", default="mpi", help="comm.backend of the cp group (default mpi)")
    p.add_argument("--iters", type=int, default=5, help="timed calls (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rt = with_device("cpu")
    if rt.world_size < 2:
        return refuse(None, "hpctrain-bench cp needs at least 2 ranks; run it as mpiexec -n 2 hpctrain-bench cp")
    if args.seq % (2 * rt.world_size):
        return refuse(rt.mpi_comm, f"hpctrain-bench cp: --seq {args.seq} must be divisible by 2 x cp = "
                                   f"{2 * rt.world_size}; pick a multiple of it")
    torch.set_num_threads(1)  # one core per rank: thread CPU time is the rank's work
    run(args, rt, get_manager())
    return 0
