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


def deepseek_moe_config(**over):
    """The tiny DeepSeek-V3 with its second layer MoE: 8 routed experts of 32 in 4 groups, top-2 from the best
    2 groups, one shared expert, the routed weights renormalised and scaled by 2.5."""
    fields = dict(first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                  n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True)
    fields.update(over)
    return deepseek_config(**fields)


def draw_expert_bias(path: str, seed: int = 1) -> str:
    """Give the saved model's selection biases (``e_score_correction_bias``, buffers transformers saves as zeros)
    random values as large as the sigmoid scores' spread, so that they change which experts are chosen."""
    import os

    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.empty(tensors[name].shape).uniform_(-0.3, 0.3, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    return path
