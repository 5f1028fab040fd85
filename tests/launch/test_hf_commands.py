"""The README's Hugging Face commands as users type them: ``hpctrain-train
model=hf ... checkpoint.init_from=hf:DIR`` under ``mpiexec`` (tp 2), then
``hpctrain-ckpt export`` to a directory transformers loads; a model the
trainer cannot compute is one ``hpctrain: error:`` line and exit 2 on every
rank before any step. The model is made and saved here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from hf_models import llama_config, save
from test_launchers import MPIEXEC, TIMEOUT, _env


def _exe(name):
    return shutil.which(name, path=os.path.dirname(sys.executable))


def test_train_from_a_hugging_face_directory_under_mpiexec_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    src = save(llama_config(), tmp_path / "llama")
    run, ck, out = tmp_path / "run", tmp_path / "ck", tmp_path / "out"
    r = subprocess.run([MPIEXEC, "-n", "2", _exe("hpctrain-train"), "model=hf", f"model.hf_dir={src}",
                        f"checkpoint.init_from=hf:{src}", "parallel.tp=2", "trainer.steps=2", "trainer.seq_len=32",
                        "checkpoint.every=2", f"checkpoint.dir={ck}", f"hydra.run.dir={run}"],
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    log = (run / "train.log").read_text()
    assert f"weights from checkpoint.init_from=hf:{src}" in log and "tp=2" in log
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    r = subprocess.run([_exe("hpctrain-ckpt"), "export", str(ck), "--to", str(out)], env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    _, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_an_unsupported_field_is_one_line_exit_2_on_every_rank(tmp_path):
    src = save(llama_config(), tmp_path / "llama")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["attention_bias"] = True
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    r = subprocess.run([MPIEXEC, "-n", "2", _exe("hpctrain-train"), "model=hf", f"model.hf_dir={src}",
                        f"checkpoint.init_from=hf:{src}", f"hydra.run.dir={tmp_path / 'run'}"],
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert lines == [f"hpctrain: error: {src}/config.json: attention_bias=True (biases on the attention "
                     "projections) is not implemented; this model cannot be trained here"]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
