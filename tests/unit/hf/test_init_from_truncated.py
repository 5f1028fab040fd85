"""``hpctrain-train checkpoint.init_from=hf:DIR`` whose model.safetensors was cut short (an interrupted
download or copy: the header intact, the data shorter than it says) is one ``hpctrain: error:`` line
naming the file, exit 2, from validation, before any collective (the safetensors library raised its
own error as a traceback, exit 1). Run in this process as the console script calls it (``main(argv)``);
the table of damaged directories is in tests/unit/config/test_bad_hf.py."""
from __future__ import annotations

import os

from hf_models import llama_config, save


def test_truncated_weights_are_one_line_exit_2(tmp_path, capfd, monkeypatch):
    from hpctrain.cli import main

    model = save(llama_config(), tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    size = os.path.getsize(weights)
    os.truncate(weights, size // 2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    capfd.readouterr()
    code = main(["model=hf", f"model.hf_dir={model}", f"checkpoint.init_from=hf:{model}", "trainer.seq_len=32",
                 "trainer.steps=1", "trainer.progress=off", f"hydra.run.dir={tmp_path}/run"])
    out, err = capfd.readouterr()
    errors = [line for line in (out + err).splitlines() if line.startswith("hpctrain: error: ")]
    assert code == 2, out + err
    assert errors == [f"hpctrain: error: {weights} is truncated: {size // 2:,} bytes, but its header places tensor "
                      f"data up to byte {size:,}; download or copy it again"], out + err
    assert "Traceback" not in out + err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
