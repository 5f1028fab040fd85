"""Helpers shared by the benchmarks: sizes, timing across ranks, tables, the machine.

Timing rule, the same for every benchmark (``time_collective``): warm-up
calls first; then for each measured iteration all ranks meet at an MPI
barrier (outside the timed region), each times one call, and the iteration
counts as the *slowest* rank's time, since a collective is done only when
its last rank is; the reported time is the median over iterations, which a
shared, noisy machine disturbs far less than the mean. The number of
iterations may be cut for large messages to fit a time budget, decided from
the warm-up on the slowest rank so every rank runs the same count.
``time_interleaved`` does the same for several contenders in rounds (one
call of each per round), so a load that drifts during the measurement
affects all of them alike: use it whenever contenders are compared.

Tables are plain text (aligned columns) or GitHub markdown, printed by rank
0 only. ``machine_summary`` describes where the numbers came from, for
docs/benchmarks.md.
"""
from __future__ import annotations

import os
import platform
import re
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hpctrain.cli import _fail
from hpctrain.config import compose_agreed
from hpctrain.config.validate import validate
from hpctrain.errors import ConfigError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def make_config(overrides: Sequence[str], pm: Any, rt: Any) -> Any:
    """The run config for ``overrides`` (a later value of a key wins, also for a
    preset choice, which Hydra refuses twice), composed on rank 0 and received by the others
    (``compose_agreed``), validated for the job's ranks. Collective."""
    last = {o.split("=", 1)[0]: o for o in overrides}
    cfg = compose_agreed(list(last.values()), pm, rt.mpi_comm)
    problems = validate(cfg, rt.world_size, pm)
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def parse_size(text: str) -> int:
    """``"4096"``, ``"1K"``, ``"256M"``, ``"1GiB"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; use e.g. 4096, 64K, 256M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def size_ladder(lo: int, hi: int, factor: int = 2) -> List[int]:
    """lo, lo*factor, ... up to hi (inclusive)."""
    if lo <= 0 or hi < lo or factor < 2:
        raise ValueError(f"need 0 < min size <= max size and factor >= 2 (got {lo}, {hi}, {factor})")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


@dataclass
class Timing:
    """Per-iteration times (seconds, slowest rank each) and their median."""

    samples: List[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def best(self) -> float:
        return min(self.samples) if self.samples else float("nan")


def metric_reader(trainer: Any, key: str) -> Callable[[], float]:
    """Reads ``trainer.metrics[key]`` (the latest step's; nan when absent) when called."""
    return lambda: trainer.metrics.get(key, float("nan"))


def loss_reader(loop: Any) -> Callable[[], Optional[float]]:
    """Reads ``loop.last_loss`` when called."""
    return lambda: loop.last_loss


def time_collective(fn: Callable[[], Any], mpi_comm: Any, warmup: int = 3, iters: int = 10,
                    budget_s: Optional[float] = None, min_iters: int = 3,
                    sync: Optional[Callable[[], Any]] = None) -> Timing:
    """Time ``fn`` (one complete operation, waited for) on every rank of ``mpi_comm``.

    ``sync`` runs after each call inside the timed region (e.g. a device
    synchronisation). With ``budget_s``, iterations are reduced so that
    iterations x (slowest warm-up call) stays within it, but never below
    ``min_iters``. Collective over ``mpi_comm``: every rank must call it.
    """
    slowest_warmup = 0.0
    for _ in range(warmup):
        slowest_warmup = max(slowest_warmup, timed_call(mpi_comm, fn, sync))
    if budget_s is not None:
        slowest_warmup = max_over_ranks(mpi_comm, slowest_warmup)
        if slowest_warmup > 0:
            iters = max(min_iters, min(iters, int(budget_s / slowest_warmup)))
    local = [timed_call(mpi_comm, fn, sync) for _ in range(iters)]
    everyone = mpi_comm.allgather(local)
    return Timing([max(per_rank[i] for per_rank in everyone) for i in range(iters)])


def time_interleaved(fns: Sequence[Callable[[], Any]], mpi_comm: Any, warmup: int = 3, iters: int = 10,
                     budget_s: Optional[float] = None, min_iters: int = 3) -> List[Timing]:
    """Like ``time_collective`` for several contenders at once, in rounds:
    each round times every ``fn`` once, so all of them see the same drift of
    a shared machine's load. The order rotates from round to round, so each
    contender follows each other one equally often: what a call leaves
    behind (caches full of its buffers, a library's threads still winding
    down) then weighs on everyone alike, not on whoever comes next.
    ``budget_s`` bounds one contender's timed calls (from its slowest
    warm-up call, max over ranks).
    """
    n = len(fns)
    slowest = [0.0] * n
    for _ in range(warmup):
        for i, fn in enumerate(fns):
            slowest[i] = max(slowest[i], timed_call(mpi_comm, fn))
    if budget_s is not None and fns:
        worst = max_over_ranks(mpi_comm, max(slowest))
        if worst > 0:
            iters = max(min_iters, min(iters, int(budget_s / worst)))
    local: List[List[float]] = [[] for _ in fns]
    for k in range(iters):
        for j in range(n):
            i = (k + j) % n
            local[i].append(timed_call(mpi_comm, fns[i]))
    everyone = mpi_comm.allgather(local)
    return [Timing([max(per_rank[i][k] for per_rank in everyone) for k in range(iters)]) for i in range(n)]


def timed_call(mpi_comm: Any, fn: Callable[[], Any], sync: Optional[Callable[[], Any]] = None) -> float:
    """All ranks meet at a barrier (untimed), then this rank's seconds for one
    ``fn()`` (and ``sync()``, e.g. a device synchronisation). Collective."""
    mpi_comm.Barrier()
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def max_over_ranks(mpi_comm: Any, value: float) -> float:
    """The largest of every rank's ``value`` (for times: the slowest rank's). Collective."""
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    return mpi_comm.allreduce(value, op=MPI.MAX)


# -- tables ------------------------------------------------------------------
@dataclass
class Column:
    title: str
    fmt: str = "{}"
    align: str = ">"  # ">" right, "<" left


class Table:
    """Rows of values rendered as aligned text or GitHub markdown."""

    def __init__(self, columns: Sequence[Column]):
        self.columns = list(columns)
        self.rows: List[List[str]] = []

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"row has {len(values)} values for {len(self.columns)} columns")
        self.rows.append([_cell(c.fmt, v) for c, v in zip(self.columns, values)])

    def _widths(self) -> List[int]:
        return [max([len(c.title)] + [len(r[i]) for r in self.rows]) for i, c in enumerate(self.columns)]

    def text(self) -> str:
        w = self._widths()

        def line(cells: Sequence[str]) -> str:
            return "  ".join(f"{s:{c.align}{wi}}" for s, c, wi in zip(cells, self.columns, w))

        out = [line([c.title for c in self.columns]), "  ".join("-" * wi for wi in w)]
        return "\n".join(out + [line(r) for r in self.rows])

    def markdown(self) -> str:
        head = "| " + " | ".join(c.title for c in self.columns) + " |"
        rule = "|" + "|".join("---:" if c.align == ">" else ":---" for c in self.columns) + "|"
        return "\n".join([head, rule] + ["| " + " | ".join(r) + " |" for r in self.rows])

    def render(self, markdown: bool = False) -> str:
        return self.markdown() if markdown else self.text()


