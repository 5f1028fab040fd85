"""The MoE feed-forward block: route, (drop,) dispatch, experts, combine.

Per micro-batch of N tokens (this rank's; under sequence parallelism its
sequence shard): fp32 router logits -> top-k routing (``router.route``) ->
with a capacity, the assignments each expert keeps (``capacity``) -> the
load-balancing loss and z-loss into the auxiliary-loss channel, the step
statistics into ``LayerStats`` (training forwards only) -> the tokens to
their experts and back (``dispatch``) -> plus the shared experts.

The shared experts (``MoEConfig.shared_experts``) are the core's dense
SwiGLU, so tensor parallelism splits them column/row-parallel as it splits
a dense block's feed-forward (through its ``linears`` seam, on the layer's
input as the block gives it); expert parallelism leaves them whole (dense
weights: the data axes average their gradients over ep).

Regions. Under tensor parallelism the layer is replicated over tp. Without
sequence parallelism the tp ranks hold the same tokens and compute the
same thing. With it (``token_split``: the tp group), each holds a shard of
the micro-batch's tokens, so (a) the balance statistics and the capacity
priority are formed over the whole micro-batch (counts all-reduced, the
expert choices all-gathered along the sequence), and (b) every weight goes
through ``copy_to_region`` (forward identity, backward all-reduce), so each
rank's gradient is the sum over all the micro-batch's tokens.

Under context parallelism (``sequence``: the cp group) each rank holds
zigzag chunks of every sequence: the balance statistics are all-reduced
over cp as well, the capacity priority runs over the gathered choices put
back in position order, and since the data axes average gradients over cp,
the auxiliary losses are scaled by cp (each rank's tokens then get the
gradient of the one-process loss). The losses' values, counted once, are
cp rank 0's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from hpctrain.comm.differentiable import all_gather_along, copy_to_region, reduce_from_region
from hpctrain.data.sequence import cp_positions
from hpctrain.mesh import Group
from hpctrain.model.aux import add_aux_loss, collecting
from hpctrain.model.recompute import recomputing

from hpctrain_moe.capacity import expert_capacity, keep_mask
from hpctrain_moe.config import MoEConfig
from hpctrain_moe.dispatch import combine, dispatch, plan_dispatch
from hpctrain_moe.experts import GroupedExperts, shared_experts
from hpctrain_moe.router import Router, assignment_counts, balance_loss, route, z_loss
from hpctrain_moe.stats import LayerStats


def _positions(cp_rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    positions = cp_positions(cp_rank, cp_size, seq_len)
    assert positions is not None  # a sequence group has several ranks
    return positions


@dataclass
class MoERegions:
    """The groups one MoE layer talks to (None: a group of one)."""

    ep: Optional[Group] = None
    """Expert parallelism: the ranks that split the experts (set by the ep split)."""
    token_split: Optional[Group] = None
    """The tp group when sequence parallelism splits each micro-batch's tokens over it."""
    counts_tokens: bool = True
    """Whether this rank's tokens count in the step statistics (tp ranks without
    sequence parallelism hold the same tokens: only tp rank 0's count)."""
    counts_values: bool = True
    """Whether this rank adds the micro-batch's loss values to the statistics (tp rank 0)."""
    sequence: Optional[Group] = None
    """The cp group when context parallelism splits each sequence over it (zigzag chunks)."""


class MoE(nn.Module):
    """A mixture-of-experts feed-forward block (see the module docstring)."""

    def __init__(self, d_model: int, hidden: int, cfg: MoEConfig, regions: Optional[MoERegions] = None):
        super().__init__()
        self.cfg = cfg
        self.regions = regions or MoERegions()
        hidden = cfg.ffn_hidden or hidden  # the experts' own width (Qwen3-MoE, DeepSeek), else the dense one
        self.router = Router(d_model, cfg.num_experts, cfg.top_k, cfg.router)
        self.experts = GroupedExperts(d_model, hidden, cfg.num_experts)
        self.shared = shared_experts(d_model, hidden * cfg.shared_experts) if cfg.shared_experts else None
        self.stats = LayerStats(cfg.num_experts)
        self.last_keep: Optional[torch.Tensor] = None
        """The last forward's kept assignments (N, k) with a capacity (tests compare drops)."""

    def _uses(self, weight: torch.Tensor) -> torch.Tensor:
        group = self.regions.token_split
        return copy_to_region(weight, group) if group is not None else weight

    def _keep(self, experts: torch.Tensor, batch: int) -> torch.Tensor:
        """The assignments within capacity, decided over the whole micro-batch
        in the true token order: this rank's choices are gathered along the
        sequence (over the tp shard, then over the cp ranks' zigzag chunks,
        put back in position order), and this rank keeps its own part."""
        split, seq = self.regions.token_split, self.regions.sequence
        n, k = experts.shape
        whole = experts.view(batch, n // batch, k)
        if split is not None:
            whole = all_gather_along(whole, split, dim=1)
        if seq is not None:
            per_rank = whole.shape[1]
            order = torch.cat([_positions(r, seq.size, per_rank * seq.size) for r in range(seq.size)])
            gathered = all_gather_along(whole, seq, dim=1)
            whole = torch.empty_like(gathered)
            whole[:, order.to(whole.device)] = gathered  # rank-major -> position order
        factor = self.cfg.capacity_factor
        assert factor is not None  # asked with a capacity only
        cap = expert_capacity(whole.shape[0] * whole.shape[1], k, self.cfg.num_experts, float(factor))
        keep = keep_mask(whole.reshape(-1, k), self.cfg.num_experts, cap).view(batch, -1, k)
        if seq is not None:
            mine = _positions(seq.rank, seq.size, keep.shape[1]).to(keep.device)
            keep = keep[:, mine]
        if split is not None:
            s = n // batch
            keep = keep[:, split.rank * s:(split.rank + 1) * s]
        return keep.reshape(n, k)

    def _balance(self, routing, keep: Optional[torch.Tensor], n: int) -> None:
        """The auxiliary losses of this micro-batch and its statistics."""
        cfg = self.cfg
        local_counts = assignment_counts(routing.experts, cfg.num_experts)
        counts, prob_sum, lse_sq, tokens = local_counts, routing.balance_probs.sum(0), routing.lse.pow(2).sum(), n
        for group in (self.regions.token_split, self.regions.sequence):
            if group is not None:  # the whole micro-batch's statistics on every rank that holds part of it
                counts = reduce_from_region(counts, group)
                prob_sum = reduce_from_region(prob_sum, group)
                lse_sq = reduce_from_region(lse_sq, group)
                tokens = tokens * group.size
        balance = balance_loss(counts, prob_sum, tokens, cfg.top_k)
        z = z_loss(lse_sq, tokens)
        # Each cp rank backpropagates the whole micro-batch's loss through its own
        # tokens, and the data axes then *average* over cp: scale by cp so that the
        # gradients sum over the sequence as in one process (tp sums by itself).
        scale = self.regions.sequence.size if self.regions.sequence is not None else 1
        if cfg.aux_loss_coef:
            add_aux_loss("moe.aux_loss", cfg.aux_loss_coef * scale * balance)
        if cfg.z_loss_coef:
            add_aux_loss("moe.z_loss", cfg.z_loss_coef * scale * z)
        dropped = (~keep).sum() if keep is not None else torch.zeros((), device=local_counts.device)
        if recomputing() or not self.training:  # counted once per training forward (validation is not a step's)
            return
        self.stats.add(local_counts, dropped, float(routing.experts.numel()), balance, z,
                       1.0 if self.regions.counts_tokens else 0.0, 1.0 if self.regions.counts_values else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, d = x.shape[0], x.shape[-1]
        tokens = x.reshape(-1, d)
        n = tokens.shape[0]
        cfg = self.cfg
        routing = route(self.router.logits(tokens, self._uses(self.router.weight)), cfg.top_k, cfg.router,
                        self.router.expert_bias, cfg.norm_topk_prob, cfg.expert_groups, cfg.topk_groups,
                        cfg.routed_scaling_factor)
        keep = self._keep(routing.experts, batch) if self.cfg.capacity_factor is not None else None
        self.last_keep = keep
        if collecting():
            self._balance(routing, keep, n)
        plan = plan_dispatch(routing.experts, routing.weights, keep, self.cfg.num_experts, self.regions.ep)
        rows = dispatch(tokens, plan, self.regions.ep)
        out = combine(self.experts(rows, plan.segments, self._uses, join=False), plan, self.regions.ep, n)
        out = out.view_as(x)
        if self.shared is not None:  # on x as given: tp's sequence-parallel seam gathers along its sequence dim
            out = out + self.shared(x)
        return out
