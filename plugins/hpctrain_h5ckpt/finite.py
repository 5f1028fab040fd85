"""Whether a tensor read from a checkpoint holds only finite values, at the cost of one sum.

``torch.isfinite(t).all()`` writes a bool tensor as large as ``t`` and reads
it again: on one core it took several times longer than reading the
checkpoint itself (docs/benchmarks.md, "Checkpoint load"). A sum reads ``t``
once and is exact in one direction: IEEE arithmetic carries any NaN or
infinity into the sum (inf + finite = inf, inf - inf = NaN, NaN + x = NaN),
so a finite sum proves every element finite. A non-finite sum is either a
real NaN/inf or finite values whose sum overflowed; only then is the exact
elementwise check run, so the answer is always exact.
"""
from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    """True when every element of ``t`` is finite (integers always are)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    # float32 accumulation: bf16/fp16 sums would overflow at sizes checkpoints have
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())
