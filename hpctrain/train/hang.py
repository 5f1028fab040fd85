"""Deciding from the ranks' heartbeats that the job is hung, and whom to blame.

Pure functions over ``RankState`` records (what rank 0 last heard from each
rank, ``hpctrain.train.watchdog``), so every rule is unit-tested without
processes. The rules, in order:

1. A rank whose connection closed without saying goodbye has died.
2. A rank silent for longer than the timeout has stopped responding (the
   process is stopped, swapping, or its node hangs).
3. A rank waiting longer than the timeout in collective n of group G waits
   for the members of G that have issued fewer than n collectives on G (in
   point-to-point, for its peer). The blame follows those ranks while they
   themselves wait (a pipeline's chain of receives) and stops at a rank that
   is not waiting: the stuck one. Waits that lead back to waiting ranks
   only are a deadlock; a long wait whose members have all entered the op
   means the transport itself is stuck (or the ranks called different
   collectives with the same count).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class RankState:
    """What rank 0 knows of one rank."""

    rank: int
    host: str = "?"
    pid: int = 0
    step: int = 0
    phase: str = "starting"
    issued: Dict[str, int] = field(default_factory=dict)
    waiting: Optional[Tuple[str, str, Optional[int], Tuple[int, ...], float]] = None
    """(op, group, sequence number or None, members or peer, seconds waited when sent)."""
    last_op: Optional[Tuple[str, str, Optional[int]]] = None
    heard: float = 0.0
    """``time.monotonic()`` on rank 0 when its last heartbeat arrived."""
    gone: Optional[str] = None
    """None while connected; "done" or "error" after a goodbye ("unwatched": its watchdog failed, it trains
    on); "died" when the connection broke."""

    def waiting_op(self) -> Optional[Tuple[str, str, Optional[int]]]:
        """(op, group, sequence number or None) of the wait; None when not waiting."""
        return self.waiting[:3] if self.waiting else None

    def waited(self, now: float) -> float:
        return self.waiting[4] + (now - self.heard) if self.waiting else 0.0


@dataclass
class Verdict:
    """Why the job is being stopped: one message for the log, the ranks to blame."""

    message: str
    stuck: List[int]


def _op(op: Optional[Tuple[str, str, Optional[int]]]) -> str:
    if not op:
        return "none yet"
    name, group, seq = op
    return f"{name} #{seq} on {group}" if seq is not None else f"{name} on {group}"


def _where(s: RankState) -> str:
    return f"rank {s.rank} (host {s.host}, pid {s.pid})"


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks))


def _laggards(s: RankState, states: Dict[int, RankState]) -> List[int]:
    """The ranks ``s`` waits for."""
    assert s.waiting is not None  # asked about waiting ranks only
    op, group, seq, members, _ = s.waiting
    if seq is None:  # point-to-point: its peer
        return [m for m in members if m != s.rank]
    return [m for m in members if m != s.rank and (m not in states or states[m].issued.get(group, 0) < seq)]


def _blame(r: int, live: Dict[int, RankState], states: Dict[int, RankState], silent: List[int]) -> Optional[List[int]]:
    """The ranks at the end of ``r``'s chain of waits (empty: every member has
    entered its op; None: the chain only leads back to waiting ranks)."""
    frontier = _laggards(live[r], states)
    if not frontier:
        return []
    seen, roots = {r}, []
    while frontier:
        nxt = []
        for m in frontier:
            if m in seen:
                continue
            seen.add(m)
            ms = states.get(m)
            if ms is None or ms.gone is not None or m in silent or not ms.waiting:
                roots.append(m)
            else:
                nxt.extend(_laggards(ms, states))
        frontier = nxt
    return roots or None


def _describe(s: RankState, now: float, silent: bool, job_step: int = 0) -> str:
    if s.gone == "died":
        # its last heartbeat can be an interval (many short steps) old; steps are synchronous, so a rank in step
        # job_step means the dead one finished every collective of job_step - 1: it died in that step or later
        lo = job_step - 1
        when = f"step {s.step}" if s.step >= lo else f"step >= {lo} (the job was in step {job_step})"
        return (f"{_where(s)} died in {when} ({s.phase}): its process ended without finishing (killed, out of "
                "memory, or crashed; its own output may say why)")
    if s.gone == "unwatched":
        return (f"{_where(s)}, unwatched since its watchdog failed in step {s.step} ({s.phase}), has not come to the "
                "collective")
    if s.gone is not None:
        return f"{_where(s)} left the job in step {s.step} ({s.phase}) with an error (see its output)"
    if silent:
        return (f"{_where(s)} stopped responding: no heartbeat for {now - s.heard:.0f} s (the process is stopped or "
                f"its node hangs); last heard in step {s.step} ({s.phase})")
    return f"{_where(s)} stopped making progress in step {s.step} ({s.phase}), in no collective"


def diagnose(states: Dict[int, RankState], now: float, timeout: float) -> Optional[Verdict]:
    """The verdict on the job now, or None while it may still be making progress."""
    live = {r: s for r, s in states.items() if s.gone is None}
    died = sorted(r for r, s in states.items() if s.gone == "died")
    silent = sorted(r for r, s in live.items() if now - s.heard > timeout)
    long_waits = [r for r in sorted(live) if r not in silent and live[r].waiting and live[r].waited(now) > timeout]
    if not died and not silent and not long_waits:
        return None
    # who waits for whom, over every current wait (a fresh one says where a dead rank is missed)
    waiters: Dict[int, List[int]] = {}
    all_in: List[int] = []
    cycle: List[int] = []
    for r in sorted(live):
        if r in silent or not live[r].waiting:
            continue
        roots = _blame(r, live, states, silent)
        if roots is None:
            cycle.append(r)
        elif not roots:
            all_in.append(r)
        for m in roots or []:
            waiters.setdefault(m, []).append(r)
    job_step = max((st.step for st in states.values()), default=0)  # rank 0's own state is current
    culprits = died or silent or sorted(m for m in waiters if any(w in long_waits for w in waiters[m]))
    lines = []
    for m in culprits:
        s = states.get(m) or RankState(m)
        what = _describe(s, now, m in silent, job_step) + f"; its last op: {_op(s.last_op)}"
        if waiters.get(m):
            w = live[waiters[m][0]]
            what += (f"; rank(s) {_ranks(sorted(waiters[m]))} wait for it ({w.waited(now):.0f} s) in "
                     f"{_op(w.waiting_op())}")
        lines.append(what)
    stuck = list(culprits)
    if not died and not silent:
        cycle = [r for r in cycle if r in long_waits]
        all_in = [r for r in all_in if r in long_waits]
        if cycle:
            w = live[cycle[0]]
            lines.append(f"rank(s) {_ranks(cycle)} wait for each other (a deadlock: ranks called collectives in "
                         f"different orders); rank {cycle[0]} in {_op(w.waiting_op())} for {w.waited(now):.0f} s")
            stuck.extend(cycle)
        if all_in:
            w = live[all_in[0]]
            lines.append(f"rank(s) {_ranks(all_in)} have been inside {_op(w.waiting_op())} for {w.waited(now):.0f} s "
                         "with every member of the group in it (the transport or file system is stuck, or the "
                         "ranks called different collectives)")
            stuck.extend(all_in)
    if not lines:
        return None
    return Verdict("; ".join(lines), sorted(set(stuck)))
