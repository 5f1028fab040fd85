"""Resharding the local tier over the data-parallel axis (``trainer.elastic``).

The tier's files are exact per-rank shards: put back as they are, they need
the layout that wrote them. One change is allowed: a different data-parallel
size. Without ZeRO every data-parallel replica holds the same parameters and
optimizer state, and the data cursor is global, so the new rank ``r`` can
load the state of any old rank with its other coordinates (tp, cp, ep, pp).
Which one: the old rank with the same dp index when its file is on ``r``'s
node, else the lowest such rank held on ``r``'s node, else the lowest held
anywhere (then fetched from a partner) (``deal``). Under ZeRO the optimizer
state (and at stage 3 the parameters) is split over dp: then ``r`` also
reads every old rank with its other coordinates (``gather``) and cuts its
new shards out of the pieces they recorded (``state.assemble``); the rest
(replicated parameters, random state, cursor) comes from ``deal``'s rank.
DiLoCo, whose replicas differ, is refused with ``trainer.elastic`` by
validation. A change of any other axis, the order, or the experiment is
refused (``why_not``), and the caller falls back to the persistent checkpoint.

Pure functions of the layouts (``state.layout``) and of who holds what.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

AXES = ("tp", "cp", "ep", "dp", "pp")


def coords(rank: int, layout: Mapping[str, Any]) -> Dict[str, int]:
    """Mesh coordinates of ``rank`` under ``layout`` (the order's first axis varies fastest, as ``Mesh``)."""
    sizes, out, stride = layout["sizes"], {}, 1
    for a in str(layout["order"]).split("-"):
        out[a] = (rank // stride) % int(sizes[a])
        stride *= int(sizes[a])
    return out


def why_not(old: Mapping[str, Any], new: Mapping[str, Any]) -> Optional[str]:
    """None when ``old`` and ``new`` differ in the data-parallel size only (or not at all); else what differs."""
    diffs = [f"{a}({old['sizes'][a]}) -> {a}({new['sizes'][a]})" for a in AXES
             if a != "dp" and int(old["sizes"][a]) != int(new["sizes"][a])]
    if old["order"] != new["order"]:
        diffs.append(f"order {old['order']} -> {new['order']}")
    return ", ".join(diffs) or None


def deal(old: Mapping[str, Any], new: Mapping[str, Any],
         held_by: Mapping[int, Set[int]]) -> Optional[Tuple[Dict[int, int], Dict[int, int]]]:
    """``(sources, holders)`` for the new layout from the old one's files, or None when some new rank has
    no replica to load. ``held_by``: old rank -> the new ranks whose node holds its file. ``sources``: new
    rank -> the old rank whose state it loads; ``holders``: new rank -> the new rank that sends it that file
    (absent: on its own node)."""
    by_place: Dict[Tuple[int, ...], list] = {}
    for o in sorted(held_by):
        if 0 <= o < int(old["world_size"]) and held_by[o]:
            c = coords(o, old)
            by_place.setdefault(tuple(c[a] for a in AXES if a != "dp"), []).append((c["dp"], o))
    sources: Dict[int, int] = {}
    holders: Dict[int, int] = {}
    for r in range(int(new["world_size"])):
        c = coords(r, new)
        candidates = by_place.get(tuple(c[a] for a in AXES if a != "dp"))
        if not candidates:
            return None
        local = [(d, o) for d, o in candidates if r in held_by[o]]
        same = [o for d, o in local if d == c["dp"]]
        o = same[0] if same else (local or candidates)[0][1]
        sources[r] = o
        if r not in held_by[o]:
            holders[r] = min(held_by[o])
    return sources, holders


def gather(old: Mapping[str, Any], new: Mapping[str, Any],
           held_by: Mapping[int, Set[int]]) -> Optional[Dict[int, List[Tuple[int, int]]]]:
    """For state split over dp (ZeRO): new rank -> ``[(old rank, holder)]``, every old rank with the new rank's
    other coordinates, in old dp order; ``holder`` is the new rank itself when its node holds that file, else the
    lowest new rank that does. None when one of those files is held nowhere."""
    places: Dict[Tuple[int, ...], List[Tuple[int, int]]] = {}
    for o in range(int(old["world_size"])):
        c = coords(o, old)
        places.setdefault(tuple(c[a] for a in AXES if a != "dp"), []).append((c["dp"], o))
    out: Dict[int, List[Tuple[int, int]]] = {}
    for r in range(int(new["world_size"])):
        c = coords(r, new)
        plan = []
        for _, o in sorted(places.get(tuple(c[a] for a in AXES if a != "dp"), [])):
            where = held_by.get(o, set())
            if not where:
                return None
            plan.append((o, r if r in where else min(where)))
        if not plan:
            return None
        out[r] = plan
    return out
