"""Newton–Schulz orthogonalisation of a matrix (Muon's core).

The quintic iteration X <- a X + (b A + c A^2) X with A = X X^T and the
coefficients (a, b, c) = (3.4445, -4.7750, 2.0315) chosen (Keller Jordan's
Muon) to maximise the slope at zero: five steps map every singular value of
G / ||G||_F into roughly [0.7, 1.2], i.e. G ~ U S V^T becomes ~ U V^T. The
same arithmetic as ``torch.optim.Muon`` (``tests/unit/optimizers`` checks
them equal in bf16); ``dtype`` is where it runs: fp32 keeps one process and
every layout equal to fp32 rounding, bf16 is what GPU runs usually take.
"""
from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """~ U V^T of ``g`` (2-D, or a stack of matrices in its last two dims), in ``dtype``."""
    if g.dim() > 2:
        flat = g.reshape(-1, *g.shape[-2:])
        return torch.stack([orthogonalize(m, steps, dtype) for m in flat]).view(g.shape)
    a, b, c = COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def lr_scale(shape: torch.Size) -> float:
    """Moonshot's adjustment (Liu et al. 2025, "Muon is Scalable for LLM
    Training"): 0.2 * sqrt(max(A, B)) of an A x B matrix gives Muon's update
    the RMS of AdamW's, so one ``optim.lr`` (and weight decay) serves both
    parts; torch.optim.Muon's ``adjust_lr_fn="match_rms_adamw"``."""
    rows, cols = shape[-2], shape[-1]
    return 0.2 * max(rows, cols) ** 0.5
