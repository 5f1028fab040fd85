"""hpctrain-ckpt inspect / verify / export on a checkpoint made in this process
(one rank: MPI's world has size 1 under plain pytest)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch

from hpctrain.hf.names import rope_row_permutation

from hpctrain_h5ckpt import cli


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """Two checkpoints (steps 2 and 4) of the tiny model, trained in this process."""
    from omegaconf import OmegaConf

    from hpctrain.config import compose
    from hpctrain.config.store import to_config
    from hpctrain.plugins import create_manager
    from hpctrain.run import run

    d = tmp_path_factory.mktemp("ckpt")
    pm = create_manager()
    raw = compose(["trainer.steps=4", "checkpoint.every=2", "checkpoint.keep=0", f"checkpoint.dir={d}/ck",
                   "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32",
                   "trainer.progress=off"], pm=pm)
    run(to_config(OmegaConf.to_container(raw, resolve=True), pm), str(d / "run"), pm=pm)
    return str(d / "ck")


@pytest.fixture
def copy_of(ckpt_dir, tmp_path):
    def make(name: str = "step_00000004.h5") -> str:
        dst = str(tmp_path / name)
        shutil.copy(os.path.join(ckpt_dir, name), dst)
        return dst
    return make


def _data_offset(path: str, dataset: str) -> int:
    with h5py.File(path, "r") as f:
        return f[dataset].id.get_offset()


def test_tree_is_self_describing(ckpt_dir):
    assert shutil.which("h5ls"), "h5ls missing: scripts/setup.sh installs hdf5-tools"
    out = subprocess.run(["h5ls", "-r", os.path.join(ckpt_dir, "step_00000004.h5")], capture_output=True,
                         text=True).stdout
    out = " ".join(out.split())  # h5ls pads its columns
    for line in ("/model/tok_embeddings.weight Dataset {256, 64}", "/optim/exp_avg/norm.weight Dataset {64}",
                 "/optim/step/norm.weight Dataset {SCALAR}", "/meta/config", "/meta/rng/torch_cpu Dataset {1, 5056}"):
        assert line in out


def test_inspect_shows_step_layout_and_size(ckpt_dir, capsys):
    assert cli.main(["inspect", ckpt_dir, "--config"]) == 0
    out = capsys.readouterr().out
    assert "step_00000004.h5" in out and "step        4" in out
    assert "dp=1" in out and "/model/layers.1.attn.wq.weight" in out and "64x64" in out
    assert "bytes/parameter" in out and "trainer:" in out


def test_provenance_is_recorded_printed_and_a_changed_stack_resume_names_the_difference(copy_of, capsys):
    """Every checkpoint holds its provenance (hpctrain.provenance): inspect prints it; resuming from a file
    whose record names another torch and MPI logs one block with those two lines, and nothing for the same
    stack. The config hash is the stored config's."""
    import hashlib
    import logging

    from hpctrain import provenance
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import create_manager
    from hpctrain.run import reference_trainer

    path = copy_of()
    with h5py.File(path, "r") as f:
        record = json.loads(f["meta"].attrs["provenance"])
        config_text = f["meta/config"][()]
    assert record["config_sha256"] == hashlib.sha256(config_text).hexdigest()
    assert record["software"]["torch"] == torch.__version__ and "mpi" in record["software"]
    assert record["job"]["world_size"] == 1 and record["job"]["ranks_per_node"] == 1
    assert record["data"]["sha256"] and provenance.git_commit() == record["software"].get("hpctrain_git")
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and f"config      sha256 {record['config_sha256']}" in out
    assert "job         1 ranks on 1 node(s)" in out

    older = json.loads(json.dumps(record))
    older["software"].update(torch="2.0.0", mpi="Open MPI v4.0.3")
    other = copy_of("step_00000002.h5")
    with h5py.File(other, "r+") as f:
        f["meta"].attrs["provenance"] = json.dumps(older)
    pm = create_manager()
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage())
    logger = logging.getLogger("hpctrain")
    logger.addHandler(handler)
    try:
        for resume in (path, other):
            reference_trainer(compose_resolved(
                ["trainer.steps=4", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.seq_len=32", "trainer.progress=off", f"checkpoint.resume={resume}"], pm), pm)
    finally:
        logger.removeHandler(handler)
    blocks = [line for line in lines if "was saved on another software stack" in line]
    assert blocks == [f"{other} was saved on another software stack (hpctrain-ckpt inspect shows its provenance):"
                      f"\n  mpi: Open MPI v4.0.3 -> {record['software']['mpi']}"
                      f"\n  torch: 2.0.0 -> {torch.__version__}"], lines


def test_verify_accepts_a_good_file(ckpt_dir, capsys):
    assert cli.main(["verify", os.path.join(ckpt_dir, "step_00000002.h5")]) == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_verify_names_the_dataset_with_a_flipped_byte(copy_of, capsys):
    path = copy_of()
    off = _data_offset(path, "/model/layers.0.attn.wv.weight") + 37
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    assert cli.main(["verify", path]) == 1
    err = capsys.readouterr().err
    assert path in err and "/model/layers.0.attn.wv.weight" in err and "checksum mismatch" in err


def test_verify_rejects_a_truncated_file(copy_of, capsys):
    path = copy_of()
    os.truncate(path, os.path.getsize(path) // 2)
    assert cli.main(["verify", path]) == 1
    err = capsys.readouterr().err
    assert path in err and "truncated" in err


def test_export_hf_llama_names_and_rope_permutation(ckpt_dir, tmp_path, capsys):
    """Names, q/k row order and config.json of the export, read back with the safetensors library
    (that transformers loads it and computes our logits: tests/unit/hf/test_hf_export.py)."""
    from safetensors.numpy import load_file

    src = os.path.join(ckpt_dir, "step_00000004.h5")
    out = tmp_path / "hf"
    assert cli.main(["export", src, "--to", str(out)]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{m}" for i in range(2) for m in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")}
    assert set(tensors) == names
    with h5py.File(src, "r") as f:
        wq, wk, wv = (f[f"model/layers.1.attn.{w}.weight"][()] for w in ("wq", "wk", "wv"))
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"], wq[rope_row_permutation(4, 16)])
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.k_proj.weight"], wk[rope_row_permutation(2, 16)])
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.v_proj.weight"], wv)
    cfg = json.load(open(out / "config.json"))
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]) == (4, 2, 64)
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_export_bfloat16(ckpt_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    src = os.path.join(ckpt_dir, "step_00000004.h5")
    assert cli.main(["export", src, "--to", str(out), "--dtype", "bfloat16"]) == 0
    got = load_file(str(out / "model.safetensors"))["model.norm.weight"]
    with h5py.File(os.path.join(ckpt_dir, "step_00000004.h5"), "r") as f:
        norm = torch.from_numpy(f["model/norm.weight"][()])
    assert got.dtype == torch.bfloat16 and torch.equal(got, norm.to(torch.bfloat16))
    assert json.load(open(out / "config.json"))["torch_dtype"] == "bfloat16"


def test_nonfinite_checkpoints_are_flagged_skipped_and_orphans_cleaned(tmp_path, capsys):
    """A checkpoint whose weights hold NaN (its checksums are right: it was
    written that way) is named by ``verify DIR``, which checks every
    checkpoint; resume=auto refuses it and falls back to the older one, says
    what it searched and found, and removes a crashed save's .tmp file."""
    import logging

    from hpctrain.config import compose_resolved
    from hpctrain.plugins import create_manager
    from hpctrain.run import reference_trainer

    pm = create_manager()
    d = str(tmp_path / "ck")
    base = ["trainer.steps=4", "checkpoint.every=1", "checkpoint.keep=0", f"checkpoint.dir={d}",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.progress=off"]
    trainer = reference_trainer(compose_resolved(base, pm), pm)
    trainer.train_step()
    trainer.save_checkpoint()
    trainer.train_step()
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    trainer.save_checkpoint()
    capsys.readouterr()
    assert cli.main(["verify", d]) == 1
    out = capsys.readouterr().out
    assert "BAD " + os.path.join(d, "step_00000002.h5") + ": non-finite values" in out
    assert "OK " + os.path.join(d, "step_00000001.h5") in out and "1 of 2 checkpoints OK" in out

    orphan = os.path.join(d, "step_00000003.h5.tmp")
    open(orphan, "wb").close()
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hpctrain").addHandler(handler)
    try:
        resumed = reference_trainer(compose_resolved(base + ["checkpoint.resume=auto"], pm), pm)
    finally:
        logging.getLogger("hpctrain").removeHandler(handler)
    assert resumed.step == 1 and not os.path.exists(orphan)
    assert all(bool(torch.isfinite(p).all()) for p in resumed.model.parameters())
    assert any("checkpoint.resume=auto: 2 checkpoint(s) in" in s and "steps 2, 1" in s for s in said), said
    assert any("non-finite values" in s and "step_00000002.h5" in s for s in said)


def _word_tokenizer(path, n: int) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0")).save(str(path))
    return str(path)


BAD_EXPORTS = {  # name: (the arguments after export, exit status, how the one line starts)
    "not-a-checkpoint": (lambda d, t, c: [str(t / "notes.txt")], 1,
                         "checkpoint {t}/notes.txt: cannot be opened as HDF5"),
    "truncated": (lambda d, t, c: [c()], 1, "checkpoint {t}/step_00000004.h5: cannot be opened as HDF5"),
    "no-such-path": (lambda d, t, c: [str(t / "nothing.h5")], 2, "{t}/nothing.h5: no such file or directory; give"),
    "no-such-tokenizer": (lambda d, t, c: [d, "--tokenizer", str(t / "nothere.json")], 2,
                          "--tokenizer {t}/nothere.json does not exist"),
    "a-larger-tokenizer": (lambda d, t, c: [d, "--tokenizer", _word_tokenizer(t / "big.json", 300)], 2,
                           "--tokenizer {t}/big.json has 300 tokens, more than the model's vocabulary of 256 "
                           "(model.vocab_size)"),
}


@pytest.mark.parametrize("case", list(BAD_EXPORTS))
def test_a_bad_export_is_one_line_and_leaves_no_directory(ckpt_dir, copy_of, tmp_path, capsys, case):
    (tmp_path / "notes.txt").write_text("not hdf5\n")

    def truncated():
        path = copy_of()
        os.truncate(path, 50_000)
        return path

    args, status, start = BAD_EXPORTS[case]
    out = tmp_path / "hf"
    assert cli.main(["export", *args(ckpt_dir, tmp_path, truncated), "--to", str(out)]) == status
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hpctrain: error: " + start.format(t=tmp_path)), err
    assert not out.exists()


def test_a_tokenizer_within_the_vocabulary_is_exported_once(ckpt_dir, tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    _word_tokenizer(tok / "tokenizer.json", 200)
    out = tmp_path / "hf"
    assert cli.main(["export", ckpt_dir, "--to", str(out), "--tokenizer", str(tok)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert capsys.readouterr().out.count("tokenizer.json") == 1
