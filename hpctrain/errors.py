"""Exceptions with messages meant for the person who launched the job, and
the one way every hpctrain command writes them."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

LAUNCHER_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
"""Where mpirun, srun and other launchers put a process's rank, readable before MPI starts."""


def write_error(message: str, kind: str = "error") -> None:
    """Write ``message`` on stderr, each line as ``hpctrain: <kind>: <line>``.

    Every command (hpctrain-train, -eval, -plan, -tune, -prepare, -ckpt,
    -report, -parity, -bench) starts its error lines this way, so one
    pattern finds them in any job's log."""
    for line in message.splitlines() or [""]:
        sys.stderr.write(f"hpctrain: {kind}: {line}\n")
    sys.stderr.flush()


def launcher_rank() -> int:
    """This process's rank as the launcher set it (0 when not launched by one)."""
    for name in LAUNCHER_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose bad argument is one ``hpctrain: error:`` line naming the
    command and pointing at its ``--help``, status 2, written by rank 0 only
    (argparse's own prints the usage block, starts the line with the
    command's name, and does so on every rank of an MPI job)."""

    def error(self, message: str) -> NoReturn:
        if launcher_rank() == 0:
            write_error(f"{self.prog}: {message} (see {self.prog} --help)")
        sys.exit(2)


class HpctrainError(Exception):
    """Base class of hpctrain's own errors."""

    exit_code = 2
    """The status every rank exits with (2: the job could not start as configured)."""
    prefix = "error"
    """How rank 0's line starts: ``hpctrain: <prefix>: ...``."""
    on_every_rank = False
    """Raised by every rank at the same point (a decision on agreed values): the
    ranks can meet once more before exiting, so rank 0's message is written
    before the launcher tears the job down."""


class ConfigError(HpctrainError):
    """A configuration that cannot run. The message names the problem and the fix.

    Raised by validation on every rank before any collective starts, so all
    ranks agree and exit together instead of hanging.
    """

    on_every_rank = True


class PluginError(HpctrainError):
    """A plugin is missing, blocked, or broke its contract."""


class CommError(HpctrainError):
    """A collective was called with arguments that cannot be right."""


class TrainingDiverged(HpctrainError):
    """The loss or gradient norm stopped being finite (``reliability.nonfinite``).

    Every rank raises it at the same step (the values are global), before the
    optimizer update, so weights, optimizer state and checkpoints stay finite.
    """

    exit_code = 3
    on_every_rank = True
