"""What this rank's collectives are doing, for the hang watchdog.

Every group's communicator is wrapped (``CountingCommunicator``), and the
wrapper numbers the collectives it issues: the n-th collective on a group
has sequence number n on every member, because all members issue the same
collectives in the same order. While this rank is blocked in one (a
blocking call, or ``wait()`` on an asynchronous one's handle), the board
holds a ``Waiting`` record: the op, the group, its sequence number and
members, and since when. Point-to-point waits name their peer instead
(their sequence numbers are not comparable across ranks).

The watchdog's thread reads the board (``hpctrain.train.watchdog``): a
rank waiting too long in collective n of group G waits for the members
that have issued fewer than n collectives on G. Reading and writing are
single attribute stores, so the training thread takes no lock.

``collective(...)`` marks a region of collectives that do not go through a
Communicator (a checkpoint save's MPI-IO) as one numbered op of its own.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

from hpctrain.eager import eager


class Waiting(NamedTuple):
    """One blocked call of this rank (a tuple: made on every blocking call)."""

    op: str
    group: str
    seq: Optional[int]
    """Sequence number of a collective on ``group`` (None: point-to-point)."""
    members: Tuple[int, ...]
    """World ranks of the group (collectives) or of the peer (point-to-point)."""
    since: float
    """``time.monotonic()`` when the wait began."""


class OpBoard:
    """This process's collective counters and current wait (see the module docstring)."""

    def __init__(self) -> None:
        self.issued: Dict[str, int] = {}
        """Collectives issued per group name (marked regions included)."""
        self.waiting: Optional[Waiting] = None
        self.step = 0
        """The training step being run (1-based; 0 before the first)."""
        self.phase = "starting"
        """What the training thread is doing: starting, training, checkpoint, stopping."""
        self.last_op: Optional[Tuple[str, str, Optional[int]]] = None
        """(op, group, sequence number) of the most recent issued operation."""

    def issue(self, op: str, group: str) -> int:
        seq = self.issued.get(group, 0) + 1
        self.issued[group] = seq
        self.last_op = (op, group, seq)
        return seq

    @contextlib.contextmanager
    def blocked(self, op: str, group: str, seq: Optional[int], members: Tuple[int, ...]) -> Iterator[None]:
        """This rank waits in ``op`` for the duration (nested waits restore the outer one)."""
        outer = self.waiting
        self.waiting = Waiting(op, group, seq, members, time.monotonic())
        try:
            yield
        finally:
            self.waiting = outer

    @contextlib.contextmanager
    def collective(self, op: str, group: str, members: Tuple[int, ...]) -> Iterator[None]:
        """A region that is collective over ``members`` (world ranks) but not
        made of Communicator calls, counted and waited in as one op."""
        seq = self.issue(op, group)
        with self.blocked(op, group, seq, members):
            yield


class WatchedWork:
    """A Work whose ``wait()`` is recorded on the board (async collectives)."""

    __slots__ = ("inner", "board", "op", "group", "seq", "members")

    def __init__(self, inner, board: OpBoard, op: str, group: str, seq: Optional[int], members: Tuple[int, ...]):
        self.inner, self.board, self.op, self.group, self.seq, self.members = inner, board, op, group, seq, members

    @eager
    def wait(self) -> None:
        board = self.board
        outer = board.waiting
        board.waiting = Waiting(self.op, self.group, self.seq, self.members, time.monotonic())
        try:
            self.inner.wait()
        finally:
            board.waiting = outer

    @eager
    def is_completed(self) -> bool:
        return self.inner.is_completed()
