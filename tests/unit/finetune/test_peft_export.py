"""A LoRA run's adapters out: ``hpctrain-ckpt export --adapter`` writes a PEFT adapter
that ``peft.PeftModel.from_pretrained`` loads onto the transformers model of the base,
and ``--merge`` the merged model; both compute our logits.

A tiny Llama (GQA 4:1, Llama 3.1 RoPE) made and saved here is fine-tuned 2 steps with
adapters on all seven projections (B no longer zero), saved, exported both ways and
compared in fp32 with our forward: within 1e-5 of the largest logit. Bad uses of the
export are one line each."""
from __future__ import annotations

import pytest
import torch

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.run import reference_trainer

from hf_models import SEQ, batch, export_adapter_loads_in_peft, hf_model, llama_config, merged_export_gives, save
from hpctrain_h5ckpt import cli


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


def test_peft_loads_the_adapter_onto_the_transformers_model(trained, tmp_path):
    base, ckpt, ours = trained
    config = export_adapter_loads_in_peft(ckpt, base, tmp_path / "adapter", ours, adapted=14)
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, base)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])


def test_the_merged_export_computes_the_same(trained, tmp_path):
    _, ckpt, ours = trained
    merged_export_gives(ckpt, tmp_path / "merged", ours)


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
