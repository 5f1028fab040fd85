"""The wall-clock deadline: when a run must stop so that its last save commits before the job ends.

Where the end comes from (rank 0 reads it once, at the start of ``fit``; the
earliest of those given wins, since the job ends at the first of them):

- the Slurm job's end: ``SLURM_JOB_END_TIME`` (Slurm >= 23.02), else
  ``squeue -h -o %e -j $SLURM_JOB_ID`` when squeue is installed
  (``hpctrain.train.stopping.slurm_end_time``);
- ``trainer.end_time``: a wall-clock time (``2026-12-02T15:00:00``, local
  time as squeue prints it, or Unix seconds), for schedulers or allocations
  that do not say;
- ``trainer.max_time``: seconds from the start of the run (no Slurm needed).

What the decision weighs, at every step boundary (``stop_due``, pure): the
time left against the next step (the longest of the last ``WINDOW`` loop
iterations, validation and logging included, the persistent saves' own time
left out), the save the stop will make (the longest save this run has
measured, start to commit, ``Checkpointing.save_seconds``: never assumed;
before the first save it is 0 and the margin alone covers it) and
``trainer.end_margin_s``. Only rank 0 holds the clock; the ranks agree on
its answer in the stop agreement they already make after every step (one
all-reduce, ``StopRequests.agree``), so they stop after the same step, commit a
checkpoint and exit 75, the path that requeues a Slurm job.
"""
from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Optional

WINDOW = 8
"""Loop iterations whose longest is taken as the next step's duration (steps with validation, logging
or a plugin's work are longer than the rest; the longest recent one is the safe guess)."""

_STAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2})(?::(\d{2}))?")


def parse_end_time(value: Any) -> Optional[float]:
    """``trainer.end_time`` as ``time.time()`` seconds: Unix seconds, or ``YYYY-MM-DDTHH:MM[:SS]`` in local
    time (what ``squeue -o %e`` prints). None for None/empty; ValueError for anything else."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    if re.fullmatch(r"\d+(\.\d*)?", text):
        return float(text)
    m = _STAMP.fullmatch(text)
    if not m:
        raise ValueError(value)
    year, month, day, hour, minute = (int(g) for g in m.groups()[:5])
    second = int(m.group(6) or 0)
    time.strptime(f"{year}-{month}-{day} {hour}:{minute}:{second}", "%Y-%m-%d %H:%M:%S")  # a real date
    return time.mktime((year, month, day, hour, minute, second, 0, 0, -1))


def stop_due(left_s: float, step_s: float, save_s: float, margin_s: float) -> bool:
    """Whether to stop now: going on means one more step, after which the stop's save must still commit
    with the margin to spare."""
    return left_s < step_s + save_s + margin_s


@dataclass(frozen=True)
class Decision:
    """One boundary's figures (rank 0), for the stop's log line."""

    left_s: float
    step_s: float
    save_s: float
    margin_s: float

    @property
    def stop(self) -> bool:
        return stop_due(self.left_s, self.step_s, self.save_s, self.margin_s)

    def describe(self) -> str:
        save = f"save {_seconds(self.save_s)} s (measured)" if self.save_s else "no save measured yet"
        return (f"{self.left_s:.1f} s left < next step {_seconds(self.step_s)} s + {save} + "
                f"trainer.end_margin_s {self.margin_s:g} s")


def _seconds(s: float) -> str:
    """A duration as the stop line shows it: tenths from a second up, three figures below (a small
    model's 20 ms save must not read as 0.0 s)."""
    return f"{s:.1f}" if s >= 1 else f"{s:.3g}"


class Clock:
    """Rank 0's loop timing: how long a loop iteration takes, without the persistent saves in it."""

    def __init__(self, window: int = WINDOW):
        self.iterations: Deque[float] = deque(maxlen=window)
        self._last: Optional[float] = None

    def boundary(self, now: float, saving_s: float = 0.0) -> float:
        """A step boundary at ``time.monotonic()`` ``now``; ``saving_s``: the seconds the persistent tier's
        saves blocked since the last one (counted as the save, not the step). The next step's estimate."""
        if self._last is not None:
            self.iterations.append(max(0.0, now - self._last - saving_s))
        self._last = now
        return self.step_s

    @property
    def step_s(self) -> float:
        return max(self.iterations, default=0.0)

    def decide(self, deadline: float, now: float, step_s: float, save_s: float, margin_s: float) -> Decision:
        """The figures at ``now`` (``step_s``: the trainer's own measure of the step just taken, used when
        it is longer than the loop's)."""
        return Decision(deadline - now, max(step_s, self.step_s), save_s, margin_s)
