"""Collective bandwidth per backend and op (nccl-tests style), against raw mpi4py and raw torch gloo.

Run under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench comm --max-size 16M``.

Measured in the same run, op by op and size by size. The implementations
of one size are timed in families, each raw peer with the backends compared
to it (raw mpi4py with mpi and hier; raw gloo with torch), interleaved call
by call in rotating order (``common.time_interleaved``), so a backend and
its peer see the same machine conditions. Families are timed apart because
a gloo call slows the MPI call that follows it (it leaves the caches full of
its own buffers), so interleaving gloo with MPI would time that, not the
backends (docs/benchmarks.md, "How they measure"). The implementations:
- ``raw-mpi4py``: ``MPI.COMM_WORLD`` on zero-copy numpy views of the tensors
  (``Allreduce(IN_PLACE)``, ``Allgather``, ``Reduce_scatter_block``,
  ``Alltoall``, ``Bcast``): what an MPI program gets without hpctrain;
- ``raw-gloo``: ``torch.distributed`` on its default gloo group
  (``all_reduce``, ``all_gather_single``/``all_gather_into_tensor``,
  ``reduce_scatter_single``/``reduce_scatter_tensor``, ``all_to_all_single``,
  ``broadcast``);
- every hpctrain backend a plugin serves that can run here (reached through
  ``hpctrain.run.build_mesh``, so exactly what training uses), blocking calls
  of the Communicator protocol on the world group.

Columns follow nccl-tests: ``size`` is the total bytes of the op (all-gather:
the gathered output; reduce-scatter: the input; all-to-all: one rank's send
buffer), algbw = size / time, busbw = algbw x 2(n-1)/n for all-reduce,
x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for broadcast.
``vs raw`` is our busbw over the raw peer's at the same size (ratio of
median times): raw-gloo for a gloo-based backend, raw-mpi4py for every
other one. ``paired`` is the median over rounds of the peer's time over ours
in the same round: the two calls are adjacent in time, so it drifts less
with a shared machine's load. Reductions are sums of float32 zeros (no
overflow, no denormals). Timing: see ``hpctrain.bench.common``.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hpctrain.bench.common import (
    Column,
    Table,
    format_size,
    machine_summary,
    paired_ratio,
    parse_size,
    print_rank0,
    refuse,
    size_ladder,
    time_interleaved,
)
from hpctrain.bootstrap import init_torch_distributed, with_device
from hpctrain.comm.counting import unwrap
from hpctrain.config.store import to_config
from hpctrain.config.validate import validate
from hpctrain.errors import ArgumentParser
from hpctrain.plugins import capabilities, get_manager
from hpctrain.run import build_mesh

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


@dataclass
class Buffers:
    """Tensors of one (op, size): ``out`` is also the in-place buffer."""

    out: torch.Tensor
    inp: Optional[torch.Tensor]
    nbytes: int


def make_buffers(op: str, size: int, n: int, dtype: torch.dtype) -> Buffers:
    """Buffers for ``size`` total bytes, rounded down to whole per-rank chunks."""
    item = torch.empty((), dtype=dtype).element_size()
    count = max(n, (size // item) // n * n)

    def z(k: int) -> torch.Tensor:
        return torch.zeros(k, dtype=dtype)

    if op in ("all_reduce", "broadcast"):
        return Buffers(z(count), None, count * item)
    if op == "all_gather":
        return Buffers(z(count), z(count // n), count * item)
    if op == "reduce_scatter":
        return Buffers(z(count // n), z(count), count * item)
    if op == "all_to_all":
        return Buffers(z(count), z(count), count * item)
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


# -- the implementations: each returns a zero-argument call, or None (unsupported) --
def raw_mpi_call(op: str, b: Buffers, mpi_comm) -> Optional[Callable[[], Any]]:
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    if b.out.dtype != torch.float32:
        return None  # MPI has no 16-bit float type
    out = b.out.numpy()
    inp = b.inp.numpy() if b.inp is not None else None
    calls = {
        "all_reduce": lambda: mpi_comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM),
        "all_gather": lambda: mpi_comm.Allgather(inp, out),
        "reduce_scatter": lambda: mpi_comm.Reduce_scatter_block(inp, out, op=MPI.SUM),
        "all_to_all": lambda: mpi_comm.Alltoall(inp, out),
        "broadcast": lambda: mpi_comm.Bcast(out, root=0),
    }
    return calls[op]


def raw_gloo_call(op: str, b: Buffers) -> Optional[Callable[[], Any]]:
    # newer torch renamed the flat-tensor forms (the old names warn); same collectives
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {
        "all_reduce": lambda: dist.all_reduce(b.out),
        "all_gather": lambda: gather(b.out, b.inp),
        "reduce_scatter": lambda: scatter(b.out, b.inp),
        "all_to_all": lambda: dist.all_to_all_single(b.out, b.inp),
        "broadcast": lambda: dist.broadcast(b.out, src=0),
    }
    return calls[op]


def ours_call(op: str, b: Buffers, comm) -> Optional[Callable[[], Any]]:
    calls = {
        "all_reduce": lambda: comm.all_reduce(b.out),
        "all_gather": lambda: comm.all_gather(b.out, b.inp),
        "reduce_scatter": lambda: comm.reduce_scatter(b.out, b.inp),
        "all_to_all": lambda: comm.all_to_all(b.out, b.inp),
        "broadcast": lambda: comm.broadcast(b.out, src=0),
    }
    return calls[op]


def peer_of(comm) -> str:
    return "raw-gloo" if getattr(comm, "backend", "") == "gloo" else "raw-mpi4py"


# -- backends ------------------------------------------------------------------
def make_backends(names: Optional[List[str]], rt, pm) -> Tuple[Dict[str, Any], List[str]]:
    """{name: world-group communicator} for the backends that can run here,
    and notes on the ones skipped. Collective: same calls on every rank."""
    served = capabilities(pm).get("comm.backend", [])
    wanted = names or served
    made: Dict[str, Any] = {}
    seen: Dict[Tuple[str, str], str] = {}
    notes: List[str] = []
    for name in wanted:
        # a run config that is valid for any world size, so only the backend can be at fault
        trainer = {"device": rt.device.type, "global_batch_size": rt.world_size, "micro_batch_size": 1}
        cfg = to_config({"comm": {"backend": name}, "trainer": trainer}, pm)
        problems = validate(cfg, rt.world_size, pm)
        if problems:
            notes.append(f"{name}: skipped ({problems[0]})")
            continue
        error = None
        try:
            comm = build_mesh(cfg, rt, pm).group("dp").communicator()
        except Exception as e:  # noqa: BLE001 - a plugin that cannot run here: report, do not abort the table
            comm, error = None, f"{type(e).__name__}: {e}"
        failures = [f for f in rt.mpi_comm.allgather(error) if f]
        if failures:
            notes.append(f"{name}: skipped ({failures[0]})")
            continue
        key = (type(unwrap(comm)).__name__, str(getattr(comm, "backend", name)))
        if key in seen:  # e.g. "gloo" is the same communicator as "torch" on CPU
            notes.append(f"{name}: same communicator as {seen[key]}, not repeated")
            continue
        seen[key] = name
        made[name] = comm
    return made, notes


def _label(name: str, comm) -> str:
    inner = getattr(comm, "backend", name)
    return name if inner == name else f"{name}({inner})"


def _time_by_family(impls: List[Tuple[str, Optional[Callable[[], Any]], Optional[str]]], world,
                    args) -> Dict[str, Any]:
    """{label: Timing}: each raw peer interleaved with the backends measured
    against it, family by family (see the module docstring)."""
    families: Dict[str, List[Tuple[str, Callable[[], Any]]]] = {}
    for label, call, peer in impls:
        if call is not None:
            families.setdefault(peer or label, []).append((label, call))
    out: Dict[str, Any] = {}
    for family in families.values():
        found = time_interleaved([call for _, call in family], world, args.warmup, args.iters, args.budget)
        out.update({label: timing for (label, _), timing in zip(family, found)})
    return out


def run(args, rt, pm) -> Dict[str, Table]:
    world, n = rt.mpi_comm, rt.world_size
    backends, notes = make_backends(args.backends, rt, pm)
    init_torch_distributed("gloo")
    dtype = getattr(torch, args.dtype)
    sizes = size_ladder(args.min_size, args.max_size, args.factor)
    print_rank0(world, f"# {machine_summary(world)}", f"# dtype {args.dtype}; warmup {args.warmup}, "
                f"median of up to {args.iters} iterations (budget {args.budget:g} s per cell)",
                *[f"# {note}" for note in notes])
    tables: Dict[str, Table] = {}
    ratios: Dict[Tuple[str, str], List[Tuple[int, float, float]]] = {}  # (op, impl) -> [(bytes, ratio, paired)]
    for op in args.ops:
        table = Table([Column("size", "{}"), Column("impl", "{}", "<"), Column("time (us)", "{:.1f}"),
                       Column("algbw (GB/s)", "{:.3f}"), Column("busbw (GB/s)", "{:.3f}"),
                       Column("vs raw", "{:.2f}"), Column("paired", "{:.2f}")])
        for size in sizes:
            b = make_buffers(op, size, n, dtype)
            impls: List[Tuple[str, Optional[Callable[[], Any]], Optional[str]]] = [
                ("raw-mpi4py", raw_mpi_call(op, b, world), None),
                ("raw-gloo", raw_gloo_call(op, b) if dist.is_initialized() else None, None),
            ]
            impls += [(_label(name, c), ours_call(op, b, c), peer_of(c)) for name, c in backends.items()]
            timings = _time_by_family(impls, world, args)
            busbw: Dict[str, float] = {}
            for label, call, peer in impls:
                if call is None:
                    table.add(format_size(b.nbytes), label, float("nan"), float("nan"), float("nan"), None)
                    continue
                t = timings[label].median
                alg = b.nbytes / t / 1e9
                busbw[label] = alg * bus_factor(op, n)
                ratio = paired = None
                if peer in busbw:
                    ratio = busbw[label] / busbw[peer]
                    # per round: the peer's time over ours, the two calls adjacent in time
                    paired = paired_ratio(timings[peer].samples, timings[label].samples)
                    ratios.setdefault((op, label), []).append((b.nbytes, ratio, paired))
                table.add(format_size(b.nbytes), label, t * 1e6, alg, busbw[label], ratio, paired)
            del b
        tables[op] = table
        print_rank0(world, "", f"## {op} ({n} ranks)", table.render(args.markdown))
    print_rank0(world, "", f"## busbw vs the raw peer, messages >= {format_size(args.summary_from)}")
    for (op, label), found in ratios.items():
        big = [(r, p) for nbytes, r, p in found if nbytes >= args.summary_from]
        if big:
            plain, per_round = [r for r, _ in big], [p for _, p in big]
            print_rank0(world, f"{op:<15} {label:<12} min {min(plain):.2f}  median {statistics.median(plain):.2f}  "
                               f"paired min {min(per_round):.2f}  median {statistics.median(per_round):.2f}  "
                               f"({len(big)} sizes)")
    return tables


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench comm", description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS), help=f"comma list of {','.join(OPS)}")
    p.add_argument("--backends", type=lambda s: s.split(","), default=None,
                   help="comma list of hpctrain backends (default: every one a plugin serves that can run here)")
    p.add_argument("--min-size", type=parse_size, default=parse_size("1K"), help="smallest message (default 1K)")
    p.add_argument("--max-size", type=parse_size, default=parse_size("256M"), help="largest message (default 256M)")
    p.add_argument("--factor", type=int, default=2, help="size step factor (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per cell (default 3)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per cell, at most (default 20)")
    p.add_argument("--budget", type=float, default=2.0,
                   help="seconds of timed calls per implementation and size before cutting iterations (>= 3 kept)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--summary-from", type=parse_size, default=parse_size("1M"),
                   help="smallest message counted in the closing ratio summary (default 1M)")
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    bad = [op for op in args.ops if op not in OPS]
    if bad:
        _parser().error(f"unknown op(s) {', '.join(bad)}; choose from {', '.join(OPS)}")
    rt = with_device("cpu")
    if rt.world_size < 2:
        return refuse(None, "hpctrain-bench comm needs at least 2 ranks; run it as mpiexec -n 2 hpctrain-bench comm")
    run(args, rt, get_manager())
    return 0
