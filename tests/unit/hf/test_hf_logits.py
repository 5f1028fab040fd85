"""A Hugging Face model imported into hpctrain computes transformers' own logits
(fp32, one process, within 1e-5 relative): Llama with GQA 4:1 and Llama 3.1
rope scaling, the same with tied embeddings, Mistral, and a Mixtral with 4
experts and top-2. The models are made and saved in the test."""
from __future__ import annotations

import pytest
import torch

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.run import reference_trainer

from hf_models import SEQ, batch, hf_logits, llama_config, mixtral_config, save


def hpctrain_logits(path, ids, pm, plain_rope=False):
    cfg = compose_resolved(["model=hf", f"model.hf_dir={path}", f"checkpoint.init_from=hf:{path}",
                            f"trainer.seq_len={SEQ}"], pm)
    assert validate(cfg, 1, pm) == []
    model = reference_trainer(cfg, pm).model
    model.eval()
    if plain_rope:
        model.rope_scaling = None
    with torch.no_grad():
        return model(ids)


def assert_close(ours, theirs, rtol=1e-5):
    scale = theirs.abs().max()
    err = (ours - theirs).abs().max()
    assert err <= rtol * scale, f"max abs difference {err:.3g} > {rtol} x {scale:.3g}"


def mistral_config():
    from transformers import MistralConfig

    return MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                         sliding_window=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


@pytest.mark.parametrize("make", [
    lambda: llama_config(),
    lambda: llama_config(tie=True),
    mistral_config,
    mixtral_config,
], ids=["llama-gqa-llama3-rope", "llama-tied", "mistral", "mixtral-4x-top2"])
def test_logits_equal_transformers(tmp_path, pm, make):
    path = save(make(), tmp_path / "hf")
    ids = batch()
    theirs = hf_logits(path, ids)
    ours = hpctrain_logits(path, ids, pm)
    assert ours.shape == theirs.shape
    assert_close(ours, theirs)


def test_llama3_rope_scaling_matters(tmp_path, pm):
    """The llama3 scaling changes the logits at this length (else the test above could not catch it)."""
    path = save(llama_config(), tmp_path / "hf")
    ids = batch()
    plain = hpctrain_logits(path, ids, pm, plain_rope=True)
    assert (plain - hf_logits(path, ids)).abs().max() > 1e-3


def test_the_published_llama31_spelling_is_read(tmp_path, pm):
    """Published Llama 3.1 checkpoints spell RoPE as top-level rope_theta + rope_scaling (transformers 4) and
    list several EOS ids: read as such, and the logits still equal transformers' (which reads the same file)."""
    import json

    path = save(llama_config(), tmp_path / "hf")
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    config["eos_token_id"] = [2, 5, 7]
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    cfg = compose_resolved(["model=hf", f"model.hf_dir={path}"], pm)
    assert cfg.model.rope_scaling.type == "llama3" and cfg.model.rope_theta == 500000.0
    assert list(cfg.model.eos_token_id) == [2, 5, 7]
    ids = batch()
    assert_close(hpctrain_logits(path, ids, pm), hf_logits(path, ids))
