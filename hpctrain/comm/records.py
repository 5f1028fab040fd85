"""What a recording backend writes down per collective (the dry run's contract).

A backend that moves no data (``comm.dry_run`` capability; the built-in one
is ``hpctrain_comm_record``) keeps a ``records`` list of ``CollectiveRecord``
on each communicator it makes; ``hpctrain.dry_run`` reads them per group.
Bytes follow the nccl-tests bus-bytes convention of
``hpctrain.comm.counting`` (what one rank sends on a ring algorithm; a
point-to-point byte counted by its sender), so the records of a dry run
equal the counted bytes of the real run, op by op.

``peers`` is the group's own tuple of world ranks (shared, never copied per
call) or the one peer of a point-to-point op, so recording costs O(1)
whatever the group's size; ``ranks_text`` prints it compactly (once per
group, when a report is printed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective (or send/receive) a rank issued."""

    op: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv or barrier."""
    group: str
    """The mesh group's name (``tp``, ``cp+ep+dp``, ``pp_ends``, ...)."""
    axes: Tuple[str, ...]
    """The mesh axes the group spans."""
    dtype: torch.dtype
    nbytes: float
    """Bus bytes (``hpctrain.comm.counting``'s convention; 0 for a receive or a barrier)."""
    peers: Tuple[int, ...]
    """World ranks taking part: the group's ranks, or the peer of a send or receive."""


def ranks_text(ranks: Sequence[int]) -> str:
    """``(0, 8, 16, 24)`` -> ``0..24 step 8 (4 ranks)``; a short irregular list as it is."""
    n = len(ranks)
    if n == 0:
        return "-"
    if n == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if n > 2 and step > 0 and all(ranks[i + 1] - ranks[i] == step for i in range(n - 1)):
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {step}" if step != 1 else "") + f" ({n} ranks)"
    if n <= 8:
        return ",".join(map(str, ranks))
    return f"{','.join(map(str, ranks[:4]))},...,{ranks[-1]} ({n} ranks)"
