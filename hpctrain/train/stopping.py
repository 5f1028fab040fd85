"""Stopping early on purpose: signals and time limits end in a checkpoint.

What asks a run to stop:

- SIGUSR1: the warning a scheduler sends before the end (``#SBATCH
  --signal=USR1@120``); under SLURM the job is then requeued. ``mpiexec``
  forwards it to the ranks at once, so ``kill -USR1 <mpiexec pid>`` is the
  prompt way to stop an ``mpiexec`` job;
- SIGTERM: preemption, ``scancel``, a system shutdown (SLURM requeues a
  preempted job itself when its preemption mode says so), and what
  ``mpiexec`` sends its ranks when it is itself sent SIGTERM or SIGINT
  (after its kill delay; docs/slurm.md has what each launcher gives);
- SIGINT: Ctrl-C at a terminal, and what ``srun`` forwards on a second
  Ctrl-C. Caught only while a stop can save (below); otherwise Python's
  usual KeyboardInterrupt, since waiting for the step would save nothing;
- the clock: ``trainer.max_time`` seconds after the start, the SLURM
  job's end time or ``trainer.end_time``, less the next step, the measured
  save and ``trainer.end_margin_s`` (``hpctrain.train.deadline``);
  under SLURM the job is then requeued.

A handler only records the signal, so a second signal during the save
cannot tear the checkpoint. After every step all ranks agree (one small
all-reduce over the world, MAX) on whether any rank was asked to stop, so
they stop after the same step; they commit a checkpoint, and the run ends
with ``StopRequested`` (exit status 75, "try again"). The stop saves
whatever ``checkpoint.every`` is (a preempted job that never set it would
otherwise lose everything): to ``checkpoint.dir``, which the command line
fills with the experiment's default directory. Nothing is saved only when
``checkpoint.save_on_stop=false``, when no installed plugin provides
``checkpoint.format``, or when a programmatic run has no
``checkpoint.dir``; the stop message then says which, and how to get a
save (``why_no_stop_save``). Under SLURM, for the warning signal and the
time limit, rank 0 first runs ``scontrol requeue <job>``: the job goes back
to the queue with the same id, so the template's run directory is the same
and ``checkpoint.resume=auto`` resumes from the newest good checkpoint.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.errors import HpctrainError
from hpctrain.log import get_logger, log_rank0
from hpctrain.mesh import AXES, Mesh
from hpctrain.plugins import DISABLE_ENV, blocked_names, capabilities
from hpctrain.train.deadline import Clock, Decision, parse_end_time

log = get_logger(__name__)

EXIT_CODE = 75
"""sysexits' EX_TEMPFAIL: stopped with a checkpoint; relaunching resumes."""

#: reason codes, agreed with MAX: a signal outranks the clock
_CLOCK, _SIGNALS = 1, {signal.SIGINT: 2, signal.SIGTERM: 3, signal.SIGUSR1: 4}
_NAMES = {1: "the time limit", 2: "SIGINT", 3: "SIGTERM", 4: "SIGUSR1"}
_REQUEUE = (1, 4)  # the warning signal and the clock: the job is not finished, put it back in the queue


class StopRequested(HpctrainError):
    """The run stopped after a step on a signal or the time limit (see the module docstring)."""

    exit_code = EXIT_CODE
    on_every_rank = True
    prefix = "stopped"


STRAGGLER_EXIT_CODE = 76
"""Stopped with a checkpoint to leave straggling nodes behind (``reliability.straggler_stop_after``)."""


class StragglerStop(StopRequested):
    """The run stopped after a step because the same ranks kept straggling; their nodes are in
    ``last_failure.json``, which ``slurm/train.sbatch`` reads to restart without them."""

    exit_code = STRAGGLER_EXIT_CODE


def straggler_stop_reason(ranks: Any, reports: int) -> str:
    return (f"straggler rank(s) {', '.join(map(str, ranks))} named in {reports} report(s) in a row "
            "(reliability.straggler_stop_after)")


