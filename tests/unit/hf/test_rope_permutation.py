"""The q/k row permutation of import and export makes HF's rotate_half RoPE compute
what our interleaved-pair RoPE computes."""
from __future__ import annotations

import torch

from hpctrain.hf.names import hf_name, rope_row_permutation
from hpctrain.model.transformer import apply_rope, rope_tables


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's convention: dims i and i + d/2 of a head share frequency i.
    x: (batch, seq, heads, head_dim); cos, sin: (seq, head_dim / 2)."""
    half = x.shape[-1] // 2
    c = torch.cat([cos, cos], -1)[None, :, None, :]
    s = torch.cat([sin, sin], -1)[None, :, None, :]
    return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s


def test_permuted_rows_give_the_same_rotated_queries_and_scores():
    torch.manual_seed(0)
    heads, kv_heads, hd, d, seq = 2, 1, 8, 16, 5
    wq, wk = torch.randn(heads * hd, d), torch.randn(kv_heads * hd, d)
    x = torch.randn(1, seq, d)
    cos, sin = rope_tables(torch.arange(seq), hd, 10000.0)
    q_ours = apply_rope((x @ wq.T).view(1, seq, heads, hd), cos, sin)
    k_ours = apply_rope((x @ wk.T).view(1, seq, kv_heads, hd), cos, sin)
    q_hf = rotate_half_rope((x @ wq[rope_row_permutation(heads, hd)].T).view(1, seq, heads, hd), cos, sin)
    k_hf = rotate_half_rope((x @ wk[rope_row_permutation(kv_heads, hd)].T).view(1, seq, kv_heads, hd), cos, sin)
    within = rope_row_permutation(1, hd)
    # Same products and sums in both conventions; a vectorised kernel may still
    # fuse a multiply-add differently, so allow float32 rounding (values ~1-10).
    torch.testing.assert_close(q_hf, q_ours[..., within], rtol=0, atol=1e-5)
    scores_ours = torch.einsum("bshd,bthd->bhst", q_ours, k_ours.expand(-1, -1, heads, -1))
    scores_hf = torch.einsum("bshd,bthd->bhst", q_hf, k_hf.expand(-1, -1, heads, -1))
    torch.testing.assert_close(scores_hf, scores_ours, rtol=1e-5, atol=1e-4)
    # Without the permutation the conventions disagree: the test can fail.
    q_wrong = rotate_half_rope((x @ wq.T).view(1, seq, heads, hd), cos, sin)
    assert not torch.allclose(q_wrong, q_ours, atol=1e-3)


def test_permutation_layout():
    assert rope_row_permutation(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_names():
    assert hf_name("layers.3.attn.wq.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("layers.0.ffn.w3.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("layers.0.ffn.experts.0.w1.weight") is None
