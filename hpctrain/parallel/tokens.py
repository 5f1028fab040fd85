"""Where the tokens a block sees live across the model-parallel axes: the
core's rule, for parts of the model that count or route tokens themselves
(an MoE layer's statistics and capacity).

- ``tp`` with sequence parallelism: between sub-layers each tp rank holds
  1/tp of every micro-batch's sequence, so a block's feed-forward input
  differs by tp rank (``split``);
- ``tp`` without it: every tp rank holds the same tokens (``copies``), so a
  statistic counts them on tp rank 0 only;
- ``cp``: each cp rank holds its zigzag share of every sequence
  (``hpctrain.data.sequence.SequenceLayout``), and values that are the same
  on every cp rank (the micro-batch's loss) count on cp rank 0 only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpctrain.mesh import Group, Mesh


@dataclass(frozen=True)
class TokenPlacement:
    split: Optional[Group] = None
    """The group whose ranks each hold a different part of every sequence's tokens
    in a block (tp under sequence parallelism), or None."""
    copies: Optional[Group] = None
    """The group whose ranks all hold the same tokens (tp without sequence parallelism), or None."""
    sequence: Optional[Group] = None
    """The cp group: its ranks hold the zigzag shares of every sequence, or None."""
    counts_tokens: bool = True
    """Whether this rank's tokens count in a statistic (not a copy held by another rank first)."""
    counts_values: bool = True
    """Whether this rank counts values every rank of the tp and cp groups holds alike (a micro-batch's loss)."""


def token_placement(mesh: Optional[Mesh], sequence_parallel: bool) -> TokenPlacement:
    """The placement for ``mesh`` (None: one process, every token here)."""
    if mesh is None:
        return TokenPlacement()
    sequence = mesh.group("cp") if mesh.size("cp") > 1 else None
    first_cp = mesh.rank("cp") == 0
    if mesh.size("tp") == 1:
        return TokenPlacement(sequence=sequence, counts_values=first_cp)
    first_tp = mesh.rank("tp") == 0
    if sequence_parallel:
        return TokenPlacement(split=mesh.group("tp"), sequence=sequence, counts_values=first_tp and first_cp)
    return TokenPlacement(copies=mesh.group("tp"), sequence=sequence, counts_tokens=first_tp,
                          counts_values=first_tp and first_cp)
