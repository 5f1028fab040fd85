"""What a pipeline step actually did, beside what its schedule promised.

Every rank records the start and end of each action of its program
(``Recorder``; the last step's are kept). After training the ranks of each
pipeline exchange their times (one all-gather over the pp group, fixed size:
the programs are known to every rank) and world rank 0 writes, into the run
directory:

- ``pipeline_timeline.json``: Chrome trace format (open it in Perfetto or
  chrome://tracing). Process "measured" holds one row per pipeline rank with
  every action, sends and receives included; process "theory" holds the
  schedule's compute actions as the simulator (``simulate``) plays them with
  this run's mean F, B and W times and instant messages.
- ``pipeline_timeline.png``: the same two timelines, measured above theory.

Times are wall-clock (``time.time``) anchored once per step and advanced
with ``perf_counter``; ranks on one node share that clock, ranks on
different nodes agree to their NTP offset (typically well under a
millisecond, small next to a pipeline step).

The measured bubble of a rank is its idle time over its compute time within
the step's span (first action's start to last action's end over the
pipeline), the quantity the schedules' formulas give: (p-1)/m for GPipe and
1F1B, (p-1)/(v m) for interleaved. The logged figure is the mean over ranks.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from hpctrain.mesh import Group
from hpctrain.pipeline.bubble import formula_bubble
from hpctrain.pipeline.schedules import COMPUTE, Action, actions, splits_weight_pass, stage_of
from hpctrain.pipeline.simulate import Timeline, simulate

JSON_NAME = "pipeline_timeline.json"
PNG_NAME = "pipeline_timeline.png"
COLOURS = {"F": "#4C78A8", "B": "#59A14F", "W": "#F28E2B", "SEND_F": "#BAB0AC", "RECV_F": "#BAB0AC",
           "SEND_B": "#D4CFCB", "RECV_B": "#D4CFCB"}


class Recorder:
    """Start and end of every action of a rank's last step, in program order."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.times: List[Tuple[float, float]] = []
        self._wall0 = self._perf0 = 0.0

    def begin_step(self) -> None:
        self.times = []
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    def now(self) -> float:
        return self._wall0 + (time.perf_counter() - self._perf0)

    def record(self, start: float) -> None:
        if self.enabled:
            self.times.append((start, self.now()))


@dataclass
class PipelineTimeline:
    """Every pipeline rank's actions of one step with their measured times (seconds from the step's start)."""

    schedule: str
    p: int
    v: int
    m: int
    programs: Dict[int, List[Action]]
    times: Dict[int, List[Tuple[float, float]]]

    def compute_spans(self, rank: int) -> List[Tuple[Action, float, float]]:
        return [(a, s, e) for a, (s, e) in zip(self.programs[rank], self.times[rank]) if a.kind in COMPUTE]

    @property
    def makespan(self) -> float:
        return max(e for ts in self.times.values() for _, e in ts)

    def busy(self, rank: int) -> float:
        return sum(e - s for _, s, e in self.compute_spans(rank))

    def bubble(self) -> float:
        """Mean over ranks of idle over compute time."""
        return sum((self.makespan - self.busy(r)) / self.busy(r) for r in self.programs) / self.p

    def mean_time(self, kind: str) -> float:
        """Mean duration of one ``kind`` action of one chunk, times v (a whole stage's share)."""
        d = [e - s for r in self.programs for a, s, e in self.compute_spans(r) if a.kind == kind]
        return self.v * sum(d) / len(d) if d else 0.0

    def theory(self):
        """The simulator's play of the same programs with this run's mean F, B and W times."""
        split = splits_weight_pass(self.schedule)
        t_b, t_w = self.mean_time("B"), self.mean_time("W")
        if not split:  # B carries the weight gradient too: the simulator takes t_b + t_w
            t_b, t_w = t_b * 0.5, t_b * 0.5
        return simulate(self.programs, self.p, self.v, self.mean_time("F"), t_b, t_w)

    def simulated_per_rank(self) -> Timeline:
        """The simulator's play with each virtual stage's own mean action
        times: what the schedule gives these (possibly unequal) stages and
        chunks with free messages; measured minus this is the executor's and
        the wire's share."""
        times: Dict[int, Dict[str, List[float]]] = {}
        for r in self.programs:
            for a, s, e in self.compute_spans(r):
                times.setdefault(stage_of(r, a.chunk, self.p), {}).setdefault(a.kind, []).append(e - s)
        per_stage = {st: {k: sum(x) / len(x) for k, x in d.items()} for st, d in times.items()}
        return simulate(self.programs, self.p, self.v, per_stage=per_stage)


