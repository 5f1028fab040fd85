"""Typed options of the MoE plugin: the ``model.moe`` config section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward blocks (used when ``model.ffn=moe``).

    Each expert is a SwiGLU of width ``ffn_hidden`` (``model.ffn_hidden`` unless set). Routing is computed
    in fp32 and, per token, picks ``top_k`` experts whose outputs are added
    with the router's weights.
    """

    num_experts: int = 8
    """Routed experts per MoE block (``parallel.ep`` must divide it)."""
    top_k: int = 2
    """Experts each token is sent to."""
    ffn_hidden: Optional[int] = None
    """Width of each routed (and shared) expert's SwiGLU; null: ``model.ffn_hidden``, which the dense blocks
    keep (Qwen3-MoE's moe_intermediate_size beside its intermediate_size; DeepSeek's likewise)."""
    norm_topk_prob: bool = True
    """top_k >= 2: true renormalises the k chosen weights to sum 1 (Mixtral; Qwen3-MoE and DeepSeek-V3 with
    norm_topk_prob=true); false keeps them as the router gives them, the softmax probabilities or the sigmoid
    scores (Qwen3-MoE's default). top_k=1 softmax always keeps the probability (Switch: renormalised it would
    be 1 and the router would get no gradient from the loss)."""
    capacity_factor: Optional[float] = None
    """null: dropless (every routed token is computed). A number c: each expert takes at most ceil(c * tokens
    * top_k / num_experts) tokens of a micro-batch; the rest of its assignments are dropped (the token
    keeps its residual and its other experts), first choices before second choices, and within one choice
    earlier tokens (sample, then position) first."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss num_experts * sum_e f_e * P_e (Switch/GShard form; f_e: share of the
    micro-batch's assignments routed to e, P_e: mean router probability of e); 1.0 unweighted means perfect
    balance."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss, the mean over tokens of logsumexp(router logits)^2 (ST-MoE)."""
    router: str = "softmax"
    """softmax: top-k of the softmax probabilities, weights renormalised over the k chosen (Mixtral; with
    top_k=1 the probability itself, Switch). sigmoid: DeepSeek-V3: sigmoid scores, the top k of score + a
    per-expert selection bias (transformers' e_score_correction_bias) that only selects: the weights are the
    chosen scores without it (normalised to sum 1 with norm_topk_prob)."""
    expert_groups: int = 1
    """sigmoid router: group-limited routing (DeepSeek-V3's n_group): the experts form this many groups of
    consecutive ids, each scored per token by the sum of its two best biased scores, and a token's experts come
    from its topk_groups best groups only. 1: no limit."""
    topk_groups: int = 1
    """Groups a token's experts may come from (DeepSeek-V3's topk_group; 4 of 8); at most expert_groups, and
    topk_groups x experts per group must reach top_k."""
    routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this after any normalisation (DeepSeek-V3: 2.5); the shared
    experts' output is not."""
    first_dense_blocks: int = 0
    """The first this many blocks keep the dense SwiGLU of width model.ffn_hidden (DeepSeek-V3's
    first_k_dense_replace: 3); the blocks after them follow ``every``."""
    aux_free_bias_rate: float = 0.001
    """sigmoid router: after every step each expert's selection bias moves by this much towards balance (up
    when it received fewer tokens than the mean over experts in that step, down when more); 0 keeps the
    biases fixed."""
    shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek's n_shared_experts), as one dense
    SwiGLU of width shared_experts x the experts' width (``ffn_hidden``), added to the routed output: split
    column/row-parallel over tp like the dense feed-forward, replicated over ep (a dense weight: its gradient
    is averaged over ep with the other data axes)."""
    every: int = 1
    """MoE in every k-th block: blocks i >= first_dense_blocks with (i + 1) % every == 0 (every=2: blocks 1,
    3, ...); the others keep the dense SwiGLU."""
