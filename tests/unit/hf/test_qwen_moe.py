"""Qwen3-MoE in and out, exact against transformers (fp32, one process; tiny models made with transformers'
own ``Qwen3MoeConfig`` and saved in the test: 4 experts of width 32, top 2, qk-norm, head size 8):

- ``norm``: norm_topk_prob=true (the chosen probabilities renormalised), an MoE block in every layer;
- ``raw``: norm_topk_prob=false (transformers' default: the probabilities themselves);
- ``raw-step2``: norm_topk_prob=false with decoder_sparse_step=2 and mlp_only_layers=[0]: layer 0 a dense
  MLP of intermediate_size 96, layer 1 MoE (experts of moe_intermediate_size 32);
- ``norm-dense0``: norm_topk_prob=true, decoder_sparse_step=1 with mlp_only_layers=[0]: layer 0 dense
  (``model.moe.first_dense_blocks=1``), layer 1 MoE.

Imported, the logits equal transformers' within 1e-5 relative; the first training step's loss is
transformers' own loss (``labels=``; without output_router_logits it leaves out the balance loss, as our
logged loss does); after 2 training steps ``hpctrain-ckpt export`` writes Qwen3MoeForCausalLM, which
transformers loads with no missing or unexpected keys and whose logits equal the trained model's here. The
presets qwen3-30b-a3b and qwen3-235b-a22b have the parameter count transformers builds from the published
config.json (on the meta device).

The multi-rank proof (ep 2 x tp 2) is tests/mpi/test_qwen_moe.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from qwen_models import hf_loss, qwen3_moe_config, save

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.run import reference_trainer

from hf_models import (
    SEQ,
    assert_export_loads_with_our_logits,
    assert_logits_equal_transformers,
    imported_config,
)

BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", f"trainer.seq_len={SEQ}", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
MODELS = {
    "norm": lambda: qwen3_moe_config(norm_topk_prob=True),
    "raw": lambda: qwen3_moe_config(norm_topk_prob=False),
    "raw-step2": lambda: qwen3_moe_config(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[0]),
    "norm-dense0": lambda: qwen3_moe_config(norm_topk_prob=True, mlp_only_layers=[0]),
}


def _imported(path, pm, *more):
    return imported_config(BASE, path, pm, *more)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3moe")
    return {name: save(make(), root / name) for name, make in MODELS.items()}


def test_the_config_reads_as_qwen3_moe(dirs, pm):
    model = compose_resolved(["model=hf", f"model.hf_dir={dirs['raw-step2']}"], pm).model
    assert (model.ffn, model.qk_norm, model.qkv_bias, model.ffn_hidden) == ("moe", True, False, 96)
    moe = model.moe
    assert (moe.num_experts, moe.top_k, moe.router, moe.ffn_hidden, moe.norm_topk_prob, moe.every,
            moe.shared_experts, moe.aux_loss_coef) == (4, 2, "softmax", 32, False, 2, 0, 0.001)
    assert moe.first_dense_blocks == 0  # layer 0 is dense by decoder_sparse_step already
    norm = compose_resolved(["model=hf", f"model.hf_dir={dirs['norm']}"], pm).model.moe
    dense0 = compose_resolved(["model=hf", f"model.hf_dir={dirs['norm-dense0']}"], pm).model.moe
    assert (norm.norm_topk_prob, norm.every, norm.first_dense_blocks) == (True, 1, 0)
    assert (dense0.norm_topk_prob, dense0.every, dense0.first_dense_blocks) == (True, 1, 1)


@pytest.mark.parametrize("which", list(MODELS))
def test_logits_equal_transformers(dirs, pm, which):
    assert_logits_equal_transformers(_imported(dirs[which], pm), pm, dirs[which])


@pytest.mark.parametrize("which", ["norm", "raw-step2"])
def test_the_first_step_loss_is_transformers_own(dirs, pm, which):
    trainer = reference_trainer(_imported(dirs[which], pm), pm)
    first = trainer.orders.train[0].batch(range(4))  # step 1's global batch: 4 samples of seq_len + 1 tokens
    got = trainer.train_step()["loss"]
    want = hf_loss(dirs[which], first)
    assert abs(got - want) <= 1e-5 * want, (got, want)


@pytest.mark.parametrize("which", ["norm-dense0", "raw-step2"])
def test_export_after_training_loads_in_transformers_with_our_logits(dirs, pm, tmp_path, which):

    from hpctrain_h5ckpt import cli

    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "export")
    trainer = reference_trainer(_imported(dirs[which], pm, "trainer.steps=2", "checkpoint.every=2",
                                          f"checkpoint.dir={ckpt}"), pm)
    trainer.fit()
    assert cli.main(["export", ckpt, "--to", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    source = json.load(open(os.path.join(dirs[which], "config.json")))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    for key in ("norm_topk_prob", "decoder_sparse_step", "moe_intermediate_size", "intermediate_size",
                "num_experts_per_tok", "head_dim"):
        assert config[key] == source[key], key
    assert config["mlp_only_layers"] == ([0] if which == "norm-dense0" else [])  # the dense layers that matter
    assert config["num_experts"] == source["num_local_experts"] == 4  # transformers 5 writes the other name
    again = compose_resolved(["model=hf", f"model.hf_dir={out}"], pm).model  # and it reads back as it was
    assert again.moe == _imported(dirs[which], pm).model.moe and again.ffn_hidden == trainer.cfg.model.ffn_hidden
    assert_export_loads_with_our_logits(out, trainer.model, dirs[which])


@pytest.mark.parametrize("preset,layers,fields", [
    # Qwen/Qwen3-30B-A3B's and Qwen/Qwen3-235B-A22B's config.json (the presets cite them)
    ("qwen3-30b-a3b", 48, dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                               moe_intermediate_size=768)),
    ("qwen3-235b-a22b", 94, dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=64,
                                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=1536)),
], ids=["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_presets_count_what_transformers_builds(make_config, pm, preset, layers, fields):
    from transformers import AutoModelForCausalLM

    from hpctrain.hf.export import hf_config
    from hpctrain.model.build import build_model, logical_param_count

    config = qwen3_moe_config(vocab=151936, layers=layers, **fields)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    cfg = make_config(f"model={preset}")
    assert logical_param_count(build_model(cfg, pm)) == theirs
    exported = hf_config(cfg.model, "bfloat16")  # and the preset exports as the published architecture
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["norm_topk_prob"] is True
    assert {k: exported[k] for k in fields} == fields


def test_a_model_without_an_architecture_is_refused_on_export(make_config):
    from hpctrain.errors import ConfigError
    from hpctrain.hf.export import hf_config

    with pytest.raises(ConfigError, match=r"model.moe.router=sigmoid \(Qwen3-MoE: softmax\)"):
        hf_config(make_config("model=qwen3-30b-a3b", "model.moe.router=sigmoid").model, "float32")
    with pytest.raises(ConfigError, match=r"norm_topk_prob=false \(Mixtral: softmax, top_k >= 2, renormalised\)"):
        hf_config(make_config("model=tiny-moe", "model.moe.norm_topk_prob=false").model, "float32")


@pytest.mark.parametrize("override,given", [("model.moe.norm_topk_prob=true", "False"),
                                            ("model.moe.ffn_hidden=64", "32"),
                                            ("model.moe.first_dense_blocks=1", "0")])
def test_an_override_the_weights_contradict_is_refused(dirs, pm, override, given):
    cfg = compose_resolved(["model=hf", f"model.hf_dir={dirs['raw']}", override], pm)
    key, _, value = override.partition("=")
    assert validate(cfg, 1, pm) == [
        f"{key}={value.capitalize() if value in ('true', 'false') else value} disagrees with "
        f"model.hf_dir={dirs['raw']}, whose config.json gives {given}: the weights fix it; drop the override"]
