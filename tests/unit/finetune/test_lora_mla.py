"""LoRA on multi-head latent attention (DeepSeek-V3's, ``model.attention_kind=mla``), one process.

The tiny random all-dense ``DeepseekV3ForCausalLM`` of tests/deepseek_models.py (low-rank query, key/value
latent with a shared rotary key, yarn), made and saved here, is fine-tuned 2 steps with adapters on latent
attention's down-projections (``q_a``: q_a_proj, ``kv_a``: kv_a_proj_with_mqa), up-projections (``q_b``,
``kv_b``) and output (``o``): only the adapters train (the base
bit-identical, without gradients), every adapter's B moved off zero; ``hpctrain-ckpt export --adapter``
writes a PEFT adapter that ``peft.PeftModel.from_pretrained`` loads onto transformers' model of the base
with our logits (within 1e-5 of the largest, fp32); ``--merge`` computes them too. Without q_lora_rank,
``q`` adapts the plain query projection (q_proj).

(The feed-forward's gate/up/down are left out: peft 0.21 does not put adapters on DeepseekV3's dense MLP
projections named in target_modules, rewriting them for its fused experts; docs/finetune.md.)"""
from __future__ import annotations

import pytest
import torch
from deepseek_models import deepseek_config

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.run import reference_trainer

from hf_models import SEQ, batch, export_adapter_loads_in_peft, hf_model, merged_export_gives, save

TARGETS = ("q_a", "q_b", "kv_a", "kv_b", "o")
HF_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base directory, checkpoint, our logits of ``batch()`` after 2 steps)."""
    from hpctrain.plugins import create_manager

    pm = create_manager()
    d = tmp_path_factory.mktemp("lora-mla")
    base = save(deepseek_config(), d / "base")
    cfg = compose_resolved([*hf_model(base), "finetune=lora", "finetune.lora.rank=4", "finetune.lora.alpha=8",
                            f"finetune.lora.targets=[{','.join(TARGETS)}]", "optim.warmup_steps=0", "optim.lr=0.01",
                            f"trainer.seq_len={SEQ}", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                            "trainer.progress=off", "checkpoint.every=1000", f"checkpoint.dir={d / 'ck'}"], pm)
    assert validate(cfg, 1, pm) == []
    trainer = reference_trainer(cfg, pm)
    named = dict(trainer.model.named_parameters())
    adapters = {n for n in named if ".lora." in n}
    assert len(adapters) == 2 * len(TARGETS) * 2  # A and B, 5 projections, 2 layers
    assert {n for n, p in named.items() if p.requires_grad} == adapters
    assert "layers.0.attn.wkv_a.lora.A" in adapters and "layers.1.attn.wq_b.lora.B" in adapters
    before = {n: p.detach().clone() for n, p in named.items()}
    for _ in range(2):
        trainer.train_step()
    for n, p in named.items():
        if n in adapters:
            assert not torch.equal(p, before[n]), f"{n} did not train"
        else:
            assert torch.equal(p, before[n]) and p.grad is None, f"{n} changed or has a gradient"
    path = trainer.save_checkpoint()
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(batch())
    return base, path, ours


def test_peft_loads_the_latent_attention_adapter_with_our_logits(trained, tmp_path):
    base, ckpt, ours = trained
    config = export_adapter_loads_in_peft(ckpt, base, tmp_path / "adapter", ours, adapted=2 * len(TARGETS))
    assert config["target_modules"] == sorted(HF_NAMES)


def test_the_merged_export_computes_the_same(trained, tmp_path):
    _, ckpt, ours = trained
    merged_export_gives(ckpt, tmp_path / "merged", ours)


def test_q_adapts_the_plain_query_projection(make_config):
    from hpctrain.model.build import build_model
    from hpctrain.plugins import create_manager

    cfg = make_config("finetune=lora", "finetune.lora.targets=[q,kv_b]", "model.attention_kind=mla",
                      "model.n_kv_heads=null", "model.mla.q_lora_rank=null", "model.mla.kv_lora_rank=16",
                      "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12")
    names = {n for n, p in build_model(cfg, create_manager()).named_parameters() if p.requires_grad}
    assert names == {f"layers.{i}.attn.{w}.lora.{m}" for i in range(2) for w in ("wq", "wkv_b") for m in "AB"}
