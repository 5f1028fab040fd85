"""Vocab-parallel embedding, output projection and cross-entropy.

The vocabulary is padded (``hpctrain.model.shapes.padded_vocab``) and cut
into tp equal row ranges; rank r holds rows ``[r V'/tp, (r+1) V'/tp)`` of the
embedding and of the output projection (one tensor when they are tied).
Padding rows are zero, get no gradient (their logits are masked out of the
softmax) and are not part of the logical tensor, so no checkpoint holds them.

The logits are never gathered: each rank has its columns of every token's
logits, and the loss needs only three reductions over tp per token: the max
(for a stable softmax), the sum of exponentials and the target's logit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.comm.differentiable import all_reduce_copy, reduce_from_region
from hpctrain.comm.protocol import ReduceOp
from hpctrain.mesh import Group

from hpctrain_tp.regions import TensorParallelRegions


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the table; other tokens give zeros,
    and the ranks' partial embeddings are summed on the way out."""

    def __init__(self, weight: nn.Parameter, start: int, regions: TensorParallelRegions):
        super().__init__()
        self.weight = weight
        self.start = start
        self.regions = regions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = tokens - self.start
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.clamp(0, rows - 1), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.regions.exit(out)


class VocabParallelHead(nn.Module):
    """This rank's columns of the logits (its rows of the output projection)."""

    def __init__(self, weight: nn.Parameter, regions: TensorParallelRegions):
        super().__init__()
        self.weight = weight
        self.regions = regions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.regions.columns(x, [self.weight])[0]


class VocabParallelCrossEntropy(nn.Module):
    """Mean token cross-entropy in fp32 from vocab-split logits over the
    targets that count (a negative target, a loss mask's 0, adds neither loss
    nor count; none: 0), as the core's ``CrossEntropy``; every tp rank gets
    the whole loss. The gradient reaches each rank's own columns only."""

    def __init__(self, group: Group, start: int, vocab_size: int):
        super().__init__()
        self.group = group
        self.start = start
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float().flatten(0, -2)
        targets = targets.flatten()
        cols = logits.shape[-1]
        if self.start + cols > self.vocab_size:  # padding columns here (known on the host: no device sync)
            padding = torch.arange(self.start, self.start + cols, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
        with torch.no_grad():  # the shift cancels out of the loss: no gradient through it
            top = all_reduce_copy(logits.max(dim=-1).values, self.group, ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        sum_exp = reduce_from_region(shifted.exp().sum(dim=-1), self.group)
        local = targets - self.start
        mine = (local >= 0) & (local < cols)
        picked = shifted.gather(-1, local.clamp(0, cols - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = reduce_from_region(torch.where(mine, picked, torch.zeros_like(picked)), self.group)
        counted = targets >= 0  # a negative target (a loss mask's 0) adds neither loss nor count
        losses = sum_exp.log() - target_logit
        return torch.where(counted, losses, torch.zeros_like(losses)).sum() / counted.sum().clamp(min=1)
