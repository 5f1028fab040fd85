"""Run schedules' programs on paper: dependencies, deadlock, bubble, memory.

``simulate(programs, p, v, t_f, t_b, t_w)`` plays every rank's program with
fixed times per action (a chunk's share of a stage: t / v; B takes
t_b + t_w unless the schedule has W actions, then t_b, and W t_w;
messages arrive at once) and waits exactly where the executor waits: a
forward for its input, a backward for its output gradient and its own
forward, a weight pass for its backward. It raises ``ScheduleError`` when
the programs are malformed (a send without its receive, an action missing
or twice) or deadlock (no rank can take its next action).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from hpctrain.pipeline.schedules import Action, stage_of


class ScheduleError(RuntimeError):
    pass


@dataclass
class Timeline:
    makespan: float
    busy: Dict[int, float]
    """Compute time per rank."""
    spans: Dict[int, List[Tuple[Action, float, float]]]
    """Per rank: (compute action, start, end)."""
    peak_held: Dict[int, int]
    """Per rank: the most (micro-batch, chunk) activations held at once (forward done, last backward pass not)."""

    def bubble(self, rank: int) -> float:
        """Idle time over compute time (the (p-1)/m of 1F1B)."""
        return (self.makespan - self.busy[rank]) / self.busy[rank]


def check_programs(programs: Dict[int, List[Action]], p: int, v: int, m: int, forward_only: bool = False) -> None:
    """Every (micro-batch, chunk) has one F and one B (and at most one W) per
    rank, or one F alone when ``forward_only``, and every send has a matching
    receive on its peer."""
    split = any(a.kind == "W" for prog in programs.values() for a in prog)
    kinds = ("F",) if forward_only else ("F", "B", "W") if split else ("F", "B")
    for rank, prog in programs.items():
        count = Counter((a.kind, a.microbatch, a.chunk) for a in prog if a.kind in ("F", "B", "W"))
        want = {(k, mb, c) for k in kinds for mb in range(m) for c in range(v)}
        if set(count) != want or any(n != 1 for n in count.values()):
            raise ScheduleError(f"rank {rank}: compute actions are not one {'/'.join(kinds)} per "
                                f"micro-batch and chunk")
    sends = Counter((r, a.peer, a.kind[5:], a.microbatch, stage_of(r, a.chunk, p))
                    for r, prog in programs.items() for a in prog if a.kind.startswith("SEND"))
    recvs: Counter[Tuple[int, int, str, int, int]] = Counter()
    for r, prog in programs.items():
        for a in prog:
            if a.kind.startswith("RECV"):
                s = stage_of(r, a.chunk, p)
                src_stage = s - 1 if a.kind == "RECV_F" else s + 1
                recvs[(a.peer, r, a.kind[5:], a.microbatch, src_stage)] += 1
    if sends != recvs:
        raise ScheduleError(f"sends and receives do not pair up: {sorted((sends - recvs) + (recvs - sends))[:4]}")


def simulate(programs: Dict[int, List[Action]], p: int, v: int, t_f: float = 1.0, t_b: float = 1.0,
             t_w: float = 1.0, per_rank: Optional[Dict[int, Dict[str, float]]] = None,
             per_stage: Optional[Dict[int, Dict[str, float]]] = None) -> Timeline:
    """``per_rank[r]`` (optional) overrides the duration of one F, B or W
    action on rank r (already a chunk's share), e.g. measured ones: stages
    of unequal cost. ``per_stage[s]`` (optional) does the same for virtual
    stage s (``stage_of(rank, chunk, p)``), over ``per_rank``: uneven
    chunks, e.g. ``parallel.pipeline.layers=[7,8,...,8,7]``."""
    split = any(a.kind == "W" for prog in programs.values() for a in prog)
    uniform = {"F": t_f / v, "B": (t_b if split else t_b + t_w) / v, "W": t_w / v}
    costs = {(r, c): {**uniform, **(per_rank or {}).get(r, {}), **(per_stage or {}).get(stage_of(r, c, p), {})}
             for r in programs for c in range(v)}
    last = p * v - 1
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> finish time
    compute = {r: [a for a in prog if a.kind in uniform] for r, prog in programs.items()}
    pos = {r: 0 for r in programs}
    free = {r: 0.0 for r in programs}
    spans: Dict[int, List[Tuple[Action, float, float]]] = {r: [] for r in programs}
    held = {r: 0 for r in programs}
    peak = {r: 0 for r in programs}
    remaining = sum(len(c) for c in compute.values())
    while remaining:
        progressed = False
        for r in programs:
            while pos[r] < len(compute[r]):
                a = compute[r][pos[r]]
                s = stage_of(r, a.chunk, p)
                needs = []
                if a.kind == "F" and s > 0:
                    needs.append(("F", a.microbatch, s - 1))
                if a.kind == "B":
                    needs.append(("F", a.microbatch, s))
                    if s < last:
                        needs.append(("B", a.microbatch, s + 1))
                if a.kind == "W":
                    needs.append(("B", a.microbatch, s))
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                end = start + costs[(r, a.chunk)][a.kind]
                done[(a.kind, a.microbatch, s)] = end
                spans[r].append((a, start, end))
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
                releases = "W" if split else "B"
                held[r] += 1 if a.kind == "F" else -1 if a.kind == releases else 0
                peak[r] = max(peak[r], held[r])
        if not progressed:
            stuck = {r: str(compute[r][pos[r]]) for r in programs if pos[r] < len(compute[r])}
            raise ScheduleError(f"deadlock: every rank waits ({stuck})")
    busy = {r: sum(e - s for _, s, e in spans[r]) for r in programs}
    return Timeline(max(free.values()), busy, spans, peak)
