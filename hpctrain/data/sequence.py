"""How context parallelism splits a sequence over the ``cp`` ranks.

Causal attention makes later tokens more expensive (they attend to more
keys), so contiguous quarters would load the last rank most. The sequence is
cut into ``2 * cp`` equal chunks and rank ``i`` holds chunks ``i`` and
``2 * cp - 1 - i``: one cheap and one expensive chunk each, the same work on
every rank (the zigzag layout of Megatron and torchtitan). Positions are the
tokens' true positions, which RoPE and the causal mask use.
"""
from __future__ import annotations

from typing import List, Optional

import torch


def valid_seq_lens(seq_len: int, cp: int) -> List[int]:
    """The multiples of ``2 * cp`` nearest ``seq_len`` (below and above)."""
    m = 2 * cp
    below = (seq_len // m) * m
    return [n for n in (below, below + m) if n > 0]


def cp_positions(cp_rank: int, cp_size: int, seq_len: int) -> Optional[torch.Tensor]:
    """The positions of ``seq_len`` that cp rank ``cp_rank`` holds, ascending
    (None when cp is 1: every position)."""
    if cp_size == 1:
        return None
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 * cp = {chunks}")
    c = seq_len // chunks
    first, second = cp_rank, chunks - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])
