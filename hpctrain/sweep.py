"""The results of a Hydra sweep in one place: ``<hydra.sweep.dir>/summary.jsonl``.

Every sweep point, when its training ends (on whatever launcher ran it: the
basic one inside one ``mpiexec``, or ``hydra/launcher=slurm``, one Slurm job
per point), appends one line from its rank 0: the point's directory, its
overrides, its exit status and its last step's metrics. Lines are appended
with a single ``write`` to a file opened with ``O_APPEND``, so points that
end at the same time on a shared file system do not interleave.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

SUMMARY = "summary.jsonl"


def last_metrics(run_dir: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = [line for line in f if line.strip()]
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None


def record_sweep_point(sweep_dir: str, run_dir: str, overrides, exit_code: int) -> str:
    """Append this point's line to the sweep's summary; returns the summary's path."""
    line = {"dir": os.path.relpath(run_dir, sweep_dir), "overrides": list(overrides), "exit_code": exit_code,
            "last": last_metrics(run_dir)}
    path = os.path.join(sweep_dir, SUMMARY)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line, default=str) + "\n").encode())
    finally:
        os.close(fd)
    return path
