"""A DeepSeek-V3 with MoE layers out (fp32, one process): the tiny random ``DeepseekV3ForCausalLM`` of
tests/deepseek_models.py whose second layer is MoE (8 experts in 4 groups, top-2 from the best 2, a shared
expert, random selection biases), imported, trained 2 steps (the selection biases move after each step), then
``hpctrain-ckpt export``: transformers loads the directory with no missing or unexpected keys, its logits
equal the trained model's within 1e-5 relative, its ``e_score_correction_bias`` are our routers' moved biases
(from the checkpoint's buffers), and the directory reads back as the same model config. (With multi-token
prediction: tests/unit/hf/test_deepseek_mtp_export.py.)"""
from __future__ import annotations

import json
import os

import torch
from deepseek_models import deepseek_moe_config, draw_expert_bias
from safetensors.torch import load_file

from hpctrain.config import compose_resolved
from hpctrain.hf.config import read_hf_config
from hpctrain.run import reference_trainer

from hf_models import SEQ, batch, hf_logits, hf_model, save

BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", f"trainer.seq_len={SEQ}", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")


def test_export_after_training_loads_in_transformers_with_our_logits_and_biases(pm, tmp_path):
    from transformers import AutoModelForCausalLM

    from hpctrain_h5ckpt import cli

    src = draw_expert_bias(save(deepseek_moe_config(), tmp_path / "hf"))
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "export")
    cfg = compose_resolved(BASE + hf_model(src) + ("trainer.steps=2", "checkpoint.every=2", f"checkpoint.dir={ckpt}",
                                                   "model.moe.aux_free_bias_rate=0.01"), pm)
    trainer = reference_trainer(cfg, pm)
    trainer.fit()
    assert cli.main(["export", ckpt, "--to", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["first_k_dense_replace"] == 1
    assert (config["n_routed_experts"], config["n_group"], config["topk_group"], config["n_shared_experts"],
            config["routed_scaling_factor"]) == (8, 4, 2, 1, 2.5)
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = trainer.model.layers[1].ffn.router.expert_bias
    original = load_file(os.path.join(src, "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert (ours - original).abs().max() > 1e-3  # the biases moved in training ...
    torch.testing.assert_close(hf.model.layers[1].mlp.gate.e_score_correction_bias, ours, rtol=0, atol=0)  # ... out
    ids = batch()
    model = trainer.model
    model.eval()
    with torch.no_grad():
        want = model(ids)
        got = hf.eval()(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got - hf_logits(src, ids)).abs().max() > 1e-3  # two steps changed the model
    shape = {k: v for k, v in read_hf_config(out, SEQ)[0].items() if k not in ("name", "max_seq_len")}
    assert shape == {k: v for k, v in read_hf_config(src, SEQ)[0].items() if k in shape}

