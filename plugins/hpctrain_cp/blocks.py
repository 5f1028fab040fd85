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

Document masking: a pair may also carry a document mask (``mask``,
(batch, 1, c, c), True where query and key are in the same document),
ANDed with the pair's causality. ``plan_pairs`` decides, from the chunks'
segment ids, which pairs have work: a pair whose chunks share no document
adds nothing and is left out; one whose chunks are one document in every
sample needs no mask. Within a masked pair a query row may see no key at
all (its document starts after the key chunk): its partial output is 0
and its log-sum-exp -inf, and ``merge`` folds such a part in as nothing
(two empty parts stay empty, no NaN). Every query sees at least itself
(the diagonal pair), so the final log-sum-exp of every row is finite and
the backward, which uses it, needs no special case.

On CPU a pair runs through torch's flash-attention kernel for CPU (the
aten op behind ``scaled_dot_product_attention``, which also returns the
log-sum-exp, and its backward, which takes the final output and
log-sum-exp as a ring needs); elsewhere, or when ``FUSED`` is off, through
the plain matrix products below (the reference the unit tests compare).
"""
from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from hpctrain.model.attention import document_mask


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


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU kernel takes this pair (it needs value heads as wide as query/key heads, which
    latent attention's are not: those pairs take the matrix products)."""
    return (FUSED and q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None
            and q.shape[-1] == v.shape[-1])


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values (b, kv_heads, t, dk) and (b, kv_heads, t, dv) as one tensor to send or gather: joined
    on the head dim, so dk and dv may differ (latent attention's value heads)."""
    return torch.cat([k, v], dim=-1).contiguous()


def unpack_kv(block: torch.Tensor, dk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``pack_kv``'s keys and values, from the key head size ``dk``."""
    return block[..., :dk], block[..., dk:]


def _allowed(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """A pair's document mask ANDed with its causality (the lower triangle on the diagonal)."""
    if not causal:
        return mask
    n = mask.shape[-1]
    return mask & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril_()


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fused kernel's mask: 0 where allowed, -inf elsewhere (it takes the query's dtype, not bool)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
            mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        return s.masked_fill(~_allowed(mask, causal), float("-inf"))
    if causal:
        n = s.shape[-1]
        upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of fp32 query chunk ``q`` (b, h, c, d) against one key/value
    chunk (expanded to h heads): output (b, h, c, d), lse (b, h, c).
    ``mask`` (b, 1, c, c), document masking: only where True (and causal
    when ``causal``); a row it leaves empty gives output 0 and lse -inf."""
    if mask is None:
        if _fused(q, v):
            assert _FLASH_CPU is not None  # (_fused checked it)
            out, lse = _FLASH_CPU(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
            return out, lse
        s = _scores(q, k, scale, causal)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        return (p @ v) / denom, (m + torch.log(denom)).squeeze(-1)
    allowed = _allowed(mask, causal)
    empty = ~allowed.any(dim=-1)  # (b, 1, c): rows that see no key of this chunk
    if _fused(q, v):
        assert _FLASH_CPU is not None  # (_fused checked it)
        out, lse = _FLASH_CPU(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, False,
                              attn_mask=_additive(allowed, q.dtype), scale=scale)
        # the kernel leaves an empty row's output 0 but its lse 0, not -inf
        return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).masked_fill(empty.unsqueeze(-1), 0.0)  # exp(-inf - 0) = 0, not NaN
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / denom.masked_fill(denom == 0, 1.0)  # an empty row: 0 / 1
    return out, (m + torch.log(denom)).squeeze(-1)  # an empty row: log 0 = -inf


def filled(parts: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """``parts`` (per query chunk), once every one is set."""
    out = [p for p in parts if p is not None]
    assert len(out) == len(parts), "every query chunk meets at least its own key chunk"
    return out


def merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], out_b: torch.Tensor,
          lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint keys -> their union's (online softmax).
    A row empty in both (lse -inf on both sides) stays output 0, lse -inf;
    a row empty on one side takes the other side's."""
    if out is None or lse is None:  # (set together)
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    ref = new.masked_fill(new == float("-inf"), 0.0)  # both empty: exp(-inf - 0) = 0, not exp(NaN)
    return out * torch.exp(lse - ref).unsqueeze(-1) + out_b * torch.exp(lse_b - ref).unsqueeze(-1), new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor, out: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one pair, all fp32 with h heads, from the final ``lse``
    of the query chunk and ``delta`` = rowsum(dout * out); the fused kernel
    takes ``out`` itself (it forms delta inside). ``mask`` as in
    ``block_forward`` (``lse``, the whole row's, is finite: a masked-out
    score contributes exp(-inf) = 0)."""
    if _fused(q, v) and out is not None:
        assert _FLASH_CPU_BACKWARD is not None  # (_fused checked it)
        if mask is None:
            dq, dk, dv = _FLASH_CPU_BACKWARD(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                             out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
        else:
            dq, dk, dv = _FLASH_CPU_BACKWARD(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                             out.contiguous(), lse.contiguous(), 0.0, False,
                                             attn_mask=_additive(_allowed(mask, causal), q.dtype), scale=scale)
        return dq, dk, dv
    p = torch.exp(_scores(q, k, scale, causal, mask) - lse.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


Pair = Tuple[int, int, bool]
"""(query chunk index, key chunk index, causal) of a pair with work."""


def plan_pairs(pairs: Iterable[Pair], q_segments: Optional[torch.Tensor], k_segments: Optional[torch.Tensor],
               c: int) -> Iterator[Tuple[int, int, bool, Optional[torch.Tensor]]]:
    """Each pair of ``pairs`` that has work, with its document mask (None: none needed).

    Without segments (``q_segments`` None), every pair, unmasked. With document
    masking, ``q_segments`` (b, queries) are the segment ids of the query chunks
    (chunk i: columns i*c .. (i+1)*c) and ``k_segments`` those of the key chunks
    ``pairs`` indexes: a pair whose chunks share no document in any sample is
    left out (every score masked: it would add output 0 with lse -inf, exactly
    nothing); a pair whose chunks hold one document in every sample keeps only
    its causality; any other gets its (b, 1, c, c) mask, built when the
    caller reaches it. The decisions for all ``pairs`` cost one device-to-host
    transfer. Skipping is compute only, so ranks stay in lock-step (their
    messages do not depend on it) and none does more work than without
    document masking."""
    pairs = list(pairs)
    if q_segments is None or not pairs:
        for i, j, causal in pairs:
            yield i, j, causal, None
        return
    assert k_segments is not None  # given with q_segments
    b = q_segments.shape[0]
    flags: List[torch.Tensor] = []
    for i, j, _ in pairs:
        qs, ks = q_segments[:, i * c:(i + 1) * c], k_segments[:, j * c:(j + 1) * c]
        both = torch.cat([qs, ks], dim=1)
        offset = torch.arange(b, device=qs.device)[:, None] * (both.max() + 1 - both.min())  # samples apart
        shared = torch.isin(qs - both.min() + offset, ks - both.min() + offset).any()
        single = (both == both[:, :1]).all()
        flags.append(torch.stack([shared, single]))
    decided = torch.stack(flags).tolist()
    for (i, j, causal), (shared, single) in zip(pairs, decided):
        if not shared:
            continue
        mask = None if single else document_mask(q_segments[:, i * c:(i + 1) * c], k_segments[:, j * c:(j + 1) * c])
        yield i, j, causal, mask
