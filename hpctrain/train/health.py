"""Two health checks the trainer runs every few steps, each one collective
over the world so every rank reaches the same verdict.

Replica weights (``reliability.weight_check_every``). Data-parallel
replicas must hold bit-identical weights; silent data corruption (a bad
memory cell or link, a faulty GPU) makes one drift. Each rank sums the bit
patterns of every weight it shares with its data replicas into an exact
integer checksum per replica group (two int64 sums, one of them weighted by
position, so a flipped bit or two swapped elements both show; cheap on any
device), the group all-gathers them, and a rank whose checksum differs
from its group's majority is diverging. One all-reduce over the world then
tells every rank which ranks diverge, and all of them stop together with
an error naming those ranks (``ReplicasDiverged``).

Stragglers (``reliability.straggler_every``). Every rank's step time and
compute time are all-gathered. A rank's step time is the same as everyone's
(every step ends in collectives that wait for the slowest rank), so
stragglers are found by compute time: the wall time of its model forwards
per step, the median over the steps since the last check (a straggler is
slow in every step; a rank the OS deschedules is slow in one, and on a
small model that one step can be 10x the others), which for the data axes
holds no communication. (Under tensor
parallelism a forward also waits for its tp peers.) ``metrics.jsonl`` gets
the slowest rank by compute time, its compute time and the median of the
other ranks'; a rank slower than ``reliability.straggler_factor`` x the
median of the other ranks, and slower by more than a floor, in two checks
in a row is named in the log, slowest first. (The median of the others,
not of all: with 2 ranks the median of all is the mean, which no rank can
exceed by 2x.)

The floor (``reliability.straggler_min_s``; by default max(10 ms, 5% of
the median step time), taken at each check) is there because the factor
alone names noise: on a small model a forward takes a few milliseconds, and
a rank the OS deschedules for as long is 2x slower twice in a row now and
then (on an oversubscribed node: docs/benchmarks.md) while costing the job
nothing worth acting on. A rank that is a few
percent of the step slower, steadily, is what a user can act on.
"""
from __future__ import annotations

import statistics
import time as _time
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.errors import HpctrainError
from hpctrain.log import get_logger, log_rank0
from hpctrain.mesh import AXES, Mesh
from hpctrain.shard import get_spec

log = get_logger(__name__)

MIN_FLOOR_S = 0.010
"""The default straggler floor's least value: below it a difference in compute time is scheduling noise."""
STEP_FRACTION = 0.05
"""The default straggler floor as a fraction of the median step time (5%: less is not worth acting on)."""


class ReplicasDiverged(HpctrainError):
    """Replicas that must hold the same weights do not."""

    exit_code = 4
    on_every_rank = True


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as int64 values (exact to sum)."""
    t = t.detach().contiguous().view(-1)
    if t.element_size() == 4:
        return t.view(torch.int32).to(torch.int64)
    if t.element_size() == 2:
        return t.view(torch.int16).to(torch.int64)
    return t.view(torch.int64)


def checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums over the tensors' bits: plain, and weighted by position."""
    plain: Optional[torch.Tensor] = None
    weighted: Optional[torch.Tensor] = None
    for t in tensors:
        b = _bits(t)
        if b.numel() == 0:
            continue
        w = (torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521) + 1
        s1, s2 = b.sum(), (b * w).sum()
        plain = s1 if plain is None else plain + s1
        weighted = s2 if weighted is None else weighted + s2
    if plain is None or weighted is None:  # (set together)
        return torch.zeros(2, dtype=torch.int64)
    return torch.stack([plain, weighted])


def replica_groups(params: List[torch.nn.Parameter], mesh: Mesh) -> Dict[Tuple[str, ...], List[torch.nn.Parameter]]:
    """Parameters by the data axes they are replicated on (their gradient's reduction axes)."""
    out: Dict[Tuple[str, ...], List[torch.nn.Parameter]] = {}
    for p in params:
        axes = mesh.reduction_axes(get_spec(p).split_axes)
        if axes:
            out.setdefault(axes, []).append(p)
    return out


def diverging_ranks(params: List[torch.nn.Parameter], mesh: Mesh, device: torch.device) -> List[int]:
    """World ranks whose weights differ from their replicas' majority (collective)."""
    flags = torch.zeros(mesh.world_size, dtype=torch.float64, device=device)
    for axes, group_params in sorted(replica_groups(params, mesh).items()):
        group = mesh.group(axes)
        mine = checksum(sorted(group_params, key=lambda p: get_spec(p).logical_name)).to(device)
        everyone = torch.empty(group.size * 2, dtype=torch.int64, device=device)
        group.communicator().all_gather(everyone, mine)
        sums = [tuple(x) for x in everyone.view(group.size, 2).tolist()]
        if len(set(sums)) == 1:
            continue
        majority = max(set(sums), key=sums.count)
        strict = 2 * sums.count(majority) > group.size  # else (e.g. 2 replicas) nobody can tell who is right
        for i, s in enumerate(sums):
            if s != majority or not strict:
                flags[group.ranks[i]] = 1.0
    world = mesh.group(AXES)
    if world.size > 1:
        world.communicator().all_reduce(flags, ReduceOp.MAX)
    return [r for r, f in enumerate(flags.tolist()) if f > 0]


