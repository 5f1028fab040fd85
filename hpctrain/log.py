"""Rank-aware logging: rank 0 speaks at INFO, other ranks only warn, every
line from a rank other than 0 carries its rank.

Use ``get_logger(__name__)`` in library code and ``log_rank0`` for progress
messages; never ``print``. ``setup_logging`` is called once by the bootstrap;
``add_file_log`` adds the run directory's ``train.log`` on rank 0 and
``remove_file_log`` takes it away when the run ends: a Hydra sweep runs its
points in one process, and a handler left behind would copy every later
point's lines into an earlier point's log.
"""
from __future__ import annotations

import logging as _logging
import os
import sys
from typing import Optional

_ROOT = "hpctrain"
_state = {"rank": 0, "size": 1, "configured": False}


class _StderrHandler(_logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (rich's progress bar swaps it)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _RankFormatter(_logging.Formatter):
    def format(self, record: _logging.LogRecord) -> str:
        msg = super().format(record)
        prefix = "" if _state["rank"] == 0 else f"[rank {_state['rank']}] "
        level = "" if record.levelno == _logging.INFO else f"{record.levelname.lower()}: "
        return f"{prefix}{level}{msg}"


def setup_logging(rank: int = 0, world_size: int = 1, level: int = _logging.INFO) -> None:
    _state.update(rank=rank, size=world_size)
    logger = _logging.getLogger(_ROOT)
    if not _state["configured"]:
        handler = _StderrHandler()
        handler.setFormatter(_RankFormatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        _state["configured"] = True
    logger.setLevel(level if rank == 0 else max(level, _logging.WARNING))


def add_file_log(path: str) -> None:
    """Write rank 0's log lines to ``path`` (the run's train.log), and only there:
    a file log of an earlier run in this process is closed first."""
    if _state["rank"] != 0:
        return
    logger = _logging.getLogger(_ROOT)
    for h in logger.handlers:
        if isinstance(h, _logging.FileHandler) and h.baseFilename == os.path.abspath(path):
            return
    remove_file_log()
    fh = _logging.FileHandler(path)
    fh.setFormatter(_logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(fh)


def remove_file_log() -> None:
    """Close and remove every file log (the run that opened it has ended)."""
    logger = _logging.getLogger(_ROOT)
    for h in [h for h in logger.handlers if isinstance(h, _logging.FileHandler)]:
        logger.removeHandler(h)
        h.close()


def get_logger(name: Optional[str] = None) -> _logging.Logger:
    if not _state["configured"]:
        setup_logging()
    if name is None or name == _ROOT:
        return _logging.getLogger(_ROOT)
    # "hpctrain_h5ckpt.x" is a plugin module, not part of "hpctrain": nest it under the root logger too
    inside = name == _ROOT or name.startswith(_ROOT + ".")
    return _logging.getLogger(name if inside else f"{_ROOT}.{name}")


def log_rank0(msg: str, *args) -> None:
    """Log at INFO; only rank 0's line is shown."""
    get_logger().info(msg, *args)
