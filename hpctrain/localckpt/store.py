"""The node-local directory of the local tier.

::

    <node dir>/step_<8 digits>/rank_<5 digits>.bin     one rank's state (own or a partner's copy)
    <node dir>/step_<8 digits>/holder_<5 digits>.json  written last by each rank on the node: the
                                                        ranks whose files it wrote, and the signature

A file is written to ``.tmp`` and renamed; a holder's manifest comes after
all its files, so a step a rank was still writing when it died is never
counted as held. No fsync: the tier protects against a lost *node*, whose
storage is lost with it anyway; the partners' copies are what survive.

``<node dir>``: a directory per node under ``checkpoint.local.dir``, named
for the node (``SLURMD_NODENAME``, the name Slurm knows it by, else the host
name), so that a directory that is not node-local after all (a shared file
system given by mistake, or emulated nodes of one machine under the local
test Slurm) still keeps each node's files apart; with nodes emulated by
``HPCTRAIN_RANKS_PER_NODE`` (every "node" on one machine, one host name)
``node_<i>``. Deleting one emulates losing that node's storage.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
from typing import Any, Dict, List, Optional, Set

STEP_RE = re.compile(r"^step_(\d{8})$")


def node_dir(base: str, node_rank: int, emulated: bool) -> str:
    if emulated:
        return os.path.join(base, f"node_{node_rank}")
    return os.path.join(base, os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def rank_file(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), f"rank_{rank:05d}.bin")


def write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def remove_partial(root: str, step: int) -> None:
    """What a failed save of ``step`` left: its temporary files (a step without every rank's manifest is
    never used, ``held``)."""
    d = step_dir(root, step)
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        if name.endswith(".tmp"):
            try:
                os.remove(os.path.join(d, name))
            except OSError:
                pass


def write_manifest(root: str, step: int, holder: int, ranks: List[int], sig: str,
                   about: Optional[Dict[str, Any]] = None) -> None:
    """``about``: the writer's ``family``, ``layout`` and ``dp_split`` (``state.family``, ``state.layout``; whether
    some of its tensors are split over dp, ZeRO), for resharding."""
    path = os.path.join(step_dir(root, step), f"holder_{holder:05d}.json")
    write_atomic(path, json.dumps({"step": step, "holder": holder, "ranks": sorted(ranks),
                                   "signature": sig, **(about or {})}).encode())


def steps(root: str) -> List[int]:
    """Step directories present, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := STEP_RE.match(n))), reverse=True)


def held(root: str, about: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[int, Dict[str, Set[int]]]:
    """``{step: {signature: ranks}}``: the ranks whose complete files this node holds,
    per step, as its manifests say (a file a manifest names but that is gone is left out).
    ``about`` (a dict) receives ``{signature: {"family": ..., "layout": ...}}`` from the manifests."""
    out: Dict[int, Dict[str, Set[int]]] = {}
    for step in steps(root):
        d = step_dir(root, step)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if not (name.startswith("holder_") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(d, name)) as f:
                    m = json.load(f)
            except (OSError, ValueError):
                continue
            ranks = {int(r) for r in m.get("ranks", []) if os.path.isfile(rank_file(root, step, int(r)))}
            out.setdefault(step, {}).setdefault(str(m.get("signature")), set()).update(ranks)
            if about is not None and "family" in m:
                about[str(m.get("signature"))] = {"family": m["family"], "layout": m.get("layout"),
                                                  "dp_split": bool(m.get("dp_split", False))}
    return out


def prune(root: str, keep: int, newer_than: Optional[int] = None) -> None:
    """Remove all but the ``keep`` newest step directories; with ``newer_than``,
    remove instead every step after it (a history that was not continued)."""
    for i, step in enumerate(steps(root)):
        if (newer_than is not None and step > newer_than) or (newer_than is None and i >= keep):
            shutil.rmtree(step_dir(root, step), ignore_errors=True)