def gather(recorder: Recorder, schedule: str, group: Group, v: int, m: int) -> PipelineTimeline:
    """All-gather the pp group's recorded times (every pp rank gets the whole timeline)."""
    p = group.size
    programs = actions(schedule, p, v, m)
    width = max(len(prog) for prog in programs.values())
    mine = torch.zeros((width, 2), dtype=torch.float64)
    if len(recorder.times) != len(programs[group.rank]):
        raise RuntimeError(f"pipeline rank {group.rank} recorded {len(recorder.times)} actions for a program of "
                           f"{len(programs[group.rank])}")
    if recorder.times:
        mine[:len(recorder.times)] = torch.tensor(recorder.times, dtype=torch.float64)
    every = torch.empty((p * width, 2), dtype=torch.float64)
    group.communicator().all_gather(every, mine)
    every = every.view(p, width, 2)
    t0 = min(float(every[r, 0, 0]) for r in range(p))
    times = {r: [(float(s) - t0, float(e) - t0) for s, e in every[r, :len(programs[r])].tolist()]
             for r in range(p)}
    return PipelineTimeline(schedule, p, v, m, programs, times)


def chrome_trace(tl: PipelineTimeline) -> Dict[str, Any]:
    """Chrome trace events (microseconds): pid 0 measured, pid 1 theory; one thread per pipeline rank."""
    events: List[Dict[str, Any]] = []
    for pid, name in ((0, "measured"), (1, f"theory ({tl.schedule}, p={tl.p}, v={tl.v}, m={tl.m})")):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for r in range(tl.p):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"pp rank {r}"}})
    for r in range(tl.p):
        for a, (s, e) in zip(tl.programs[r], tl.times[r]):
            events.append(_event(0, r, a, s, e))
    for r, spans in tl.theory().spans.items():
        for a, s, e in spans:
            events.append(_event(1, r, a, s, e))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": tl.schedule, "pp": tl.p, "vpp": tl.v, "microbatches": tl.m,
                          "measured_bubble": tl.bubble(),
                          "theory_bubble": formula_bubble(tl.schedule, tl.p, tl.v, tl.m)}}


def _event(pid: int, rank: int, a: Action, start: float, end: float) -> Dict[str, Any]:
    return {"name": str(a), "cat": a.kind, "ph": "X", "pid": pid, "tid": rank, "ts": start * 1e6,
            "dur": (end - start) * 1e6, "args": {"microbatch": a.microbatch, "chunk": a.chunk}}


def draw(tl: PipelineTimeline, path: str) -> None:
    """Measured timeline above the theoretical one, one row per pipeline rank."""
    import matplotlib  # heavy: matplotlib, only to draw
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib, only to draw
    from matplotlib.patches import Patch  # heavy: matplotlib, only to draw

    theory = tl.theory()
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.2 + 1.0 * tl.p), sharex=True)
    rows = [("measured", {r: list(zip(tl.programs[r], tl.times[r])) for r in range(tl.p)}, tl.bubble()),
            ("theory", {r: [(a, (s, e)) for a, s, e in theory.spans[r]] for r in range(tl.p)},
             formula_bubble(tl.schedule, tl.p, tl.v, tl.m))]
    for ax, (title, spans, bubble) in zip(axes, rows):
        for r, items in spans.items():
            for a, (s, e) in items:
                compute = a.kind in COMPUTE
                ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (r - 0.4, 0.8) if compute else (r - 0.15, 0.3),
                               facecolors=COLOURS[a.kind], alpha=1.0 if a.chunk == 0 else 0.6,
                               edgecolor="white", linewidth=0.5)
                if compute:
                    ax.text((s + e) * 0.5e3, r, str(a.microbatch), ha="center", va="center", fontsize=7,
                            color="white", clip_on=True)
        ax.set_yticks(range(tl.p), [f"rank {r}" for r in range(tl.p)])
        ax.invert_yaxis()
        ax.set_title(f"{title}: {tl.schedule}, p={tl.p}, v={tl.v}, m={tl.m}, bubble {bubble:.3f}", fontsize=9)
    axes[1].set_xlabel("ms from the step's start")
    axes[0].legend(handles=[Patch(color=COLOURS[k], label=k) for k in ("F", "B", "W", "SEND_F")],
                   labels=["F", "B", "W", "send/recv"], loc="lower right", bbox_to_anchor=(1.0, 1.0),
                   fontsize=7, ncol=4, frameon=False)  # above the plot, clear of the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(tl: PipelineTimeline, run_dir: str) -> Tuple[str, str]:
    """Write the Chrome trace and the picture into ``run_dir``; returns their paths."""
    os.makedirs(run_dir, exist_ok=True)
    json_path, png_path = os.path.join(run_dir, JSON_NAME), os.path.join(run_dir, PNG_NAME)
    with open(json_path, "w") as f:
        json.dump(chrome_trace(tl), f)
    draw(tl, png_path)
    return json_path, png_path


def measured_actions(trace: Dict[str, Any], rank: int) -> Sequence[str]:
    """Names of pipeline rank ``rank``'s measured actions in start order (for readers and tests)."""
    mine = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == rank]
    return [e["name"] for e in sorted(mine, key=lambda e: (e["ts"], e["ts"] + e["dur"]))]
