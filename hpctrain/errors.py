"""Exceptions with messages meant for the person who launched the job."""
from __future__ import annotations


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
