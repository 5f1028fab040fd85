"""Qwen2 (q/k/v biases) and Qwen3 (qk-norm; also with a head size other than hidden / heads) in and out,
exact against transformers (fp32, one process; the models are made with transformers' own classes and
saved in the test):

- imported, the logits equal transformers' within 1e-5 relative;
- the first training step's loss is transformers' own loss (``labels=``) on that step's batch;
- after 2 training steps, ``hpctrain-ckpt export`` writes the family's architecture, transformers loads it
  with no missing or unexpected keys, and its logits equal those of the trained model here;
- the presets qwen3-8b and qwen2-7b have the parameter count transformers builds from the published
  config.json (on the meta device: nothing is allocated).

The multi-rank proofs (tp with sequence parallelism x cp, tp x dp) are tests/mpi/test_qwen.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from qwen_models import hf_loss, qwen2_config, qwen3_config, save

from hpctrain.config import compose_resolved
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
    "qwen2": lambda: qwen2_config(),
    "qwen2-tied": lambda: qwen2_config(tie=True),
    "qwen3": lambda: qwen3_config(),
    "qwen3-head16": lambda: qwen3_config(head_dim=16),
}


def _imported(path, pm, *more):
    return imported_config(BASE, path, pm, *more)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return {name: save(make(), root / name) for name, make in MODELS.items()}


def test_the_config_reads_as_the_family(dirs, pm):
    two = compose_resolved(["model=hf", f"model.hf_dir={dirs['qwen2']}"], pm).model
    three = compose_resolved(["model=hf", f"model.hf_dir={dirs['qwen3-head16']}"], pm).model
    assert (two.qkv_bias, two.qk_norm, two.head_dim, two.rope_theta) == (True, False, None, 1e6)
    assert (three.qkv_bias, three.qk_norm, three.head_dim) == (False, True, 16)


@pytest.mark.parametrize("which", list(MODELS))
def test_logits_equal_transformers(dirs, pm, which):
    assert_logits_equal_transformers(_imported(dirs[which], pm), pm, dirs[which])


@pytest.mark.parametrize("which", ["qwen2", "qwen3"])
def test_the_first_step_loss_is_transformers_own(dirs, pm, which):
    trainer = reference_trainer(_imported(dirs[which], pm), pm)
    first = trainer.orders.train[0].batch(range(4))  # step 1's global batch: 4 samples of seq_len + 1 tokens
    got = trainer.train_step()["loss"]
    want = hf_loss(dirs[which], first)
    assert abs(got - want) <= 1e-5 * want, (got, want)


@pytest.mark.parametrize("which,arch", [("qwen2", "Qwen2ForCausalLM"), ("qwen3-head16", "Qwen3ForCausalLM")])
def test_export_after_training_loads_in_transformers_with_our_logits(dirs, pm, tmp_path, which, arch):

    from hpctrain_h5ckpt import cli

    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "export")
    trainer = reference_trainer(_imported(dirs[which], pm, "trainer.steps=2", "checkpoint.every=2",
                                          f"checkpoint.dir={ckpt}"), pm)
    trainer.fit()
    assert cli.main(["export", ckpt, "--to", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == [arch] and config["use_sliding_window"] is False
    assert_export_loads_with_our_logits(out, trainer.model, dirs[which])


def test_both_options_have_no_architecture_to_export(make_config):
    from hpctrain.errors import ConfigError
    from hpctrain.hf.export import hf_config

    with pytest.raises(ConfigError, match="model.qkv_bias=true with model.qk_norm=true"):
        hf_config(make_config("model.qkv_bias=true", "model.qk_norm=true").model, "float32")


@pytest.mark.parametrize("preset,make", [
    # Qwen/Qwen3-8B's config.json (hpctrain/conf/model/qwen3-8b.yaml cites it)
    ("qwen3-8b", lambda: qwen3_config(vocab=151936, layers=36, hidden_size=4096, intermediate_size=12288,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    # Qwen/Qwen2-7B's config.json
    ("qwen2-7b", lambda: qwen2_config(vocab=152064, layers=28, hidden_size=3584, intermediate_size=18944,
                                      num_attention_heads=28, num_key_value_heads=4)),
], ids=["qwen3-8b", "qwen2-7b"])
def test_presets_count_what_transformers_builds(make_config, preset, make):
    from transformers import AutoModelForCausalLM

    from hpctrain.model.build import build_model, logical_param_count
    from hpctrain.model.shapes import ModelShape

    with torch.device("meta"):
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(make()).parameters())
    cfg = make_config(f"model={preset}")
    assert logical_param_count(build_model(cfg)) == theirs == ModelShape.from_config(cfg.model).total_params
