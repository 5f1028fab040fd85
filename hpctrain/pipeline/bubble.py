"""Pipeline schedules' costs: bubble time and in-flight micro-batches (the planner, the
timeline and the benchmarks use these).

With p stages, m micro-batches, v model chunks per stage (interleaving) and
per-micro-batch stage times t_f (forward) and t_b (backward):

| schedule      | bubble time                      | micro-batches held by stage i (0 = first) |
|---------------|----------------------------------|-------------------------------------------|
| gpipe         | (p-1)(t_f + t_b)                 | m                                         |
| 1f1b          | (p-1)(t_f + t_b)                 | min(p - i, m)                             |
| interleaved   | (p-1)(t_f + t_b) / v             | (min(2(p-i-1) + (v-1)p, m v) + 1) / v     |
| zb-h1         | (p-1)(t_f + t_b - 2 t_w)         | min(p - i, m)                             |

Sources: GPipe/1F1B bubble (p-1)/m of the ideal time and the interleaved
/v (Narayanan et al. 2021). Micro-batches held are counted from the
schedule's own compute order (``schedules.compute_order``, the programs the
pipeline plugin runs): the most forwards without their backward at any
moment, a chunk counting 1/v. For the interleaved schedule that is
Megatron-LM's warm-up, 2(p-i-1) + (v-1)p forwards, plus the first steady
forward: on the first stage (p(v+1) - 1)/v = p (1 + (p-1)/(p v)), Korthikanti
et al. 2022's factor, but on the last stage ((v-1)p + 1)/v, not ~1: its
first chunk runs (v-1)p forwards before the first backward reaches it.
``peak_held`` weighs each chunk (unequal chunks, the embedding on the first
and the loss on the last). ZB-H1 (Qi et al. 2023): their (p-1)(T_F + T_B - T_W)
splits the backward into input gradients T_B and weight gradients T_W; here
t_b is the whole backward (T_B + T_W) and t_w its weight-gradient part, so
with t_f = t_b/2 = t_w the bubble is a third of 1F1B's, at the same
activation memory. Interleaving needs m to be a
multiple of p (Megatron-LM's rule, which we follow). Stages of unequal cost
(``parallel.pipeline.layers``): ``stage_bubble_time``, the slowest stage
setting the pace. GPipe is listed for
completeness; it is never better than 1F1B (same bubble, more memory).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence, Tuple

from hpctrain.pipeline.schedules import SCHEDULES, check, compute_order

__all__ = ["SCHEDULES", "NO_PIPELINE", "check_schedule", "bubble_time", "stage_bubble_time", "bubble_fraction",
           "formula_bubble", "in_flight", "peak_held"]

NO_PIPELINE = "none"
"""The planner's schedule name for a layout without pipeline parallelism."""


def check_schedule(schedule: str, pp: int, vpp: int, microbatches: int) -> str:
    """'' when the schedule can run, else the reason (``schedules.check``; pp 1 takes ``none``)."""
    if pp == 1:
        if schedule == NO_PIPELINE and vpp == 1:
            return ""
        return "without pipeline parallelism the schedule is 'none' and vpp=1"
    return check(schedule, pp, vpp, microbatches)


def bubble_time(schedule: str, pp: int, vpp: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time per step on the critical path, in the units of t_f/t_b/t_w (equal stages)."""
    return stage_bubble_time(schedule, vpp, [t_f] * pp, [t_b] * pp, [t_w] * pp)


def stage_bubble_time(schedule: str, vpp: int, t_f: Sequence[float], t_b: Sequence[float],
                      t_w: Sequence[float]) -> float:
    """Idle time per step with stages of unequal cost: ``t_f[r]``, ``t_b[r]``,
    ``t_w[r]`` are pipeline rank r's times per micro-batch (its chunks summed).

    The slowest rank k (largest t_f + t_b) sets the pace, m (t_f[k] + t_b[k]),
    and each other rank adds its own share of the equal-stage bubble:
    sum over r != k of (t_f[r] + t_b[r]) for GPipe and 1F1B, the same over v
    interleaved, of (t_f[r] + t_b[r] - 2 t_w[r]) for ZB-H1. With equal stages
    these are the formulas of the module docstring. Against the simulator
    (``simulate``) with ``split.auto_counts`` stages (tests/unit/pipeline) the
    step is over-estimated by at most a few percent (e.g. 1% for 126 blocks
    on 16 ranks, 32 micro-batches, interleaved v2)."""
    pp = len(t_f)
    if pp <= 1 or schedule == NO_PIPELINE:
        return 0.0
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    total = [f + b for f, b in zip(t_f, t_b)]
    k = max(range(pp), key=lambda r: total[r])
    if schedule == "zb-h1":  # T_F + T_B - T_W with T_B = t_b - t_w
        share = [t - 2 * w for t, w in zip(total, t_w)]
        return sum(share) - share[k]
    idle = sum(total) - total[k]
    return idle / vpp if schedule == "interleaved" else idle


def bubble_fraction(schedule: str, pp: int, vpp: int, microbatches: int, t_f: float = 1.0,
                    t_b: float = 2.0, t_w: float = 1.0) -> float:
    """Bubble as a share of the pipeline's wall time (e.g. (p-1)/(m+p-1) for 1F1B)."""
    bubble = bubble_time(schedule, pp, vpp, t_f, t_b, t_w)
    busy = microbatches * (t_f + t_b)
    return bubble / (busy + bubble) if busy + bubble > 0 else 0.0


def in_flight(schedule: str, pp: int, vpp: int, microbatches: int, stage: int) -> float:
    """How many micro-batches' activations stage ``stage`` holds at its peak
    (in units of one micro-batch through all of that stage's layers): ``peak_held``
    with v equal chunks."""
    if pp == 1 or schedule == NO_PIPELINE:
        return 1.0  # gradient accumulation: one micro-batch at a time
    return peak_held(schedule, pp, vpp, microbatches, stage, (1.0 / vpp,) * vpp)


def peak_held(schedule: str, pp: int, vpp: int, microbatches: int, stage: int,
              chunk_weights: Sequence[float]) -> float:
    """The most that pipeline rank ``stage`` holds at once, each forward whose backward has not
    run yet holding ``chunk_weights[chunk]`` (e.g. one micro-batch's saved bytes of that chunk),
    along the schedule's compute order (``schedules.compute_order``). A W action (zero bubble)
    frees nothing here: its backward's B already released the activations it does not need."""
    if pp == 1 or schedule == NO_PIPELINE:
        return max(chunk_weights)
    return _peak(schedule, pp, vpp, microbatches, stage, tuple(float(w) for w in chunk_weights))


@lru_cache(maxsize=4096)
def _peak(schedule: str, pp: int, vpp: int, m: int, stage: int, weights: Tuple[float, ...]) -> float:
    live = peak = 0.0
    for kind, _, chunk in compute_order(schedule, pp, vpp, m, stage):
        if kind == "F":
            live += weights[chunk]
            peak = max(peak, live)
        elif kind == "B":
            live -= weights[chunk]
    return peak


def formula_bubble(schedule: str, p: int, v: int, m: int) -> float:
    """The published bubble fraction as idle over compute time, with equal
    forward, input-gradient and weight-gradient times: (p-1)/m for GPipe and
    1F1B, (p-1)/(v m) interleaved, (p-1)/(3 m) for ZB-H1."""
    t_f, t_b, t_w = 1.0, 2.0, 1.0
    return bubble_time(schedule, p, v, t_f, t_b, t_w) / (m * (t_f + t_b))
