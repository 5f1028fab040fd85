"""Smoke run of ``hpctrain-bench data``'s tokenizer section (a tiny corpus,
no timing asserted: benchmarks are not timed tests). What is checked: it
lists, runs, prints a row per contender for the trained BPE and
SentencePiece, and every hpctrain-prepare row produced the library's ids
plus the BOS/EOS rule ("same ids: yes"), so the rows compare the same work."""
from __future__ import annotations

import sentencepiece  # noqa: F401 - the test extra installs both: a missing one fails here, not skips
import tokenizers  # noqa: F401


def test_data_bench_tokenizer_part(capsys):
    from hpctrain.bench import cli, data

    assert cli.main(["--list"]) == 0
    assert "data " in capsys.readouterr().out
    assert data.main(["--part", "tokenizer", "--corpus-bytes", "48K", "--warmup", "0", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("BPE", "SentencePiece"))]
    for tokenizer in ("BPE", "SentencePiece"):
        mine = {" ".join(r.split()[2:-5]): r.split() for r in rows if r.startswith(tokenizer)}
        assert {"library batch encode", "hpctrain-prepare encode", "hpctrain-prepare JSONL -> shard"} <= set(mine), rows
        assert mine["hpctrain-prepare encode"][-1] == "yes" and mine["hpctrain-prepare JSONL -> shard"][-1] == "yes"
        assert mine["library batch encode"][-2] == "1.00x"
