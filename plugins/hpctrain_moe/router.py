"""The router: which experts each token goes to, with what weight, and the
losses that keep the experts balanced. Everything here runs in fp32.

``route`` is a pure function of the logits (and the sigmoid router's
selection bias); the balance statistics are sums over the tokens given, so
a caller whose micro-batch is split over ranks (sequence parallelism) adds
them up over those ranks before forming the losses (``balance_loss``,
``z_loss``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from hpctrain.model import amp

ROUTERS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One micro-batch's routing (N tokens)."""

    experts: torch.Tensor
    """(N, k) int64: the chosen experts, best first."""
    weights: torch.Tensor
    """(N, k) fp32: the weight of each chosen expert's output (differentiable)."""
    balance_probs: torch.Tensor
    """(N, E) fp32: each token's probability over all experts, the P of the balance loss (differentiable)."""
    lse: torch.Tensor
    """(N,) fp32: logsumexp of the logits, for the z-loss (differentiable)."""


def limit_groups(pick: torch.Tensor, groups: int, topk_groups: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: ``pick`` (N, E), the scores experts are chosen by, with every
    expert outside each token's ``topk_groups`` best groups set to -inf. The experts form ``groups`` groups
    of consecutive ids; a group's score is the sum of its two best ``pick`` values (as transformers'
    DeepseekV3TopkRouter)."""
    n, e = pick.shape
    per_group = pick.view(n, groups, e // groups)
    group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(topk_groups, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return pick.masked_fill(~allowed.repeat_interleave(e // groups, dim=1), float("-inf"))


def route(logits: torch.Tensor, top_k: int, kind: str, bias: Optional[torch.Tensor] = None,
          norm_topk_prob: bool = True, expert_groups: int = 1, topk_groups: int = 1,
          routed_scaling_factor: float = 1.0) -> Routing:
    """Route N tokens from their (N, E) fp32 logits (see ``MoEConfig``: ``router``, ``norm_topk_prob``,
    ``expert_groups``/``topk_groups`` (sigmoid router) and ``routed_scaling_factor``)."""
    if kind == "softmax":
        probs = logits.softmax(dim=-1)
        if top_k == 1 or not norm_topk_prob:  # Switch, Qwen3-MoE's default: the probabilities themselves
            weights, experts = probs.topk(top_k, dim=-1)
        else:  # Mixtral: softmax over the chosen logits (the chosen probabilities renormalised)
            chosen, experts = logits.topk(top_k, dim=-1)
            weights = chosen.softmax(dim=-1)
        balance = probs
    elif kind == "sigmoid":
        scores = logits.sigmoid()
        pick = scores if bias is None else scores + bias  # the bias selects; the weights are the scores
        if expert_groups > 1:
            pick = limit_groups(pick, expert_groups, topk_groups)
        experts = pick.topk(top_k, dim=-1).indices
        chosen = scores.gather(-1, experts)
        weights = chosen / chosen.sum(dim=-1, keepdim=True) if norm_topk_prob else chosen
        balance = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"model.moe.router={kind!r}: choose one of {', '.join(ROUTERS)}")
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return Routing(experts, weights, balance, torch.logsumexp(logits, dim=-1))


def assignment_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) fp32: how many of the (N, k) assignments each expert got (before any drop)."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts).to(torch.float32)


def balance_loss(counts: torch.Tensor, prob_sum: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Switch/GShard load balance, E * sum_e f_e * P_e, from the micro-batch's
    assignment ``counts`` (f_e = counts_e / (tokens * k), not differentiable)
    and the sum over its tokens of the balance probabilities (P_e = sum / tokens).
    1.0 when both are uniform."""
    num_experts = counts.numel()
    f = counts / (tokens * top_k)
    return num_experts * (f * (prob_sum / tokens)).sum()


def z_loss(lse_square_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """ST-MoE router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return lse_square_sum / tokens


def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the selection bias of
    experts that got fewer than the mean load this step, lower the others'."""
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))


class Router(nn.Module):
    """The router's weight (E, d_model) and, for the sigmoid router, the
    per-expert selection bias (a buffer: not trained by gradients, saved in
    checkpoints, updated after each step by ``update_bias``)."""

    param_init = {"weight": "normal"}

    def __init__(self, d_model: int, num_experts: int, top_k: int, kind: str):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"model.moe.router={kind!r}: choose one of {', '.join(ROUTERS)}")
        self.num_experts, self.top_k, self.kind = num_experts, top_k, kind
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.expert_bias: Optional[torch.Tensor]
        if kind == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def logits(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(N, E) fp32 logits of (N, d) tokens; ``weight`` is ``self.weight`` as the layer uses it."""
        with amp.autocast(tokens.device.type, enabled=False):  # fp32 even under bf16 autocast
            return tokens.float() @ weight.float().t()