def _cell(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:  # NaN
        return "n/a"
    return fmt.format(value)


COMPILED = " +compile"
"""Label suffix of a ``--compile`` contender: the same Trainer with ``trainer.compile=true``."""


def compile_table(samples: Dict[str, List[float]], losses: Dict[str, Optional[float]], backend: str) -> "Table":
    """``--compile`` of the dp and tp benches: each compiled contender (label ending in ``COMPILED``) against
    the same contender eager (the label without it): medians, their ratio and the median of per-round ratios
    (< 1: compiled is faster), and both last losses, which must agree closely (same model and data)."""
    table = Table([Column("contender", "{}", "<"), Column("eager (ms)", "{:.1f}"),
                   Column(f"{backend} (ms)", "{:.1f}"), Column("compiled / eager", "{:.3f}"),
                   Column("paired", "{:.3f}"), Column("eager loss", "{:.6f}"), Column("compiled loss", "{:.6f}")])
    for label in samples:
        if not label.endswith(COMPILED):
            continue
        eager = label[:-len(COMPILED)]
        a, b = samples[label], samples[eager]
        table.add(eager, statistics.median(b) * 1e3, statistics.median(a) * 1e3,
                  statistics.median(a) / statistics.median(b), paired_ratio(a, b),
                  losses[eager], losses[label])
    return table


def paired_ratio(samples: Sequence[float], base: Sequence[float]) -> float:
    """The median over rounds of ``samples[k] / base[k]``: two contenders' calls of
    the same round are adjacent in time, so this drifts less with a shared
    machine's load than the ratio of medians."""
    return statistics.median(a / b for a, b in zip(samples, base))


def refuse(mpi_comm: Any, problem: str) -> int:
    """Exit status 2 after one ``hpctrain: error:`` line from rank 0 (or the only
    process): a benchmark's bad arguments, found on every rank alike."""
    return _fail(problem, 0 if mpi_comm is None else mpi_comm.Get_rank(), 2)


def print_rank0(mpi_comm: Any, *lines: str) -> None:
    if mpi_comm is None or mpi_comm.Get_rank() == 0:
        for line in lines:
            print(line, flush=True)


# -- the machine ---------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary(mpi_comm: Any = None) -> str:
    """One line: host, CPU, cores, memory, ranks, library versions."""
    cores = os.cpu_count()
    bound = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem_s = f"{mem:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        mem_s = "? GiB"
    per_rank = f" ({bound} per rank)" if bound != cores else ""
    parts = [socket.gethostname(), _cpu_model(), f"{cores} cores{per_rank}", mem_s]
    if mpi_comm is not None:
        from mpi4py import MPI  # after bootstrap: MPI must not start at import

        parts.append(f"{mpi_comm.Get_size()} ranks")
        parts.append(MPI.Get_library_version().splitlines()[0].split(",")[0].strip())
    parts += [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return " | ".join(parts)
