"""Out and back: a Hugging Face model imported as our checkpoint (``hpctrain-ckpt
import-hf``) and exported again (``hpctrain-ckpt export``) loads in transformers
with no missing or unexpected keys and computes the original's logits; the
export carries config.json for the right architecture with the tokenizer's
ids, generation_config.json, shards of at most the chosen size with their
index, and the tokenizer files."""
from __future__ import annotations

import json
import os

import pytest
import torch

from hf_models import batch, hf_logits, llama_config, mixtral_config, save
from hpctrain_h5ckpt import cli


def load_checked(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def tokenizer_file(directory):
    """A real (tiny) tokenizer.json in ``directory``, trained here."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.train_from_iterator(["out and back again", "a tiny corpus"], trainers.BpeTrainer(vocab_size=40,
                                                                                         special_tokens=["<unk>"]))
    tok.save(os.path.join(directory, "tokenizer.json"))


@pytest.mark.parametrize("make,arch", [
    (lambda: llama_config(), "LlamaForCausalLM"),
    (lambda: llama_config(tie=True), "LlamaForCausalLM"),
    (mixtral_config, "MixtralForCausalLM"),
], ids=["llama-gqa-llama3-rope", "llama-tied", "mixtral"])
def test_import_export_round_trip_loads_in_transformers(tmp_path, make, arch, capsys):
    src = save(make(), tmp_path / "src")
    tokenizer_file(src)
    assert cli.main(["import-hf", src, str(tmp_path / "ck.h5")]) == 0
    out = tmp_path / "out"
    assert cli.main(["export", str(tmp_path / "ck.h5"), "--to", str(out), "--max-shard-size", "100KB"]) == 0
    config = json.load(open(out / "config.json"))
    assert config["architectures"] == [arch]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert json.load(open(out / "generation_config.json")) == {"bos_token_id": 1, "eos_token_id": 2,
                                                               "pad_token_id": 0}
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.getsize(out / s) <= 100_000 + 4096 for s in shards)  # + the header
    with open(os.path.join(src, "tokenizer.json")) as a, open(out / "tokenizer.json") as b:
        assert a.read() == b.read()
    load_checked(out)
    ids = batch()
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(src, ids), rtol=1e-5, atol=1e-6)


def test_bfloat16_export_loads(tmp_path):
    src = save(llama_config(), tmp_path / "src")
    assert cli.main(["import-hf", src, str(tmp_path / "ck.h5")]) == 0
    assert cli.main(["export", str(tmp_path / "ck.h5"), "--to", str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    # the weights as readable as the config beside them (safetensors alone makes them 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] and modes["config.json"] & 0o044, modes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = batch()
    with torch.no_grad():
        got = model.float()(ids).logits
    want = hf_logits(src, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # bf16 weights: 8 bits of mantissa


def test_an_export_carries_the_data_tokenizer_and_its_ids(tmp_path, pm):
    """A run on hpctrain-prepare shards: the tokenizer the shards were made with is copied into the export
    and its BOS/EOS ids are in config.json (without them transformers assumes 1 and 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hpctrain.config import compose_resolved
    from hpctrain.data import prepare
    from hpctrain.run import run

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the quick fox", "the lazy dog"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"the quick fox {i} jumps over the lazy dog" * 4
                                                     for i in range(40)))
    assert prepare.main([str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                         "--eos", "</s>", "-o", str(tmp_path / "data" / "corpus")]) == 0
    cfg = compose_resolved(["data=indexed", f"data.paths=[{tmp_path}/data/corpus.json]", "model.vocab_size=320",
                            "trainer.steps=1", "checkpoint.every=1", f"checkpoint.dir={tmp_path}/ck",
                            "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "trainer.seq_len=16",
                            "trainer.progress=off"], pm)
    run(cfg, str(tmp_path / "run"), pm=pm)
    assert cli.main(["export", str(tmp_path / "ck"), "--to", str(tmp_path / "out")]) == 0
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert config["eos_token_id"] == tok.token_to_id("</s>") == 2
    with open(tmp_path / "tok" / "tokenizer.json") as a, open(tmp_path / "out" / "tokenizer.json") as b:
        assert a.read() == b.read()
    load_checked(tmp_path / "out")


def _tree(path):
    """Every file under ``path`` with its bytes."""
    return {os.path.relpath(os.path.join(d, n), path): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(path) for n in names}


def test_an_export_into_a_directory_holding_a_model_is_refused_or_replaced_whole(tmp_path, capsys):
    """``--to`` holds another model (one model.safetensors): refused in one line naming the directory and
    --overwrite, the directory untouched; with --overwrite the sharded export replaces it whole (written
    beside, swapped in), so transformers loads the new weights and the old model.safetensors, which
    from_pretrained would otherwise prefer to the shards' index, is gone; nothing is left beside it."""
    src = save(llama_config(), tmp_path / "src")
    assert cli.main(["import-hf", src, str(tmp_path / "ck.h5")]) == 0
    out = save(llama_config(), tmp_path / "out", seed=1)  # another model, where the export goes
    (tmp_path / "out" / "notes.txt").write_text("the old model\n")
    before = _tree(out)
    assert "model.safetensors" in before
    capsys.readouterr()
    export = ["export", str(tmp_path / "ck.h5"), "--to", out, "--max-shard-size", "100KB"]
    assert cli.main(export) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hpctrain: error: export target {out} is not empty (it holds config.json, generation_config.json, "
                   "model.safetensors and 1 more); pass --overwrite to replace the whole directory with the export, "
                   "or choose another --to"], err
    assert _tree(out) == before

    assert cli.main(export + ["--overwrite"]) == 0
    files = set(os.listdir(out))
    assert "model.safetensors" not in files and "notes.txt" not in files, files
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]  # no staging or old directory left
    load_checked(out)
    ids = batch()
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(src, ids), rtol=1e-5, atol=1e-6)


def test_an_export_into_an_empty_directory_needs_no_overwrite(tmp_path):
    src = save(llama_config(), tmp_path / "src")
    assert cli.main(["import-hf", src, str(tmp_path / "ck.h5")]) == 0
    (tmp_path / "out").mkdir()
    assert cli.main(["export", str(tmp_path / "ck.h5"), "--to", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]


@pytest.mark.parametrize("swap", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_the_replacement_leaves_only_the_new_directory(tmp_path, monkeypatch, swap):
    """Both ways of putting the export in place (the atomic swap, and two renames where the file system
    has no swap): the new files only, the mode of the directory it replaced, nothing left beside."""
    from hpctrain.hf import export

    if not swap:
        monkeypatch.setattr(export, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.safetensors").write_text("old")
    out.chmod(0o750)
    stage = export._staging_dir(str(out))
    open(os.path.join(stage, "new.safetensors"), "w").write("new")
    export._replace_dir(stage, str(out))
    assert os.listdir(out) == ["new.safetensors"] and os.listdir(tmp_path) == ["out"]
    assert out.stat().st_mode & 0o777 == 0o750
