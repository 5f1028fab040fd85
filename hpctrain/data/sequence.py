"""How context parallelism splits a sequence over the ``cp`` ranks.

Causal attention makes later tokens more expensive (they attend to more
keys), so contiguous quarters would load the last rank most. The sequence is
cut into ``2 * cp`` equal chunks and rank ``i`` holds chunks ``i`` and
``2 * cp - 1 - i``: one cheap and one expensive chunk each, the same work on
every rank (the zigzag layout of Megatron and torchtitan). Positions are the
tokens' true positions, which RoPE and the causal mask use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """Which of ``2 * cp`` equal chunks of the sequence each cp rank holds,
    in ascending order. The one definition the data cursor, context
    parallelism's attention, MoE's token priorities and the benchmarks use."""

    chunks: Tuple[Tuple[int, ...], ...]
    """Per cp rank, its chunk indices."""

    @classmethod
    def zigzag(cls, cp: int) -> "SequenceLayout":
        """Rank i holds chunks i and 2cp-1-i (the training layout)."""
        return cls(tuple((i, 2 * cp - 1 - i) for i in range(cp)))

    @classmethod
    def contiguous(cls, cp: int) -> "SequenceLayout":
        """Rank i holds chunks 2i and 2i+1 (the benchmark's unbalanced comparison)."""
        return cls(tuple((2 * i, 2 * i + 1) for i in range(cp)))

    def positions(self, rank: int, chunk: int) -> torch.Tensor:
        """The positions rank ``rank`` holds, for chunks of ``chunk`` tokens."""
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in self.chunks[rank]])


def valid_seq_lens(seq_len: int, cp: int) -> List[int]:
    """The multiples of ``2 * cp`` nearest ``seq_len`` (below and above)."""
    m = 2 * cp
    below = (seq_len // m) * m
    return [n for n in (below, below + m) if n > 0]


def cp_positions(cp_rank: int, cp_size: int, seq_len: int) -> Optional[torch.Tensor]:
    """The positions of ``seq_len`` that cp rank ``cp_rank`` holds in the
    zigzag layout, ascending (None when cp is 1: every position)."""
    if cp_size == 1:
        return None
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 * cp = {chunks}")
    return SequenceLayout.zigzag(cp_size).positions(cp_rank, seq_len // chunks)
