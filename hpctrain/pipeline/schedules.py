"""Pipeline schedules as pure functions: each rank's ordered actions.

With p pipeline ranks and v model chunks per rank there are p v virtual
stages; rank r holds stages r, r + p, ..., r + (v-1) p (Megatron-LM's
interleaved assignment; v = 1 is the plain pipeline). A micro-batch goes
forward through the stages in order and backward in reverse.

``actions(schedule, p, v, m)[r]`` is rank r's program: compute actions
``F`` (forward), ``B`` (backward: the input gradient, and the weight
gradient too unless the schedule splits it off) and ``W`` (the weight
gradient alone, zero-bubble schedules), each for one (micro-batch, chunk),
with the point-to-point actions they need: ``RECV_F`` right before a
forward whose input comes from another stage, ``SEND_F`` right after it,
``RECV_B`` / ``SEND_B`` likewise for the gradient going back. The
executor posts sends without waiting and waits for each receive where it
stands, so a program runs without deadlock exactly when the simulator
(``simulate``) finds that every rank can always make progress.

Compute orders (k counts a rank's forward or backward slots):

- ``gpipe``: every forward, then every backward, in micro-batch order.
- ``1f1b``: rank r runs ``min(p - r - 1, m)`` forwards, then alternates one
  forward and one backward, then the remaining backwards; it holds at most
  ``p - r`` micro-batches' activations (Narayanan et al. 2021).
- ``interleaved``: the same with v chunks (Megatron-LM's order: slot k
  is chunk ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p``,
  backward chunks in reverse), ``2 (p - r - 1) + (v - 1) p`` warm-up
  forwards; m must be a multiple of p.
- ``zb-h1``: 1F1B's order with each backward split into B (input gradient,
  on the critical path) and W (weight gradient); rank r holds back the W's
  of its first r backwards, then runs one held W after each backward, and
  the last r W's end its step, where later stages would otherwise wait for
  the earlier ones' backwards (Qi et al. 2023, ZB-H1: 1F1B's activation
  memory and about a third of its bubble when F, B and W take equal time).

``forward_actions(p, v, m)`` is the forward-only program validation runs
under every schedule: each rank's forwards in the training schedule's
forward order (micro-batch order; the interleaved slot order with v
chunks), with their sends and receives, and nothing kept for a backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: str
    """F, B, W (compute) or SEND_F, RECV_F, SEND_B, RECV_B."""
    microbatch: int
    chunk: int = 0
    """Model chunk on this rank (its virtual stage is chunk * p + rank)."""
    peer: int = -1
    """The other pipeline rank of a send or receive."""

    def __str__(self) -> str:
        peer = (f"->{self.peer}" if self.kind.startswith("SEND")
                else f"<-{self.peer}" if self.kind.startswith("RECV") else "")
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "") + peer


def check(schedule: str, p: int, v: int, m: int) -> str:
    """'' when ``schedule`` can run with these sizes, else why not (and the fix)."""
    if schedule not in SCHEDULES:
        return f"parallel.pipeline.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}"
    if v < 1 or (schedule == "interleaved") != (v > 1):
        return (f"parallel.pipeline.vpp={v} goes with schedule=interleaved and only with it (vpp >= 2 there, "
                "1 otherwise)")
    if m < 1:
        return "no micro-batches"
    if schedule == "interleaved" and m % p:
        return (f"the interleaved schedule needs the micro-batches per step ({m}) to be a multiple of parallel.pp "
                f"({p}); change trainer.global_batch_size or trainer.micro_batch_size")
    return ""


def check_busy(p: int, m: int) -> str:
    """'' when ``m`` micro-batches per step keep ``p`` stages busy, else why not and the fix.

    The schedules themselves run with fewer (``check``); the pipeline plugin
    refuses such a run and the planner does not offer one (each stage would idle more than it works)."""
    if p > 1 and m < p:
        return (f"{m} micro-batches per step cannot keep {p} pipeline stages busy (each would idle "
                f"more than it works); raise trainer.global_batch_size or lower "
                f"trainer.micro_batch_size so that global batch / (micro-batch x dp x ep) >= {p}")
    return ""


def compute_order(schedule: str, p: int, v: int, m: int, rank: int) -> List[Tuple[str, int, int]]:
    """Rank ``rank``'s compute actions (kind, micro-batch, chunk) in order."""
    problem = check(schedule, p, v, m)
    if problem:
        raise ValueError(problem)
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        return _one_f_one_b(m, min(p - rank - 1, m), lambda k: (k, 0), lambda k: (k, 0))
    if schedule == "interleaved":
        def fwd(k: int) -> Tuple[int, int]:
            return (k // (p * v)) * p + k % p, (k // p) % v

        def bwd(k: int) -> Tuple[int, int]:
            return (k // (p * v)) * p + k % p, v - 1 - (k // p) % v

        warmup = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
        return _one_f_one_b(m * v, warmup, fwd, bwd)
    # zb-h1: 1F1B's forwards and backwards, each backward split into B and W;
    # rank r holds back the W of its first r backwards and catches up one W
    # per backward afterwards, the last r W's ending the step
    warmup = min(p - rank - 1, m)
    out: List[Tuple[str, int, int]] = [("F", k, 0) for k in range(warmup)]
    pending: List[int] = []
    for k in range(m):
        if k + warmup < m:
            out.append(("F", k + warmup, 0))
        out.append(("B", k, 0))
        pending.append(k)
        if k >= rank:
            out.append(("W", pending.pop(0), 0))
    out += [("W", k, 0) for k in pending]
    return out


def _one_f_one_b(slots: int, warmup: int, fwd, bwd) -> List[Tuple[str, int, int]]:
    out = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(slots - warmup):
        out.append(("F", *fwd(k + warmup)))
        out.append(("B", *bwd(k)))
    out += [("B", *bwd(k)) for k in range(slots - warmup, slots)]
    return out


def stage_of(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def place(stage: int, p: int) -> Tuple[int, int]:
    """(rank, chunk) holding virtual stage ``stage``."""
    return stage % p, stage // p


def forward_order(p: int, v: int, m: int) -> List[Tuple[str, int, int]]:
    """Every rank's forwards of a forward-only step (the same on every rank)."""
    if v > 1 and m % p:
        raise ValueError(check("interleaved", p, v, m))
    # the interleaved slot order (k // p) % v: p micro-batches through a chunk, then the next chunk
    return [("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)] if v > 1 else \
        [("F", i, 0) for i in range(m)]


def actions(schedule: str, p: int, v: int, m: int) -> Dict[int, List[Action]]:
    """Every rank's program: its compute order with the sends and receives it needs."""
    return {rank: _with_transfers(compute_order(schedule, p, v, m, rank), rank, p, v) for rank in range(p)}


def forward_actions(p: int, v: int, m: int) -> Dict[int, List[Action]]:
    """Every rank's forward-only program (validation), with its transfers."""
    return {rank: _with_transfers(forward_order(p, v, m), rank, p, v) for rank in range(p)}


def _with_transfers(order: List[Tuple[str, int, int]], rank: int, p: int, v: int) -> List[Action]:
    """``order``'s compute actions on ``rank`` with the receive before each
    that needs another stage's output and the send after each that feeds one."""
    last = p * v - 1
    prog: List[Action] = []
    for kind, mb, chunk in order:
        s = stage_of(rank, chunk, p)
        if kind == "F":
            if s > 0:
                prog.append(Action("RECV_F", mb, chunk, place(s - 1, p)[0]))
            prog.append(Action("F", mb, chunk))
            if s < last:
                prog.append(Action("SEND_F", mb, chunk, place(s + 1, p)[0]))
        elif kind == "B":
            if s < last:
                prog.append(Action("RECV_B", mb, chunk, place(s + 1, p)[0]))
            prog.append(Action("B", mb, chunk))
            if s > 0:
                prog.append(Action("SEND_B", mb, chunk, place(s - 1, p)[0]))
        else:
            prog.append(Action("W", mb, chunk))
    return prog


def splits_weight_pass(schedule: str) -> bool:
    """Whether B leaves the weight gradients to a separate W action."""
    return schedule == "zb-h1"
