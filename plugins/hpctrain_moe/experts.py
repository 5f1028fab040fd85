"""The experts' weights: SwiGLUs stacked on a leading expert dim.

``w1`` (gate) and ``w3`` (up) are (E, ffn_hidden, d_model), ``w2`` (down)
is (E, d_model, ffn_hidden): one logical tensor each, shape [experts, ...],
which is what checkpoints store and what ``parallel.ep`` splits (dim 0).
Each expert's slice is laid out like an ``nn.Linear`` weight.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.eager import eager
from hpctrain.model import amp
from hpctrain.model.shapes import ModelShape
from hpctrain.model.transformer import SwiGLU

Uses = Callable[[torch.Tensor], torch.Tensor]
"""How the layer sees a weight (identity, or a collective under sequence parallelism)."""


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


@eager
def _runs(rows: torch.Tensor, segments: List[Tuple[int, int]], w1: torch.Tensor, w3: torch.Tensor,
          w2: torch.Tensor) -> List[torch.Tensor]:
    """Each run (local expert, count) of ``rows`` through its expert. Never traced by torch.compile
    (``trainer.compile``): the runs' lengths are the routing's, new at almost every call, so dynamo
    recompiled the frame for each new set and, once it made them dynamic, built guards relating them that
    failed on the frame that made them (torch 2.13, "Guard failed on the same frame it was created": the
    DeepSeek-V3-style model at tp 2 compiled, tests/mpi/test_new_families_recompute_compile.py)."""
    outs, at = [], 0
    for e, n in segments:
        outs.append(swiglu(rows[at:at + n], w1[e], w3[e], w2[e]))  # n may be 0: empty in, empty out
        at += n
    return outs


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts; after the ep split this rank holds
    ``local`` of them, from ``first``."""

    param_init = {"w1": "normal", "w3": "normal", "w2": "normal_scaled"}

    def __init__(self, d_model: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.first, self.local = 0, num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, hidden))

    def forward(self, rows: torch.Tensor, segments: List[Tuple[int, int]], uses: Optional[Uses] = None,
                join: bool = True) -> Union[torch.Tensor, List[torch.Tensor]]:
        """``rows`` as consecutive runs of (local expert, count) -> each row's
        expert output, in the same order: one tensor, or (``join=False``) one
        per run, for a consumer that joins them where it needs them (the
        combine, into a buffer with room for the rows coming back)."""
        see = uses or (lambda w: w)
        w1, w3, w2 = see(self.w1), see(self.w3), see(self.w2)
        enabled, dtype = amp.autocast_state(rows.device.type)
        if enabled and w1.dtype != dtype:
            # autocast would cast each run's slice (w1[e] is a view, which its weight cache does not
            # keep) and save every cast for backward: one copy of an expert per run that reaches it,
            # the sources times the experts' weights. Cast the local stacks once per forward instead.
            w1, w3, w2 = w1.to(dtype), w3.to(dtype), w2.to(dtype)
        outs = _runs(rows, segments, w1, w3, w2)
        if not join:
            return outs
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def shared_experts(d_model: int, width: int) -> SwiGLU:
    """The shared experts every token passes through, as the core's dense SwiGLU of ``width`` = count x the
    experts' width (the sum of ``count`` SwiGLUs is one wider SwiGLU): tensor parallelism splits it like a
    dense block's feed-forward (``hpctrain.model.transformer.SwiGLU.linears``)."""
    return SwiGLU(ModelShape(vocab_size=1, d_model=d_model, n_layers=1, n_heads=1, n_kv_heads=1, ffn_hidden=width,
                             tie_embeddings=False))
