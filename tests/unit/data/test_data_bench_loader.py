"""Smoke run of ``hpctrain-bench data``'s loader and index sections in one
process (tiny sizes; no timing asserted: benchmarks are not timed tests):
each prints its table with a row per contender, the loader's data_wait_s
column is filled for both trainers (the one reading inside its step too),
and the temporary shards are removed."""
from __future__ import annotations

import glob
import tempfile


def _rows(out, first_words):
    return [line for line in out.splitlines() if line.startswith(first_words)]


def test_loader_and_index_parts(capsys):
    from hpctrain.bench import data

    before = set(glob.glob(f"{tempfile.gettempdir()}/hpctrain-bench-data-*"))
    assert data.main(["--part", "loader", "--d-model", "64", "--layers", "1", "--seq-len", "32", "--vocab-size", "300",
                      "--per-rank", "2", "--micro-batch", "1", "--steps", "2", "--corpus-tokens", "20000"]) == 0
    assert data.main(["--part", "index", "--index-shards", "12", "--index-docs", "5"]) == 0
    out = capsys.readouterr().out
    loader = _rows(out, ("prefetch", "read in the step"))
    assert len(loader) == 2, out
    assert all(float(row.split()[-3]) > 0 for row in loader), loader  # data_wait_s, both contenders
    assert "loader alone (DataCursor.next_step" in out
    index = _rows(out, ("rank 0 indexes", "rank 0 reads the cache", "every rank indexes"))
    assert len(index) == 3 and index[-1].split()[-1] == "1.00", index
    assert set(glob.glob(f"{tempfile.gettempdir()}/hpctrain-bench-data-*")) == before
