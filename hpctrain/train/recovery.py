"""What a failure cost: ``last_failure.json`` when one is detected, and the
``recovery.*`` metrics of the first step after the restart.

The hang watchdog's verdict (a dead, stuck or silent rank) writes
``<run dir>/last_failure.json`` before the job is aborted: the time, the
message, the ranks and hosts to blame (what ``slurm/train.sbatch`` excludes)
and the last step every rank had finished. The next launch into the same run
directory reads it; its first step's metrics get

- ``recovery.time_s``: from the failure to the end of that step (detection,
  abort, relaunch, set-up, resume and the step);
- ``recovery.steps_recomputed``: steps finished before the failure that are
  computed again (the failure's last finished step minus the resumed step);
- ``recovery.resumed_step`` and ``recovery.tier`` (``local``,
  ``persistent`` or ``none``; a string, as metrics.jsonl keeps it),

the job log a line saying the same, and the file is renamed
``last_failure.recovered.json`` so a later launch does not count it again.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

from hpctrain.log import log_rank0

FAILURE_FILE = "last_failure.json"
RECOVERED_FILE = "last_failure.recovered.json"


def write_failure(run_dir: Optional[str], message: str, ranks: List[int], hosts: List[str], last_step: int) -> None:
    """Record a detected failure (never raises: the job is being stopped anyway)."""
    if not run_dir:
        return
    record = {"time_unix": time.time(), "message": message, "ranks": ranks, "hosts": sorted(set(hosts)),
              "last_step": max(0, last_step)}
    try:
        tmp = os.path.join(run_dir, FAILURE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, os.path.join(run_dir, FAILURE_FILE))
    except OSError:
        pass


class Recovery:
    """Rank 0's report of the restart after a recorded failure (no-op elsewhere and without one)."""

    def __init__(self, run_dir: Optional[str], is_main: bool):
        self.run_dir = run_dir
        self.failure: Optional[Dict[str, Any]] = None
        if is_main and run_dir:
            try:
                with open(os.path.join(run_dir, FAILURE_FILE)) as f:
                    self.failure = json.load(f)
            except (OSError, ValueError):
                self.failure = None

    def after_first_step(self, metrics: Dict[str, Any], resumed_step: int, tier: str) -> None:
        """Add the recovery fields to the first step's ``metrics``, log them, retire the record."""
        if self.failure is None or self.run_dir is None:
            return
        failure, self.failure = self.failure, None
        took = time.time() - float(failure.get("time_unix", time.time()))
        recomputed = max(0, int(failure.get("last_step", resumed_step)) - resumed_step)
        metrics.update({"recovery.time_s": took, "recovery.steps_recomputed": recomputed,
                        "recovery.resumed_step": resumed_step, "recovery.tier": tier})
        where = f"resumed at step {resumed_step} from the {tier} tier" if tier != "none" else \
            "started again from step 0 (nothing to resume from)"
        log_rank0("recovered from the failure in step %d (rank(s) %s on %s): %s, %d step(s) recomputed, %.1f s from "
                  "the failure to the end of step %d", int(failure.get("last_step", 0)) + 1,
                  ", ".join(map(str, failure.get("ranks", []))), ", ".join(failure.get("hosts", [])) or "?", where,
                  recomputed, took, int(metrics["step"]))
        try:
            os.replace(os.path.join(self.run_dir, FAILURE_FILE), os.path.join(self.run_dir, RECOVERED_FILE))
        except OSError:
            pass
