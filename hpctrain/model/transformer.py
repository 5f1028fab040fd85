"""Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Replaceable parts: ``block.attn.core`` (core attention), ``block.ffn`` (the
feed-forward block: SwiGLU here, MoE from a plugin) and ``model.loss_fn``
(vocab-parallel cross-entropy from the TP plugin). Head counts are derived
from the projection widths at run time, so a tensor-parallel plugin that
narrows ``wq``/``wk``/``wv`` needs no change here.

Each module lists the initialisation of its parameters in ``param_init``
(default ``normal``); the builder turns that into the parameter's ShardSpec.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.model.shapes import ModelShape


class RMSNorm(nn.Module):
    param_init = {"weight": "ones"}

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin of shape (seq, head_dim/2) for the given absolute positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); rotates interleaved pairs (Llama convention)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    param_init = {}

    def __init__(self, shape: ModelShape, core: nn.Module):
        super().__init__()
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.d_model, shape.n_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.d_model, shape.kv_dim, bias=False)
        self.wv = nn.Linear(shape.d_model, shape.kv_dim, bias=False)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.d_model, bias=False)
        self.wo.param_init = {"weight": "normal_scaled"}
        self.core = core

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w1 = nn.Linear(shape.d_model, shape.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(shape.d_model, shape.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(shape.ffn_hidden, shape.d_model, bias=False)  # down
        self.w2.param_init = {"weight": "normal_scaled"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, eps: float, attention_core: nn.Module, ffn: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model, eps)
        self.attn = Attention(shape, attention_core)
        self.ffn_norm = RMSNorm(shape.d_model, eps)
        self.ffn = ffn

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class CrossEntropy(nn.Module):
    """Mean token cross-entropy in fp32 (replaced by a vocab-parallel version under TP)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape, eps: float, rope_theta: float, blocks: nn.ModuleList):
        super().__init__()
        self.shape = shape
        self.rope_theta = rope_theta
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.d_model)
        self.layers = blocks
        self.norm = RMSNorm(shape.d_model, eps)
        self.output = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loss_fn = CrossEntropy()

    def forward(
        self,
        tokens: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab), or the mean loss when ``targets`` is given.
        ``positions`` are absolute token positions (context parallelism passes
        its chunk's); default ``arange(seq)``."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_tables(positions, self.shape.head_dim, self.rope_theta)
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)
