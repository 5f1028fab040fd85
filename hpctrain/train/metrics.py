"""Metrics: ``metrics.jsonl`` in the run directory and rank 0's progress display.

One JSON object per step (step, loss, grad_norm, lr, tokens_per_s (global),
tokens_per_s_per_device, model_tflops_per_device, mfu, step_time_s,
consumed_samples, data_wait_s, peak memory), each written whole and
flushed to the file at once (one ``write`` per step: a reader, such as
``hpctrain-report`` on a running run, never waits for a buffer to fill, and a
killed run loses at most the line being written, which the report skips).
Only rank 0 writes; ``hpctrain.train.loggers`` sends
the same numbers to the other backends. The progress bar (rich) draws on stderr when a
terminal is attached, including an interactive ``mpirun``
(``trainer.progress=auto``), or when forced (``on``); a
log line every ``log_every`` steps is printed either way, so batch logs show
the loss falling too.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Dict, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from hpctrain.log import log_rank0


class MetricsWriter:
    def __init__(self, path: Optional[str]):
        self.path = path
        self._file = open(path, "a", buffering=1 << 16) if path else None

    def write(self, record: Dict[str, float]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._file.flush()  # the whole line reaches the file now (a buffer would cut lines at 64 KiB)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def json_safe(record: Dict[str, float]) -> Dict[str, object]:
    """NaN and infinities as null: JSON has no such numbers (json.dumps would
    write bare NaN, which JSON readers reject)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def format_step(step: int, total: int, m: Dict[str, float]) -> str:
    """The step's log line: loss, gradient norm, learning rate, throughput per
    device and global, model TFLOP/s per device and MFU (with a
    ``cluster.peak_tflops``), the peak memory over the ranks and the rank
    holding it (when gathered), the data wait, and validation loss when present."""
    parts = [f"step {step:>{len(str(total))}}/{total}", f"loss {m['loss']:.4f}", f"grad_norm {m['grad_norm']:.3f}",
             f"lr {m['lr']:.2e}"]
    if "tokens_per_s_per_device" in m:
        parts.append(f"{m['tokens_per_s_per_device']:,.0f} tok/s/device ({m['tokens_per_s']:,.0f} tok/s global)")
    else:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s global")
    if "model_tflops_per_device" in m:
        flops = f"{m['model_tflops_per_device']:.3g} TFLOP/s/device"
        parts.append(flops + (f", MFU {100 * m['mfu']:.1f}%" if "mfu" in m else ""))
    for name, label in (("cuda_max_allocated_bytes", "peak allocated"), ("cuda_max_reserved_bytes", "peak reserved"),
                        ("peak_rss_bytes", "peak RSS")):
        if f"{name}.max" in m:
            parts.append(f"{label} {_mib(m[name + '.min'])}..{_mib(m[name + '.max'])} "
                         f"(max on rank {int(m[name + '.max_rank'])})")
            break
    if "data_wait_s" in m:
        parts.append(f"data wait {1000 * m['data_wait_s']:.1f} ms")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
    return " | ".join(parts)


LAUNCHERS = ("mpiexec", "mpirun", "orterun", "prterun", "prte", "srun")
"""Process names (prefixes) of the launchers whose output the progress bar follows."""


def launcher_stderr_is_terminal() -> Optional[bool]:
    """Whether the launcher above this rank (mpiexec, srun: a parent within
    four generations) writes its stderr to a terminal; None when there is no
    such parent or /proc cannot tell. A launcher redirected to a file (``mpiexec
    ... > log 2>&1``) still gives its ranks pipes or pseudo-terminals, so the
    rank's own stderr cannot tell."""
    pid = os.getppid()
    for _ in range(4):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name.startswith(LAUNCHERS):
                return os.readlink(f"/proc/{pid}/fd/2").startswith(("/dev/pts/", "/dev/tty"))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state: the parent
        except (OSError, ValueError, IndexError):
            return None
    return None


def interactive_launch() -> bool:
    """Is a person watching? stderr is a terminal; or the launcher above this
    rank writes to one; or, where that cannot be seen, an mpirun with TERM
    set (Open MPI forwards rank output through pipes). Never in CI or a batch job."""
    if sys.stderr.isatty():
        return True
    env = os.environ
    if "CI" in env or ("SLURM_JOB_ID" in env and "SLURM_PTY_PORT" not in env):
        return False
    launcher = launcher_stderr_is_terminal()
    if launcher is not None:
        return launcher
    under_mpirun = "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env
    return under_mpirun and env.get("TERM", "dumb") not in ("", "dumb")


class Progress:
    """Rank 0's progress bar; a no-op elsewhere or when disabled."""

    def __init__(self, enabled: bool, total: int, mode: str = "auto"):
        self._bar = None
        if not enabled or mode == "off" or (mode == "auto" and not interactive_launch()):
            return

        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(), console=Console(file=sys.stderr, force_terminal=True),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total, info="")
        self._bar.start()

    def update(self, step: int, m: Dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=f"loss {m['loss']:.4f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def log_step(step: int, total: int, m: Dict[str, float]) -> None:
    log_rank0(format_step(step, total, m))


def run_dir_file(run_dir: Optional[str], name: str) -> Optional[str]:
    return os.path.join(run_dir, name) if run_dir else None
