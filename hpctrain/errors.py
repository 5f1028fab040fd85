"""Exceptions with messages meant for the person who launched the job."""
from __future__ import annotations


class HpctrainError(Exception):
    """Base class of hpctrain's own errors."""


class ConfigError(HpctrainError):
    """A configuration that cannot run. The message names the problem and the fix.

    Raised by validation on every rank before any collective starts, so all
    ranks agree and exit together instead of hanging.
    """


class PluginError(HpctrainError):
    """A plugin is missing, blocked, or broke its contract."""


class CommError(HpctrainError):
    """A collective was called with arguments that cannot be right."""
