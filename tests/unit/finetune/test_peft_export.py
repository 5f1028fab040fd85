"""A LoRA run's adapters out: ``hpctrain-ckpt export --adapter`` writes a PEFT adapter
that ``peft.PeftModel.from_pretrained`` loads onto the transformers model of the base,
and ``--merge`` the merged model; both compute our logits.

A tiny Llama (GQA 4:1, Llama 3.1 RoPE) made and saved here is fine-tuned 2 steps with
adapters on all seven projections (B no longer zero), saved, exported both ways and
compared in fp32 with our forward: within 1e-5 of the largest logit. Bad uses of the
export are one line each."""
from __future__ import annotations

import json

import pytest
import torch

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.run import reference_trainer

from hf_models import SEQ, batch, hf_logits, hf_model, llama_config, save
from hpctrain_h5ckpt import cli

RTOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base directory, checkpoint, our logits of ``batch()`` after 2 steps)."""
    from hpctrain.plugins import create_manager

    pm = create_manager()
    d = tmp_path_factory.mktemp("lora")
    base = save(llama_config(), d / "base")
    cfg = compose_resolved([*hf_model(base), "finetune=lora", "finetune.lora.rank=4", "finetune.lora.alpha=8",
                            "finetune.lora.targets=[q,k,v,o,gate,up,down]", "optim.warmup_steps=0", "optim.lr=0.01",
                            f"trainer.seq_len={SEQ}", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                            "trainer.progress=off", "checkpoint.every=1000", f"checkpoint.dir={d / 'ck'}"], pm)
    assert validate(cfg, 1, pm) == []
    trainer = reference_trainer(cfg, pm)
    for _ in range(2):
        trainer.train_step()
    named = dict(trainer.model.named_parameters())
    assert all(named[n].abs().max() > 1e-4 for n in named if n.endswith(".lora.B"))  # B trained off zero
    path = trainer.save_checkpoint()
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(batch())
    return base, path, ours


def _close(got, want):
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= RTOL * scale, f"max abs difference {err:.3g} > {RTOL} x {scale:.3g}"


def test_peft_loads_the_adapter_onto_the_transformers_model(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, ckpt, ours = trained
    out = tmp_path / "adapter"
    assert cli.main(["export", ckpt, "--adapter", str(out)]) == 0
    config = json.load(open(out / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, base)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(model, str(out))
    peft_model.eval()
    loaded = dict(peft_model.named_parameters())
    assert sum(".lora_B." in n for n in loaded) == 14
    assert all(p.abs().max() > 0 for n, p in loaded.items() if ".lora_B." in n)  # every B was loaded, none missed
    with torch.no_grad():
        theirs = peft_model(batch()).logits
    _close(ours, theirs)
    with torch.no_grad(), peft_model.disable_adapter():
        assert float((peft_model(batch()).logits - theirs).abs().max()) > 1e-3  # the adapters matter


def test_the_merged_export_computes_the_same(trained, tmp_path):
    _, ckpt, ours = trained
    out = tmp_path / "merged"
    assert cli.main(["export", ckpt, "--to", str(out), "--merge"]) == 0
    _close(ours, hf_logits(out, batch()))


@pytest.mark.parametrize("args,message", [
    (["--to", "{o}"], "holds LoRA adapters (finetune=lora): pass --merge"),
    (["--adapter", "{o}", "--merge"], "--merge goes with --to"),
    ([], "give --to DIR (a Hugging Face model) or --adapter DIR"),
], ids=["plain-export-of-lora", "merge-with-adapter", "neither"])
def test_bad_exports_are_one_line(trained, tmp_path, capsys, args, message):
    _, ckpt, _ = trained
    capsys.readouterr()
    assert cli.main(["export", ckpt, *[a.format(o=tmp_path / "x") for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
