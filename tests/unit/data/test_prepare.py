import json

import numpy as np

from hpctrain.data.prepare import main, prepare
from hpctrain.data.sources import check_data_config, token_file_source
from hpctrain.data.tokenfile import TokenFile


def test_prepare_round_trip(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("hello, cluster\n" * 50)
    out = tmp_path / "data" / "tokens.bin"
    n = prepare(str(src), str(out), "uint32")
    assert n == 15 * 50
    meta = json.loads((tmp_path / "data" / "tokens.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 256 and meta["num_tokens"] == n
    source = token_file_source(str(out))
    assert isinstance(source.tokens, TokenFile) and len(source) == n  # read window by window, not mapped
    assert bytes(source.tokens[:14].astype(np.uint8)) == b"hello, cluster"


def test_prepare_cli_reports_missing_input(tmp_path, capsys):
    assert main([str(tmp_path / "nope.txt"), str(tmp_path / "x.bin")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_data_checks_name_the_fix(make_config, tmp_path):
    cfg = make_config("data=tokens", f"data.path={tmp_path}/missing.bin")
    problems = check_data_config(cfg.data, 64, 256)
    assert problems and "hpctrain-prepare" in problems[0] and "does not exist" in problems[0]
    cfg = make_config("data=tokens")
    assert "needs data.path" in check_data_config(cfg.data, 64, 256)[0]


def test_training_on_a_prepared_file(make_config, tmp_path):
    from hpctrain.run import reference_run

    src = tmp_path / "in.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    prepare(str(src), str(tmp_path / "t.bin"))
    cfg = make_config("data=tokens", f"data.path={tmp_path}/t.bin", "trainer.steps=8", "trainer.log_every=100")
    hist = reference_run(cfg)
    assert len(hist) == 8 and hist[-1]["loss"] < hist[0]["loss"]
