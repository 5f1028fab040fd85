"""Lustre striping of the checkpoint directory (``checkpoint.lustre.*``).

A new file on Lustre takes the default layout of its directory: with the
file system's usual default of one stripe, every rank's part of a
checkpoint goes to one storage target (OST) and the save runs at one OST's
speed. ``lfs setstripe -c N [-S size] <dir>`` on the directory, before the
first save, makes every later checkpoint spread over N targets
(docs/checkpointing.md says which N and why). Rank 0 runs it once, when the
checkpointer is made; without an ``lfs`` command (not a Lustre client) one
line says the directory keeps its layout, and a failing ``lfs`` (the
directory is not on Lustre) says why, neither stopping the run. MPI-IO's
``striping_factor``/``striping_unit`` hints (``checkpoint.hdf5.mpiio_hints``)
do the same per file, where the MPI library honours them.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any, List, Optional

STRIPE_SIZE = re.compile(r"\d+[KMG]?")
"""``lfs setstripe -S``'s form: bytes, or a number with K, M or G (a multiple of 64 KiB)."""


def setstripe_command(directory: str, count: int, size: str = "") -> List[str]:
    """``lfs setstripe -c COUNT [-S SIZE] DIRECTORY`` (count -1: every OST)."""
    return ["lfs", "setstripe", "-c", str(count)] + (["-S", size] if size else []) + [directory]


def problems(lustre: Any) -> List[str]:
    out = []
    if int(lustre.stripe_count) < -1:
        out.append(f"checkpoint.lustre.stripe_count={lustre.stripe_count} must be -1 (every storage target), 0 "
                   "(leave the directory's layout) or a number of targets")
    size = str(lustre.stripe_size or "")
    if size and not STRIPE_SIZE.fullmatch(size):
        out.append(f"checkpoint.lustre.stripe_size={size!r} is not a stripe size: give bytes or a number with K, M "
                   "or G (4M), a multiple of 64K")
    return out


def stripe_directory(directory: str, lustre: Any) -> Optional[str]:
    """Apply ``checkpoint.lustre`` to ``directory`` (made when missing); the line to log, None when
    ``stripe_count`` is 0 (nothing asked)."""
    count, size = int(lustre.stripe_count), str(lustre.stripe_size or "")
    if not count:
        return None
    command = setstripe_command(directory, count, size)
    if shutil.which("lfs") is None:
        return (f"checkpoint.lustre.stripe_count={count}: no lfs command here (not a Lustre client); "
                f"{directory} keeps its file system's layout")
    try:
        os.makedirs(directory, exist_ok=True)
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"checkpoint.lustre: {' '.join(command)} failed ({e}); {directory} keeps its layout"
    if out.returncode:
        why = (out.stderr or out.stdout).strip().splitlines()
        return (f"checkpoint.lustre: {' '.join(command)} failed ({why[-1] if why else f'exit status {out.returncode}'})"
                f"; {directory} keeps its layout")
    return f"checkpoint.lustre: {' '.join(command)}: new checkpoints are striped over {count} storage target(s)" \
        if count > 0 else f"checkpoint.lustre: {' '.join(command)}: new checkpoints are striped over every target"
