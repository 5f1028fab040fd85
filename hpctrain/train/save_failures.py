"""Saves that fail out of sight (a background persistent save, a node-local save): what the run does.

Such a save fails on its own thread, while training goes on. Each rank notes
it without waiting (``Checkpointer.failed()``, ``LocalTier.failed``), and the
ranks agree at the next step boundary, inside the stop agreement they make
after every step anyway (``StopRequests.agree``: one all-reduce that carries
these flags beside the stop reason). Every rank then takes the same branch:
the failure is reported in one line (which save, which ranks, why), and

- training goes on when another tier holds a recent state: a failed local
  save falls back on the persistent tier's periodic saves
  (``checkpoint.every``); a failed persistent save on the local tier, when it
  has a complete step on every rank (``checkpoint.local.every``);
- otherwise the run stops with a save attempt: a persistent save of the
  current step, waited for, whose outcome the stop's message gives, and ends
  with exit status 6 (``SaveFailedStop``).

The decisions are pure functions of agreed values (``after_local``,
``after_persistent``), so no rank can take the other branch. A failure that
the boundary did not see yet (a background save still running there) is
found by the next save of its tier, which waits for the one in flight first
and applies the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from hpctrain.errors import HpctrainError

PERSISTENT, LOCAL = 0, 1
"""Positions of the two flags in ``Checkpointing.failure_flags`` (agreed with MAX: any rank's failure)."""

EXIT_CODE = 6
"""As a failed synchronous save (hpctrain_h5ckpt's CheckpointSaveFailed)."""


class SaveFailedStop(HpctrainError):
    """A background or local save failed and no other tier holds a recent state: the run stopped after a
    save attempt (its outcome is in the message)."""

    exit_code = EXIT_CODE
    on_every_rank = True


@dataclass(frozen=True)
class Verdict:
    go_on: bool
    line: str
    """The one line that reports the failure and what the run does."""


def who(failed: Dict[int, str], nodes: Sequence[int]) -> Tuple[str, str]:
    """("rank(s) 1 (node 1), 3 (node 2)", the lowest rank's reason) for every rank's failure."""
    ranks = ", ".join(f"{r} (node {nodes[r]})" if r < len(nodes) else str(r) for r in sorted(failed))
    return ranks, failed[min(failed)]


def after_local(what: str, persistent_every: int) -> Verdict:
    """A local save failed (``what`` says where and why): the persistent tier's periodic saves are the
    fallback."""
    if persistent_every:
        return Verdict(True, f"{what}; the local tier is a cache: its temporary files are removed and training "
                             f"goes on with the persistent checkpoints (checkpoint.every={persistent_every}); give "
                             "checkpoint.local.dir a disk with room")
    return Verdict(False, f"{what}; no persistent checkpoint is configured to fall back on (checkpoint.every=0): "
                          "stopping after a save attempt; give checkpoint.local.dir a disk with room, or set "
                          "checkpoint.every")


def after_persistent(what: str, local_steps: Sequence[Optional[int]], local_every: int) -> Verdict:
    """A background persistent save failed: the local tier is the fallback when every rank has a complete
    local step (``local_steps``: each rank's newest, None for none)."""
    held = None if not local_steps or any(s is None for s in local_steps) else min(s for s in local_steps
                                                                                   if s is not None)
    if local_every and held is not None:
        return Verdict(True, f"{what}; training goes on: the local tier holds step {held} on every rank "
                             f"(checkpoint.local.every={local_every}) and the next persistent save tries again")
    why = ("the local tier holds no complete step yet" if local_every else
           "no other checkpoint tier is configured (checkpoint.local.every=0)")
    return Verdict(False, f"{what}; {why}: stopping after a save attempt")


def stop_message(line: str, saved: Optional[str], attempt_error: Optional[str]) -> str:
    """The stop's message: the report, then what the save attempt did."""
    if saved and not attempt_error:
        return f"{line}: checkpoint {saved} committed; relaunch with checkpoint.resume=auto to go on"
    return f"{line}: the save attempt failed too ({attempt_error or 'no checkpointer'}); nothing newer was saved"


def first_failure(messages: List[Optional[str]]) -> Dict[int, str]:
    """Every rank's failure message, by rank, from an allgather."""
    return {r: m for r, m in enumerate(messages) if m}
