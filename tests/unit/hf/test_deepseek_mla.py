"""DeepSeek-V3's multi-head latent attention in and out, exact against transformers (fp32, one process; tiny
random ``DeepseekV3ForCausalLM`` models made with transformers' own classes and saved in the test, yarn RoPE
scaling on, with both mscale terms so that cos/sin and the softmax scale change; all dense, and one whose
second layer is MoE: 8 experts in 4 groups, top-2 from the best 2, a shared expert, random selection biases):

- yarn's inverse frequencies and factors are transformers' own (``_compute_yarn_parameters``,
  ``yarn_apply_mscale``);
- imported, with the low-rank query (q_lora_rank, DeepSeek-V3's) and with the plain query projection
  (q_lora_rank null, DeepSeek-V2-Lite's), and with the MoE layer (read as the MoE plugin's DeepSeek routing,
  the selection bias into the router's buffer), the logits equal transformers' within 1e-5 relative;
- the first training step's loss is transformers' own loss (``labels=``) on that step's batch;
- after 2 training steps, ``hpctrain-ckpt export`` of the dense model writes a DeepseekV3ForCausalLM that
  transformers loads with no missing or unexpected keys, with the trained model's logits, and that reads back as
  the same model;
- the presets deepseek-v3 and deepseek-v2-lite have the parameter count transformers builds from the
  published config.json (671,026,404,352 and 15,706,484,224; their MoE layers are the MoE plugin's), and one
  layer's latent attention too.

The multi-rank proofs (tp with and without sequence parallelism x cp, ring and all-gather) are
tests/mpi/test_mla.py; what is refused (another RoPE type, rope_interleave=false, attention_bias,
fewer key/value heads, yarn's attention_factor or truncate=false), one line each, rows of
tests/unit/config/test_bad_hf.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from deepseek_models import deepseek_config, deepseek_moe_config, draw_expert_bias
from qwen_models import hf_loss

from hpctrain.config import compose_resolved
from hpctrain.hf.config import read_hf_config
from hpctrain.run import reference_trainer

from hf_models import (
    SEQ,
    assert_export_loads_with_our_logits,
    assert_logits_equal_transformers,
    imported_config,
    save,
)

BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", f"trainer.seq_len={SEQ}", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
MODELS = {"q-lora": lambda: deepseek_config(), "plain-q": lambda: deepseek_config(q_lora_rank=None),
          "moe": lambda: deepseek_moe_config()}


def _imported(path, pm, *more):
    return imported_config(BASE, path, pm, *more)


def hf_buffer(path, name):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))[name]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    out = {name: save(make(), root / name) for name, make in MODELS.items()}
    draw_expert_bias(out["moe"])
    return out


def test_yarn_is_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from hpctrain.model.yarn import YarnScaling

    config = deepseek_config()
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    ours = YarnScaling(4.0, 16, 32.0, 1.0, 1.0, 0.8)
    assert torch.equal(ours.inv_freq(8, 10000.0), inv_freq)
    assert ours.attention_factor == attention_factor != 1.0
    assert ours.softmax_factor == yarn_apply_mscale(config.rope_parameters, 1.0) != 1.0


def test_the_config_reads_as_latent_attention(dirs, pm):
    m = compose_resolved(["model=hf", f"model.hf_dir={dirs['q-lora']}"], pm).model
    assert (m.attention_kind, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_hidden) == ("mla", 4, 4, None, 96)
    assert dict(m.mla) == {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                           "v_head_dim": 12}
    rs = m.rope_scaling
    assert (rs.type, rs.factor, rs.original_max_seq_len, rs.mscale, rs.mscale_all_dim) == ("yarn", 4.0, 16, 1.0, 0.8)
    plain = compose_resolved(["model=hf", f"model.hf_dir={dirs['plain-q']}"], pm).model
    assert plain.mla.q_lora_rank is None


def test_the_moe_layers_read_as_deepseek_routing(dirs, pm):
    m = compose_resolved(["model=hf", f"model.hf_dir={dirs['moe']}"], pm).model
    assert (m.ffn, m.ffn_hidden) == ("moe", 96)
    moe = m.moe
    assert (moe.router, moe.num_experts, moe.top_k, moe.expert_groups, moe.topk_groups, moe.shared_experts,
            moe.ffn_hidden, moe.first_dense_blocks, moe.routed_scaling_factor, moe.norm_topk_prob) == \
        ("sigmoid", 8, 2, 4, 2, 1, 32, 1, 2.5, True)


@pytest.mark.parametrize("which", list(MODELS))
def test_logits_equal_transformers(dirs, pm, which):
    assert_logits_equal_transformers(_imported(dirs[which], pm), pm, dirs[which])


@pytest.mark.parametrize("which", ["q-lora", "moe"])
def test_the_first_step_loss_is_transformers_own(dirs, pm, which):
    trainer = reference_trainer(_imported(dirs[which], pm), pm)
    if which == "moe":  # the selection bias came in (a buffer)
        bias = trainer.model.layers[1].ffn.router.expert_bias
        assert torch.equal(bias, hf_buffer(dirs[which], "model.layers.1.mlp.gate.e_score_correction_bias"))
    first = trainer.orders.train[0].batch(range(4))  # step 1's global batch: 4 samples of seq_len + 1 tokens
    got = trainer.train_step()["loss"]
    want = hf_loss(dirs[which], first)
    assert abs(got - want) <= 1e-5 * want, (got, want)


def test_export_after_training_loads_in_transformers_with_our_logits(dirs, pm, tmp_path):

    from hpctrain_h5ckpt import cli

    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "export")
    trainer = reference_trainer(_imported(dirs["q-lora"], pm, "trainer.steps=2", "checkpoint.every=2",
                                          f"checkpoint.dir={ckpt}"), pm)
    trainer.fit()
    assert cli.main(["export", ckpt, "--to", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["first_k_dense_replace"] == 2
    assert config["rope_scaling"]["rope_type"] == "yarn" and "head_dim" not in config
    assert_export_loads_with_our_logits(out, trainer.model, dirs["q-lora"])
    shape = {k: v for k, v in read_hf_config(out, SEQ)[0].items() if k not in ("name", "max_seq_len")}
    assert shape == {k: v for k, v in read_hf_config(dirs["q-lora"], SEQ)[0].items() if k in shape}


def _v3():  # deepseek-ai/DeepSeek-V3's config.json (hpctrain/conf/model/deepseek-v3.yaml cites it)
    return deepseek_config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                           num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                           n_routed_experts=256, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3)


def _v2_lite():  # deepseek-ai/DeepSeek-V2-Lite's config.json (hpctrain/conf/model/deepseek-v2-lite.yaml)
    from transformers import DeepseekV2Config

    return DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                            num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                            n_routed_experts=64, num_experts_per_tok=6, q_lora_rank=None, kv_lora_rank=512,
                            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1)


@pytest.mark.parametrize("preset,make", [("deepseek-v3", _v3), ("deepseek-v2-lite", _v2_lite)],
                         ids=["deepseek-v3", "deepseek-v2-lite"])
def test_presets_count_what_transformers_builds(make_config, pm, preset, make):
    """The whole model (671,026,404,352 and 15,706,484,224 parameters: the MoE layers are the MoE plugin's)
    and one layer's latent attention (ModelShape's closed form too), on the meta device."""
    from transformers import AutoModelForCausalLM

    from hpctrain.model.build import build_model, logical_param_count
    from hpctrain.model.shapes import ModelShape

    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(make())
    cfg = make_config(f"model={preset}")
    ours = build_model(cfg, pm)
    assert logical_param_count(ours) == sum(p.numel() for p in theirs.parameters())
    attention = ModelShape.from_config(cfg.model).attention_params
    assert sum(p.numel() for p in ours.layers[0].attn.parameters()) == attention \
        == sum(p.numel() for p in theirs.model.layers[0].self_attn.parameters())
