"""DeepSeek-V3's multi-token prediction module in and out of Hugging Face (fp32, one process).

A model of the tiny random ``DeepseekV3ForCausalLM`` of tests/deepseek_models.py's shape (latent attention,
layer 1 MoE: 8 experts in 4 groups, a shared expert) with ``model.mtp_depth=1`` (its MTP block an MoE block)
is trained 2 steps from our own init (its norms drawn away from ones) and exported with ``hpctrain-ckpt export``:

- the MTP module is DeepSeek's extra layer ``model.layers.2`` (``num_nextn_predict_layers`` 1), laid out as
  DeepSeek-V3's README_WEIGHTS.md describes its layer 61: every tensor of a decoder layer (the same names and
  shapes as layer 1's), plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the shared
  ``embed_tokens`` and ``shared_head.head`` (equal to the main model's);
- transformers' ``DeepseekV3ForCausalLM`` loads the directory with nothing missing, leaves exactly the MTP
  layer's tensors out, and computes the trained model's logits (within 1e-5);
- transformers' own ``MtpModel`` (what ``generate(use_mtp=True)`` drafts with) reads the MTP layer from the
  export and computes our MTP loss from its logits (within 1e-5);
- ``model=hf checkpoint.init_from=hf:<export> model.mtp_depth=1`` imports it back: the same MTP loss and
  logits, bit for bit.

A model with MTP that DeepseekV3 cannot hold is refused in one line, and so is an import asking for MTP
layers the directory does not have."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from deepseek_models import deepseek_moe_config, draw_expert_bias
from safetensors import safe_open

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.errors import ConfigError
from hpctrain.hf.export import hf_config
from hpctrain.model.aux import collect_aux_losses
from hpctrain.run import reference_trainer

from hf_models import SEQ, assert_export_loads_with_our_logits, hf_model, save

BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", f"trainer.seq_len={SEQ}", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
MTP = ("model.mtp_depth=1", "model.mtp_loss_weight=0.3")
MTP_OWN = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight"}
"""DeepSeek-V3's MTP-specific tensors of its layer 61 (README_WEIGHTS.md: embed_tokens and shared_head.head
shared with the main model, enorm, hnorm, eh_proj and shared_head.norm its own), beside a decoder layer's."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the transformers model the shape came from, the export, our trained model)."""
    from hpctrain.plugins import create_manager

    from hpctrain_h5ckpt import cli

    pm = create_manager()
    d = tmp_path_factory.mktemp("mtp")
    src = draw_expert_bias(save(deepseek_moe_config(), d / "hf"))
    cfg = compose_resolved(BASE + ("model=hf", f"model.hf_dir={src}") + MTP + (
        "trainer.steps=2", "checkpoint.every=2", f"checkpoint.dir={d / 'ck'}", "model.moe.aux_free_bias_rate=0.01",
        "optim.warmup_steps=0", "optim.lr=0.01"), pm)
    trainer = reference_trainer(cfg, pm)
    with torch.no_grad():  # norms away from ones (our init), so that a norm left out or swapped shows
        g = torch.Generator().manual_seed(5)
        for name, p in trainer.model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
    trainer.fit()
    assert cli.main(["export", str(d / "ck"), "--to", str(d / "out")]) == 0
    return src, str(d / "out"), trainer.model


def _batch():
    stream = torch.randint(0, 300, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return stream[:, :-1], stream[:, 1:]


def _mtp_loss(model, ids, targets) -> float:
    """Our MTP term (lambda / D * sum_k L^k, ``mtp.loss``) of the batch."""
    with torch.no_grad(), collect_aux_losses() as aux:
        model(ids, targets)
    return aux.by_name()["mtp.loss"]


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_mtp_module_is_deepseeks_extra_layer(exported):
    _, out, model = exported
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    tensors = _tensors(out)
    layer = {k[len("model.layers.2."):]: v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    decoder = {k[len("model.layers.1."):]: v.shape for k, v in tensors.items() if k.startswith("model.layers.1.")}
    assert set(layer) == set(decoder) | MTP_OWN
    assert all(layer[k].shape == shape for k, shape in decoder.items())
    assert layer["eh_proj.weight"].shape == (64, 128) and layer["enorm.weight"].shape == (64,)
    assert torch.equal(layer["embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(layer["shared_head.head.weight"], tensors["lm_head.weight"])
    mtp = model.mtp.layers["2"]
    for ours, theirs in ((mtp.eh_proj.weight, "eh_proj.weight"), (mtp.norm.weight, "shared_head.norm.weight"),
                         (mtp.block.attn.wkv_b.weight, "self_attn.kv_b_proj.weight"),
                         (mtp.block.ffn.router.expert_bias, "mlp.gate.e_score_correction_bias")):
        assert torch.equal(ours.detach(), layer[theirs]), theirs


def test_transformers_loads_the_main_model_leaving_the_mtp_layer_out(exported):
    src, out, model = exported
    assert_export_loads_with_our_logits(out, model, src, ignored="model.layers.2.")


def test_transformers_mtp_model_computes_our_mtp_loss(exported):
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no MtpModel")
    from transformers import AutoModelForCausalLM

    _, out, model = exported
    main = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    # MtpModel finds the MTP layers through this pattern, written for the 61-layer model (model.layers.61)
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    mtp = MtpModel.from_pretrained(main)
    ids, targets = _batch()
    with torch.no_grad():
        hidden = main.model(ids).last_hidden_state  # h^0: after the final norm
        # module 1 at position i: the embedding of t_{i+1} with h_i, predicting t_{i+2} (RoPE positions shifted
        # by one, as transformers drafts: attention sees only differences)
        h1 = mtp.forward_layer(0, hidden[:, :-1], torch.arange(1, SEQ)[None], None, input_ids=ids[:, 1:])
        logits = mtp._project_to_logits(h1)
    theirs = 0.3 * F.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten(), reduction="sum") / targets.numel()
    ours = _mtp_loss(model, ids, targets)
    assert abs(ours - float(theirs)) <= 1e-5 * float(theirs), (ours, float(theirs))


def test_the_export_imports_back_with_the_same_mtp_loss(exported, pm):
    _, out, model = exported
    cfg = compose_resolved(BASE + hf_model(out) + MTP, pm)
    assert validate(cfg, 1, pm) == []
    imported = reference_trainer(cfg, pm).model
    ids, targets = _batch()
    assert _mtp_loss(imported, ids, targets) == _mtp_loss(model, ids, targets)
    model.eval()
    imported.eval()
    with torch.no_grad():
        assert torch.equal(imported(ids), model(ids))


def test_an_import_asking_for_mtp_layers_the_directory_lacks_is_one_line(exported, pm):
    src, _, _ = exported  # saved by transformers: no MTP layer
    cfg = compose_resolved(BASE + hf_model(src) + MTP, pm)
    problems = validate(cfg, 1, pm)
    assert len(problems) == 1 and "model.mtp_depth=1" in problems[0] and "model.layers.2" in problems[0] \
        and "num_nextn_predict_layers" in problems[0], problems


@pytest.mark.parametrize("overrides,message", [
    (("model=tiny", "model.mtp_depth=1"), "model.mtp_depth=1: only DeepseekV3ForCausalLM (latent attention"),
    (("model=deepseek-v3", "model.ffn=swiglu", "model.mtp_depth=1"),
     "model.mtp_depth=1 with every block dense: DeepSeek-V3's multi-token prediction layers are MoE layers"),
], ids=["no-mla", "all-dense-mla"])
def test_mtp_without_a_deepseek_layer_is_refused(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        hf_config(make_config(*overrides).model, "bfloat16")
