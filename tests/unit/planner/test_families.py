"""The planner counts the 2026 model families as they are built (issue 56): head_dim and qk-norm (Qwen3),
the experts' own width (``model.moe.ffn_hidden``), leading dense blocks, shared experts, multi-head latent
attention and multi-token prediction. Whole published models are built on the meta device by transformers
(the same classes and config.json values the presets cite) and by hpctrain itself; the active counts are the
publishers' figures."""
from __future__ import annotations

import pytest
import torch

PRESETS = {
    # Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2-Lite config.json
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        tie_word_embeddings=False)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
        tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3, tie_word_embeddings=False)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, tie_word_embeddings=False)),
}


def _arch(make_config, *overrides):
    from hpctrain.planner.arch import Arch

    return Arch.from_model_config(make_config(*overrides).model)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_planner_counts_what_transformers_and_hpctrain_build(make_config, pm, preset):
    import transformers

    from hpctrain.model.build import build_model, logical_param_count

    kind, fields = PRESETS[preset]
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**fields))
    cfg = make_config(f"model={preset}")
    arch = _arch(make_config, f"model={preset}")
    assert arch.total_params == sum(p.numel() for p in theirs.parameters())
    assert arch.total_params == logical_param_count(build_model(cfg, pm))
    # one GPU holding everything: the per-rank block counts (memory's) add up to the same
    blocks = sum(arch.layer_params_per_rank(1, 1, moe=arch.is_moe_layer(i)) for i in range(arch.n_layers))
    assert blocks + 2 * arch.vocab_size * arch.d_model + arch.d_model == arch.total_params


@pytest.mark.parametrize("preset,total,active,places", [
    ("deepseek-v3", 671e9, 37e9, 0),  # the technical report: 671B total, 37B activated per token
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 1),  # Qwen3's model card: 30.5B, 3.3B activated
    ("qwen3-235b-a22b", 235e9, 22e9, 0),
])
def test_active_parameters_are_the_published_figures(make_config, preset, total, active, places):
    arch = _arch(make_config, f"model={preset}")
    assert round(arch.total_params / 1e9, places) == total / 1e9
    assert round(arch.active_params / 1e9, places) in (active / 1e9, active / 1e9 + 10 ** -places)  # 37.55B: "37B"
    # MFU's numerator is 6 x the active matmul parameters + attention, not 6 x all parameters
    from hpctrain.planner.compute import model_flops_per_token

    s = 4096
    assert model_flops_per_token(arch, s) == pytest.approx(
        6 * arch.matmul_params + 3 * arch.n_layers * arch.attention_core_flops_per_token(s))
    assert model_flops_per_token(arch, s) < 0.2 * 6 * arch.total_params


def test_deepseek_v3_active_count_by_hand(make_config):
    """37B from the parts: embedding and head, 61 latent attentions, 3 dense SwiGLUs of 18432, and in 58 MoE
    blocks 8 routed + 1 shared expert of 2048 and the router."""
    arch = _arch(make_config, "model=deepseek-v3")
    h, v = 7168, 129280
    mla = h * 1536 + 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 + 512 * 128 * (128 + 128) + 128 * 128 * h
    hand = 2 * v * h + 61 * (mla + 2 * h) + 3 * 3 * h * 18432 + 58 * (9 * 3 * h * 2048 + 256 * h) + h
    assert arch.active_params == hand


def test_multi_token_prediction_is_counted_as_hpctrain_builds_it(make_config, pm):
    from hpctrain.model.build import build_model, logical_param_count

    overrides = ("model=deepseek-v2-lite", "model.mtp_depth=2")
    arch = _arch(make_config, *overrides)
    plain = _arch(make_config, "model=deepseek-v2-lite")
    assert arch.total_params == logical_param_count(build_model(make_config(*overrides), pm))
    assert arch.total_params - plain.total_params == 2 * arch.mtp_module_params
    assert arch.mtp_is_moe and arch.active_params - plain.active_params < arch.mtp_module_params
    # memory: one GPU holds the modules with the head
    from hpctrain.planner.stages import _stage_params

    dense, expert, _ = _stage_params(arch, 1, 1, 1, ((0, arch.n_layers),), True, True)
    assert dense + expert == arch.total_params
