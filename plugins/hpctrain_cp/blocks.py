"""Attention between chunks of a causal sequence, in fp32, with the
log-sum-exp kept so partial results can be merged (online softmax).

The sequence is cut into equal chunks; a rank holds some (``Chunks``), and
attention is computed chunk pair by chunk pair: query chunk a attends to key
chunk b fully when b < a, causally (a lower triangle) when b == a, and not
at all when b > a (skipped, no work). ``block_forward`` gives a query
chunk's partial output and log-sum-exp against one key chunk;
``merge`` folds partial results together; ``block_backward`` is the
flash-attention backward of one pair given the final output's log-sum-exp.

Grouped-query attention: k and v have fewer heads than q; query head i
uses key head i // (q heads / kv heads) (``expand_kv``; ``reduce_kv``
sums the gradients back).

On CPU a pair runs through torch's flash-attention kernel for CPU (the
aten op behind ``scaled_dot_product_attention``, which also returns the
log-sum-exp, and its backward, which takes the final output and
log-sum-exp as a ring needs); elsewhere, or when ``FUSED`` is off, through
the plain matrix products below (the reference the unit tests compare).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv_heads, t, d) -> (b, heads, t, d), each kv head repeated for its query heads."""
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``expand_kv``: (b, heads, t, d) summed back to (b, kv_heads, t, d)."""
    b, h, t, d = grad.shape
    group = h // kv_heads
    return grad if group == 1 else grad.view(b, kv_heads, group, t, d).sum(dim=2)


def pair_kind(q_chunk: int, k_chunk: int) -> Optional[str]:
    """How query chunk ``q_chunk`` sees key chunk ``k_chunk``: "full", "causal", or None (masked out)."""
    if k_chunk < q_chunk:
        return "full"
    return "causal" if k_chunk == q_chunk else None


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
FUSED = True
"""Use the fused CPU kernel where it exists (tests turn it off to check one against the other)."""


def _fused(q: torch.Tensor) -> bool:
    return FUSED and q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of fp32 query chunk ``q`` (b, h, c, d) against one key/value
    chunk (expanded to h heads): output (b, h, c, d), lse (b, h, c)."""
    if _fused(q):
        assert _FLASH_CPU is not None  # (_fused checked it)
        out, lse = _FLASH_CPU(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
        return out, lse
    s = _scores(q, k, scale, causal)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    return (p @ v) / denom, (m + torch.log(denom)).squeeze(-1)


def filled(parts: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """``parts`` (per query chunk), once every one is set."""
    out = [p for p in parts if p is not None]
    assert len(out) == len(parts), "every query chunk meets at least its own key chunk"
    return out


def merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], out_b: torch.Tensor,
          lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys -> their union's (online softmax)."""
    if out is None or lse is None:  # (set together)
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1), new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor, out: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one pair, all fp32 with h heads, from the final ``lse``
    of the query chunk and ``delta`` = rowsum(dout * out); the fused kernel
    takes ``out`` itself (it forms delta inside)."""
    if _fused(q) and out is not None:
        assert _FLASH_CPU_BACKWARD is not None  # (_fused checked it)
        dq, dk, dv = _FLASH_CPU_BACKWARD(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                         out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
        return dq, dk, dv
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv
