"""The plugin's one error type (an HpctrainError, so the CLI prints it as a
clean one-line failure on every rank instead of a traceback)."""
from __future__ import annotations

from hpctrain.errors import HpctrainError


class CheckpointError(HpctrainError):
    """A checkpoint could not be written, found or read; the message names the
    file and, where it applies, the dataset."""


class CheckpointSaveFailed(CheckpointError):
    """A save failed on some rank (a full disk, an I/O error) and every rank
    agreed on it: nothing was committed, the temporary file is gone and
    older checkpoints are untouched. The run stops (exit status 6)."""

    exit_code = 6
    on_every_rank = True


class CheckpointDirInUse(CheckpointError):
    """Another run holds the checkpoint directory's lock (exit status 2)."""

    on_every_rank = True
