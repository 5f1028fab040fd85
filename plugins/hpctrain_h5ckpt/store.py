"""The checkpoint directory: names, atomic commit, the ``latest`` pointer,
keep-last-k, and the list of candidates for ``resume=auto``.

``step_00000010.h5`` is written as ``step_00000010.h5.tmp``; only after every
rank has closed it (and it has been fsynced) does rank 0 rename it into
place, so a name without ``.tmp`` always means a complete file: a crash at
any earlier moment leaves at most a ``.tmp`` that nothing reads (the next
save of that step overwrites it). ``latest`` holds the newest committed
file name and is itself replaced atomically (write ``latest.tmp``, rename);
one directory fsync then makes both renames durable. Pruning happens after the commit and never touches the file just
committed or the one ``latest`` names, so a failed save never costs an
older checkpoint. These functions touch only the filesystem and are called
by rank 0; the checkpointer broadcasts their outcome.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional

from hpctrain_h5ckpt.h5io import fsync_path

LATEST = "latest"
_NAME = re.compile(r"^step_(\d+)\.h5$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.h5"


def tmp_path(final: str) -> str:
    return final + ".tmp"


def step_of(name: str) -> Optional[int]:
    m = _NAME.match(os.path.basename(name))
    return int(m.group(1)) if m else None


def read_latest(directory: str) -> Optional[str]:
    """The file ``latest`` names, if it exists."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        return None
    path = os.path.join(directory, os.path.basename(name))
    return path if name and os.path.isfile(path) else None


def write_latest(directory: str, final: str) -> None:
    """Point ``latest`` at ``final`` by an atomic rename (the caller fsyncs the
    directory). Its content is not fsynced: after a crash it may be empty,
    which readers treat as absent and fall back to the step order."""
    tmp = os.path.join(directory, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(final) + "\n")
    os.replace(tmp, os.path.join(directory, LATEST))


def committed(directory: str) -> List[str]:
    """Committed checkpoints (``step_N.h5``), highest step first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(step_of(n), n) for n in names if step_of(n) is not None]
    return [os.path.join(directory, n) for _, n in sorted(found, reverse=True)]


def candidates(directory: str) -> List[str]:
    """What ``resume=auto`` tries, in order: every committed checkpoint,
    highest step first. A committed file is complete (the rename is the
    commit), so the newest one wins even over a ``latest`` that names an
    older step (a crash between the rename and the pointer update, or a
    pointer left behind): loading the stale one would let the run write
    over the newer steps."""
    return committed(directory)


def orphans(directory: str) -> List[str]:
    """Temporary files a crashed save left (``*.h5.tmp``, ``latest.tmp``): never read, safe to delete
    when no save is running."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [os.path.join(directory, n) for n in sorted(names)
            if n == LATEST + ".tmp" or (n.endswith(".h5.tmp") and step_of(n[:-len(".tmp")]) is not None)]


def commit(tmp: str, final: str, directory: Optional[str], keep: int, fsync: bool = True) -> List[str]:
    """Rename ``tmp`` to ``final``, point ``latest`` at it when it lives in
    ``directory``, and prune to the newest ``keep`` (0 keeps all). Returns the
    paths removed."""
    os.replace(tmp, final)
    parent = os.path.dirname(os.path.abspath(final))
    managed = directory if directory is not None and os.path.abspath(directory) == parent else None
    if managed is not None:
        write_latest(managed, final)
    if fsync:  # both renames durable before anything older is deleted
        fsync_path(parent)
    return prune(managed, keep, protect=(final,)) if managed is not None else []


def prune(directory: str, keep: int, protect: tuple = ()) -> List[str]:
    """Delete committed checkpoints beyond the newest ``keep`` by step; never
    a protected one nor the one ``latest`` names."""
    if keep <= 0:
        return []
    spare = {os.path.abspath(p) for p in protect}
    latest = read_latest(directory)
    if latest:
        spare.add(os.path.abspath(latest))
    removed = []
    for path in committed(directory)[keep:]:
        if os.path.abspath(path) in spare:
            continue
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
