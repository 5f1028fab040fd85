"""Tiny random DeepSeek-V3 models for the tests (made with transformers' own classes, nothing downloaded):
every layer dense, multi-head latent attention with all its parts and yarn RoPE with both mscale terms.
Saved with ``hf_models.save``; ``qwen_models.hf_loss`` is transformers' own loss of any of them."""
from __future__ import annotations

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def deepseek_config(q_lora_rank=24, **over):
    """A tiny all-dense DeepSeek-V3: 4 heads of 8 + 8 q/k dims and 12 value dims, a key/value latent of 16,
    SEQ = 32 tokens over yarn's original context of 16 (every band of its ramp)."""
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_parameters=dict(YARN), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    fields.update(over)
    return DeepseekV3Config(**fields)
