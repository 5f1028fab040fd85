"""The plugin's one error type (an HpctrainError, so the CLI prints it as a
clean one-line failure on every rank instead of a traceback)."""
from __future__ import annotations

from hpctrain.errors import HpctrainError


class CheckpointError(HpctrainError):
    """A checkpoint could not be written, found or read; the message names the
    file and, where it applies, the dataset."""