def check_replicas(params: List[torch.nn.Parameter], mesh: Mesh, device: torch.device, step: int) -> None:
    bad = diverging_ranks(params, mesh, device)
    if bad:
        raise ReplicasDiverged(
            f"step {step}: the weights of rank(s) {', '.join(map(str, bad))} differ from their data-parallel "
            "replicas' (silent data corruption or a non-deterministic update); stopping. Check those ranks' "
            "nodes (GPU memory errors, links), exclude them and resume from the last checkpoint")


def slow_ranks(compute: List[float], factor: float, floor: float) -> set:
    """The ranks whose compute time exceeds both ``factor`` x the median of
    the other ranks' and that median plus ``floor`` seconds."""
    out = set()
    for r, c in enumerate(compute):
        others = statistics.median(compute[:r] + compute[r + 1:])
        if others > 0 and c > factor * others and c - others > floor:
            out.add(r)
    return out


class Stragglers:
    """Per-rank step times, gathered every few steps (see the module docstring)."""

    def __init__(self, factor: float, min_s: Optional[float] = None):
        self.factor = factor
        self.min_s = min_s
        """The floor in seconds; None: ``floor`` derives it from the step time."""
        self.slow_before: set = set()
        self.reports: Dict[int, int] = {}
        """Reports in a row that named each rank (ranks named in the last report only)."""

    def floor(self, step_times: List[float]) -> float:
        """How much slower than the others' median a straggler must be (seconds)."""
        if self.min_s is not None:
            return float(self.min_s)
        return max(MIN_FLOOR_S, STEP_FRACTION * statistics.median(step_times))

    def check(self, mesh: Mesh, device: torch.device, step: int, step_s: float, compute_s: float) -> Dict[str, float]:
        world = mesh.group(AXES)
        mine = torch.tensor([step_s, compute_s], dtype=torch.float64, device=device)
        if world.size == 1:
            return {}
        everyone = torch.empty(world.size * 2, dtype=torch.float64, device=device)
        world.communicator().all_gather(everyone, mine)
        times = everyone.view(world.size, 2).tolist()
        compute = [t[1] for t in times]
        others = [statistics.median(compute[:r] + compute[r + 1:]) for r in range(world.size)]
        slowest = max(range(world.size), key=lambda r: compute[r])
        floor = self.floor([t[0] for t in times])
        slow = slow_ranks(compute, self.factor, floor)
        persistent = sorted(slow & self.slow_before, key=lambda r: -compute[r])  # slowest first
        if persistent:
            log_rank0("step %d: straggler rank(s) %s: compute time %s s against the other ranks' median of %.3f s "
                      "(more than reliability.straggler_factor=%.2f x and %.3f s slower (reliability.straggler_min_s), "
                      "two checks in a row)", step, ", ".join(map(str, persistent)),
                      ", ".join(f"{compute[r]:.3f}" for r in persistent), others[persistent[0]], self.factor, floor)
        self.slow_before = slow
        self.reports = {r: self.reports.get(r, 0) + 1 for r in persistent}
        return {"straggler.slowest_rank": slowest, "straggler.slowest_compute_s": compute[slowest],
                "straggler.median_compute_s": others[slowest], "straggler.max_step_s": max(t[0] for t in times),
                "straggler.min_s": floor}

    def named_at_least(self, reports: int) -> List[int]:
        """The ranks the last ``reports`` reports in a row all named (the same on every rank: the
        decision is made from gathered times)."""
        return sorted(r for r, n in self.reports.items() if n >= reports)


class ForwardClock:
    """Wall time spent in the forwards of ``modules`` since the last ``take``."""

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self._now = _time.perf_counter
        self.total = 0.0
        self._window: List[float] = []
        self._started: List[float] = []
        for m in modules:
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _start(self, module, args):
        self._started.append(self._now())

    def _stop(self, module, args, out):
        if self._started:
            self.total += self._now() - self._started.pop()

    def take(self) -> float:
        """Forward time since the last take (one step's)."""
        out, self.total = self.total, 0.0
        self._window.append(out)
        return out

    def take_window(self) -> float:
        """The median forward time per step over the steps taken since the
        last call (the straggler check's window; 0 when none was taken)."""
        out = statistics.median(self._window) if self._window else 0.0
        self._window = []
        return out