def parse_duration(text: Any) -> Optional[float]:
    """Seconds from ``3600``, ``"90:00"`` (MM:SS), ``"01:30:00"`` or ``"1-00:00:00"`` (SLURM's forms); None
    for None/empty."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)|(\d+(?:\.\d*)?)", str(text).strip())
    if not m:
        raise ValueError(text)
    if m.group(5) is not None:
        return float(m.group(5))
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups()[:4])
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


SQUEUE_TRIES = 3
"""squeue asks the controller, which a busy cluster may not answer at once; tries before giving up."""


def slurm_end_time(retry_wait_s: float = 1.0) -> Optional[float]:
    """The running SLURM job's end (``time.time()`` seconds), or None outside SLURM or without a limit.

    Slurm >= 23.02 exports ``SLURM_JOB_END_TIME``; before it squeue is asked
    when installed, ``SQUEUE_TRIES`` times (a controller under load can time
    out). When no try answers, a warning says so: the run then stops only on
    ``trainer.max_time``, ``trainer.end_time`` or a signal."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    end = os.environ.get("SLURM_JOB_END_TIME")  # Slurm >= 23.02 exports it
    if end and end.isdigit():
        return float(end)
    if shutil.which("squeue") is None:
        log.warning("SLURM job %s: no SLURM_JOB_END_TIME and no squeue on PATH to read its end time; the run "
                    "stops on trainer.max_time, trainer.end_time or a signal only: set trainer.max_time or "
                    "trainer.end_time, or #SBATCH --signal=USR1@120", job)
        return None
    why = ""
    for attempt in range(SQUEUE_TRIES):
        if attempt:
            time.sleep(retry_wait_s * attempt)
        try:
            out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
            continue
        stamp = out.stdout.strip()
        if out.returncode == 0 and stamp in ("N/A", "NONE", "Unknown"):
            return None  # no time limit
        if out.returncode == 0 and stamp:
            try:
                return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
            except ValueError:
                why = f"unexpected end time {stamp!r}"
                break
        why = (out.stderr.strip() or f"exit status {out.returncode}, no output").splitlines()[-1]
    log.warning("could not read SLURM job %s's end time from squeue (%s); the run stops on trainer.max_time, "
                "trainer.end_time or a signal only: set trainer.max_time or trainer.end_time, or "
                "#SBATCH --signal=USR1@120", job, why)
    return None


class StopRequests:
    """This rank's record of signals, and the clock (rank 0's)."""

    def __init__(self, cfg: Any, is_main: bool, catch_sigint: bool):
        self.received: list = []
        """Signals received, in order (a second one is recorded and otherwise ignored)."""
        self.margin = float(cfg.trainer.end_margin_s)
        self.deadline: Optional[float] = None
        """``time.monotonic()`` by which the run must have stopped (rank 0; None: no limit)."""
        self.deadline_from = ""
        if is_main:
            limits = []
            max_time = parse_duration(cfg.trainer.max_time)
            if max_time is not None:
                limits.append((time.monotonic() + max_time, f"trainer.max_time={cfg.trainer.max_time}"))
            end = slurm_end_time()
            if end is not None:
                limits.append((time.monotonic() + end - time.time(), "the SLURM job's time limit"))
            given = parse_end_time(cfg.trainer.end_time)
            if given is not None:
                limits.append((time.monotonic() + given - time.time(), f"trainer.end_time={cfg.trainer.end_time}"))
            if limits:
                self.deadline, self.deadline_from = min(limits)
        self.clock = Clock()
        """Rank 0's loop timing (``hpctrain.train.deadline``), from now."""
        self.clock.boundary(time.monotonic())
        self.flags: List[int] = []
        """The flags ``agree`` carried, as agreed (any rank's)."""
        self.decision: Optional[Decision] = None
        """The last boundary's figures against the deadline (rank 0, with a deadline)."""
        self._catch = [signal.SIGUSR1, signal.SIGTERM] + ([signal.SIGINT] if catch_sigint else [])
        self._previous: Dict[int, Any] = {}

    def install(self) -> None:
        """Catch the signals (main thread only; elsewhere the run keeps the defaults)."""
        try:
            for sig in self._catch:
                self._previous[sig] = signal.signal(sig, self._record)
        except ValueError:  # not the main thread (a test harness): keep the defaults
            self.uninstall()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def agree(self, mesh: Mesh, device: torch.device, step_s: float, save_s: float = 0.0,
              saving_s: float = 0.0, flags: Sequence[int] = ()) -> int:
        """The reason code every rank stops for after this step (0: go on). Collective. ``step_s``: the step
        just taken; ``save_s``: the longest persistent save measured so far (start to commit); ``saving_s``:
        the seconds saves blocked the loop since the last boundary (rank 0's are what counts). ``flags``
        (0/1 each) ride along in the same all-reduce: ``self.flags`` is 1 where any rank's was
        (``hpctrain.train.save_failures``)."""
        mine = max((_SIGNALS[s] for s in self.received), default=0)
        if self.deadline is not None:
            now = time.monotonic()
            self.clock.boundary(now, saving_s)
            self.decision = self.clock.decide(self.deadline, now, step_s, save_s, self.margin)
            if self.decision.stop:
                mine = max(mine, _CLOCK)
        world = mesh.group(AXES)
        if world.size == 1:
            self.flags = [int(f) for f in flags]
            return mine
        flag = torch.tensor([mine, *flags], dtype=torch.int32, device=device)
        world.communicator().all_reduce(flag, ReduceOp.MAX)
        agreed = flag.tolist()
        self.flags = [int(f) for f in agreed[1:]]
        return int(agreed[0])

    def describe(self, reason: int) -> str:
        if reason != _CLOCK:
            return _NAMES[reason]
        figures = self.decision.describe() if self.decision is not None else "less trainer.end_margin_s"
        return f"{self.deadline_from} ({figures})"


