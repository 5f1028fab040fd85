"""The torch profiler on chosen steps and ranks (``trainer.profile``), and the
memory snapshot an out-of-memory error leaves behind.

``trainer.profile.steps=[3,4,8]`` on ``trainer.profile.ranks=[0,1]``: each run of
consecutive steps (3-4, then 8) is one ``torch.profiler`` session on each
chosen rank, exported as a Chrome trace to
``<run dir>/profile/rank<r>.steps<a>-<b>.json`` (chrome://tracing, Perfetto,
TensorBoard's profiler); each step is a ``step <n>`` range in it, so the
steps are found by name. Profiling one run of steps at a time keeps the
steps between them free of the profiler's overhead. ``trainer.profile.memory``
adds tensor allocations (``profile_memory``) and, on CUDA, records the
allocator's history from the start, so the snapshot written on a CUDA
out-of-memory error (``oom_snapshot.rank<r>.pickle``, named in the error
line; open it at https://pytorch.org/memory_viz) says where each block came from.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch

from hpctrain.log import get_logger

log = get_logger(__name__)


def step_runs(steps: List[int]) -> List[Tuple[int, int]]:
    """Consecutive steps as (first, last) runs: [3, 4, 8] -> [(3, 4), (8, 8)]."""
    runs: List[Tuple[int, int]] = []
    for s in sorted(set(int(x) for x in steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


def trace_path(run_dir: str, rank: int, first: int, last: int) -> str:
    return os.path.join(run_dir, "profile", f"rank{rank}.steps{first}-{last}.json")


class OutOfMemoryWithSnapshot(RuntimeError):
    """A CUDA out-of-memory error, with the snapshot written for it."""

    def __init__(self, message: str, step: int = 0, detail: str = ""):
        super().__init__(message)
        self.step = step
        """The step it happened in."""
        self.detail = detail
        """The allocator's own first line (the same on every rank that ran out the same way)."""


class StepProfiler:
    def __init__(self, pcfg: Any, rank: int, device: torch.device, run_dir: Optional[str]):
        self.rank, self.device, self.run_dir = rank, device, run_dir
        self.memory = bool(pcfg.memory)
        chosen = rank in [int(r) for r in pcfg.ranks] and bool(run_dir)
        self.runs = step_runs(list(pcfg.steps)) if chosen else []
        self._prof: Optional[Any] = None
        self._run: Optional[Tuple[int, int]] = None
        self._range: Optional[Any] = None
        if self.memory and device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def before_step(self, step: int) -> None:
        if self._prof is None:
            run = next((r for r in self.runs if r[0] == step), None)
            if run is None:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, profile_memory=self.memory,
                                                record_shapes=self.memory)
            self._prof.__enter__()
            self._run = run
        self._range = torch.profiler.record_function(f"step {step}")
        self._range.__enter__()

    def after_step(self, step: int) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._run is not None and step == self._run[1]:
            self._export()

    def _export(self) -> None:
        prof, run = self._prof, self._run
        assert prof is not None and run is not None and self.run_dir
        prof.__exit__(None, None, None)
        path = trace_path(self.run_dir, self.rank, *run)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        (log.info if self.rank == 0 else log.warning)("profiler: steps %d-%d traced in %s", run[0], run[1], path)
        self._prof, self._run = None, None

    def close(self) -> None:
        """Stop a session a stop or an error interrupted, keeping what it traced."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._export()

    def out_of_memory(self, error: BaseException, step: int) -> OutOfMemoryWithSnapshot:
        """The error to raise for a CUDA out-of-memory in ``step``, after writing the allocator's snapshot."""
        where = self.run_dir or os.getcwd()
        path = os.path.join(where, f"oom_snapshot.rank{self.rank}.pickle")
        try:
            torch.cuda.memory._dump_snapshot(path)
            saved = f"memory snapshot in {path} (open it at https://pytorch.org/memory_viz"
            saved += ")" if self.memory else "; trainer.profile.memory=true adds where each block was allocated)"
        except (OSError, RuntimeError, AttributeError) as e:  # AttributeError: a torch built without CUDA
            saved = f"no memory snapshot ({e})"
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        message = (f"rank {self.rank}: CUDA out of memory in step {step}: {first}; {saved}; lower "
                   "trainer.micro_batch_size, set model.recompute=selective or full, or a higher parallel.zero.stage")
        log.error(message)
        return OutOfMemoryWithSnapshot(message, step, first)
