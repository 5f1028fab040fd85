"""Blended sampling: which source each sample of the stream comes from.

Megatron's rule: sample ``n`` (0-based) goes to the source whose share is
furthest behind its weight, ``argmax_k (w_k * (n + 1) - c_k)`` where ``c_k``
counts the samples source ``k`` has had so far (ties to the lowest index).
At every prefix of the stream each source's count is then within one sample
of ``w_k * n``. The rule is sequential, so the state is the counts: the
cursor keeps them (a few integers, saved in checkpoints) and each step
assigns its global batch from them, on every rank alike, whatever the
layout.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np


def normalised(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"blend weights must be finite, >= 0 and not all 0: {list(weights)}")
    return w / w.sum()


def assign(weights: np.ndarray, counts: Sequence[int], n: int) -> Tuple[np.ndarray, np.ndarray, List[int]]:
    """The next ``n`` samples after a stream whose sources have had ``counts``:
    each one's source, its index within that source, and the counts after."""
    c = np.asarray(counts, dtype=np.int64).copy()
    total = int(c.sum())
    sources = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    for i in range(n):
        k = int(np.argmax(weights * (total + i + 1) - c))
        sources[i], local[i] = k, c[k]
        c[k] += 1
    return sources, local, [int(x) for x in c]