def requeue_if_slurm(reason: int) -> Optional[str]:
    """Rank 0: put this SLURM job back in the queue for the warning signal and
    the clock; what happened, for the log (None outside SLURM or for other reasons)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    if job:
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job = os.environ.get("SLURM_JOB_ID")
    if not job or reason not in _REQUEUE:
        return None
    # said first: Slurm may end this job's processes as soon as the requeue is accepted
    log_rank0("asking Slurm to requeue job %s (scontrol requeue)", job)
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not requeue SLURM job {job} ({e}); resubmit it to resume"
    if out.returncode:
        return f"SLURM did not requeue job {job} ({(out.stderr or out.stdout).strip()}); resubmit it to resume"
    return f"requeued SLURM job {job}: it resumes from this checkpoint when it starts again"


def why_no_stop_save(cfg: Any, pm: Any, have_checkpointer: bool) -> Optional[str]:
    """None when a stop can commit a checkpoint; else why not and how to get
    one (for the stop message, so a user is never left guessing)."""
    ck = cfg.checkpoint
    if not ck.save_on_stop:
        periodic = "; checkpoint.resume=auto resumes from the newest periodic one" if ck.every else ""
        return "checkpoint.save_on_stop=false; leave it true (the default) to save when a run is stopped" + periodic
    if not have_checkpointer:
        formats = capabilities(pm).get("checkpoint.format", [])
        if ck.format not in formats:
            blocked = blocked_names()
            hint = (f"; blocked by {DISABLE_ENV}: {', '.join(blocked)} (unset it or remove the plugin's name "
                    "from it)") if blocked else ""
            return (f"no installed plugin provides checkpoint.format={ck.format!r} (available: "
                    f"{', '.join(formats) or 'none'}); install one (pip install -e . brings hdf5) or choose an "
                    "available format" + hint)
    if not (ck.dir or ck.every):
        return "checkpoint.dir is not set; set checkpoint.dir=PATH (hpctrain-train sets a default)"
    return None


def stop_message(step: int, why: str, saved: Optional[str], requeued: Optional[str],
                 unsaved: Optional[str] = None) -> str:
    """The one line a stopped run ends with; ``unsaved``: why nothing was saved."""
    where = (f"checkpoint {saved} committed; relaunch with checkpoint.resume=auto to go on" if saved
             else f"no checkpoint saved: {unsaved or 'the stop could not save'}")
    return f"step {step}: stopped on {why}; {where}" + (f"; {requeued}" if requeued else "")
