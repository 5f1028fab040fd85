"""Multi-token prediction (``model.mtp_depth``, ``model.mtp_loss_weight``):
DeepSeek-V3's MTP modules (technical report, section 2.2), for training.

Module k = 1..D sits after the main model and predicts the token k + 1
places ahead of each position, sequentially: for position i,

    h'_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]        (eq. 21)
    h^k    = TRM_k(h'^k)                                            (eq. 22)
    P^k_{i+k+1} = OutHead(h_i^k)                                    (eq. 23)
    L^k    = -1/T sum_i log P^k_{i+k+1}[t_{i+k+1}]                  (eq. 24)
    L      = L_main + lambda / D * sum_k L^k                        (eq. 25)

with the main model's embedding and output head shared (not copies), one
transformer block TRM_k of the main model's kind per module (an MoE block
when the model's blocks after the dense ones are MoE), and the projection
M_k (``eh_proj``, 2 d_model -> d_model). As DeepSeek's released weights and
transformers' ``MtpLayer`` have it: the embedding comes first in the
concatenation (``enorm``, then ``hnorm``), h^0 is the main model's hidden
state after its final norm, and each module normalises its block's output
(``norm``, the released ``shared_head.norm``) before the shared head and
before handing it to the next module.

Sequences of T positions: module k runs over all T (causal attention, so
the last k positions, which have no target, change nothing before them);
their embedded tokens are the ids shifted left by k (padded), their
targets the targets shifted left by k (padded with the ignored -100), and
L^k is normalised by T as in eq. 24 (with a loss mask: by the main loss's
counted targets, so lambda weighs it against the main loss as in one
process, whatever the layout). The loss ``Transformer.forward`` returns
stays the language-model loss; lambda / D * sum_k L^k joins the objective
through the auxiliary-loss channel (``mtp.loss``), weighted like the main
loss (``hpctrain.model.aux.add_aux_loss(..., like_loss=True)``).

Layouts: the modules live on the last pipeline stage, beside the head,
which then holds the embedding too (its gradient summed with the first
stage's, like a tied embedding). Tensor parallelism splits each module's
block as the model's and treats its norms as the model's; ``eh_proj`` stays
whole, its weight through ``eh_weight_view`` (summed over tp under sequence
parallelism). Under context parallelism the modules' attention is cp's,
like the model's, and the ids and targets k places ahead come from the
whole sequence (``MTP.ahead``: gathered over cp, a few integers per token).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.comm.differentiable import all_gather_along
from hpctrain.data.sequence import cp_positions
from hpctrain.mesh import Group
from hpctrain.model.aux import add_aux_loss, collecting
from hpctrain.model.shapes import ModelShape

IGNORED = -100
"""A target the loss skips (``CrossEntropy``'s ignore_index)."""


def _same(weight: torch.Tensor) -> torch.Tensor:
    return weight


def _positions(rank: int, size: int, seq_len: int) -> torch.Tensor:
    positions = cp_positions(rank, size, seq_len)
    assert positions is not None  # a sequence group has several ranks
    return positions


class MTPModule(nn.Module):
    """One depth of multi-token prediction (module docstring): ``enorm``, ``hnorm``, ``eh_proj``, ``block``
    and ``norm``; the embedding and head are the main model's."""

    def __init__(self, shape: ModelShape, eps: float, block: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * shape.d_model, shape.d_model, bias=False)
        self.block = block
        self.norm = norm()
        self.eh_weight_view: Callable[[torch.Tensor], torch.Tensor] = _same
        """The seam for ``eh_proj``'s weight as forward uses it (like ``RMSNorm.weight_view``: under sequence
        parallelism each tp rank projects its own tokens, and the weight's gradient is summed over tp)."""

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        both = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = F.linear(both, self.eh_weight_view(self.eh_proj.weight))
        return self.norm(self.block(x, cos, sin, segments))


class MTP(nn.Module):
    """The ``model.mtp_depth`` modules, in ``layers`` keyed by their block index after the main model's
    (``n_layers``, ``n_layers + 1``, ...: the index a plugin building the block was given)."""

    def __init__(self, modules: Dict[int, MTPModule], loss_weight: float):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): m for i, m in modules.items()})
        self.loss_weight = loss_weight
        self.sequence: Optional[Group] = None
        """The cp group when context parallelism splits each sequence over it in zigzag chunks (set by its
        plugin): the ids and targets k places ahead are taken from the whole sequence (``ahead``)."""

    def ahead(self, t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        """``t`` (batch, tokens: this rank's) moved k positions earlier along each sample's sequence, the
        last k positions ``fill``: what lies k places ahead of each token. Under context parallelism the
        rank's zigzag chunks are joined with the others' in position order first (integers, no gradient)."""
        seq = self.sequence
        if seq is None or seq.size == 1:
            return F.pad(t[:, k:], (0, k), value=fill)
        n = t.shape[1] * seq.size
        order = torch.cat([_positions(r, seq.size, n) for r in range(seq.size)]).to(t.device)
        gathered = all_gather_along(t, seq, dim=1)
        whole = torch.empty_like(gathered)
        whole[:, order] = gathered  # rank-major -> position order
        moved = F.pad(whole[:, k:], (0, k), value=fill)
        return moved[:, _positions(seq.rank, seq.size, n).to(t.device)]

    @property
    def depth(self) -> int:
        return len(self.layers)

    def modules_by_depth(self) -> List[MTPModule]:
        """Module 1, 2, ... (an axis plugin reaches their blocks, norms and projection through these)."""
        return [cast(MTPModule, m) for m in self.layers.values()]

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor,
                embed: nn.Module, head: nn.Module, loss_fn: nn.Module, cos: torch.Tensor, sin: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """lambda / D * sum_k L^k (module docstring) from the main model's normed final ``hidden``
        (batch, T, d), the micro-batch's token ids and targets (batch, T); None outside training
        (nothing collects auxiliary losses: the modules are not run)."""
        if not collecting():
            return None
        counted = (targets >= 0).sum().clamp(min=1)
        total: Optional[torch.Tensor] = None
        for k, module in enumerate(self.layers.values(), start=1):
            ids = self.ahead(tokens, k, 0)  # t_{i+k}; the padded positions have no target
            ahead = self.ahead(targets, k, IGNORED)  # t_{i+k+1}
            hidden = module(embed(ids), hidden, cos, sin, segments)
            # loss_fn gives the mean over its own counted targets: rescale to the main loss's count (eq. 24)
            part = loss_fn(head(hidden), ahead) * ((ahead >= 0).sum() / counted)
            total = part if total is None else total + part
        assert total is not None  # depth >= 1
        value = total * (self.loss_weight / self.depth)
        add_aux_loss("mtp.loss", value, like_loss=True)
        return value


def build_mtp(shape: ModelShape, eps: float, depth: int, loss_weight: float,
              make_block: Callable[[int], nn.Module], make_norm: Callable[[], nn.Module]) -> Optional[MTP]:
    """``depth`` modules (None for 0); ``make_block(i)`` builds the block of index i (after the main
    model's ``shape.n_layers``) as the main model's blocks are built."""
    if depth < 1:
        return None
    return MTP({shape.n_layers + k: MTPModule(shape, eps, make_block(shape.n_layers + k), make_norm)
                for k in range(depth)}, loss_weight)


def mtp_problems(cfg: Any) -> List[str]:
    """Bad ``model.mtp_*`` values, one line each."""
    m = cfg.model
    depth = m.get("mtp_depth", 0) if hasattr(m, "get") else getattr(m, "mtp_depth", 0)
    out: List[str] = []
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        return [f"model.mtp_depth={depth}: must be an integer >= 0 (0: no multi-token prediction; DeepSeek-V3: 1)"]
    weight = m.mtp_loss_weight
    if not (isinstance(weight, (int, float)) and 0 <= float(weight) < float("inf")):
        out.append(f"model.mtp_loss_weight={weight}: must be a finite number >= 0 (DeepSeek-V3: 0.3, then 0.1)")
    return out
