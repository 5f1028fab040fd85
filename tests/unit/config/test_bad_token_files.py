"""Damaged token files are rejected by validation, before any collective,
with one line naming the file, the expected and the found size, and the
fix: the bad-config table (``test_bad_inputs.py``) for rows that need a
file on disk. Each row builds its files in ``tmp_path`` from a good
``hpctrain-prepare`` output and says what the one message must contain."""
from __future__ import annotations

import json
import os

import pytest

from hpctrain.config.validate import validate
from hpctrain.data.prepare import prepare

TOKENS = 3000  # bytes of text, one token each


def _prepared(tmp_path, dtype="uint16"):
    src = tmp_path / "in.txt"
    src.write_text(("the quick brown fox jumps over the lazy dog.\n" * 100)[:TOKENS])
    out = tmp_path / "t.bin"
    prepare(str(src), str(out), dtype)
    return out


def _cut(path, size):
    os.truncate(path, size)


def truncated_by_half(tmp_path):
    out = _prepared(tmp_path)
    _cut(out, TOKENS)  # 3000 of 6000 bytes
    return [], ["is truncated", "expected 6000 bytes (3000 uint16 tokens, from its sidecar", "t.json",
                "found 3000 (1500 tokens)", "copy it again", "re-run hpctrain-prepare"]


def odd_sized(tmp_path):
    out = _prepared(tmp_path)
    _cut(out, 2 * TOKENS - 1)
    return [], ["is truncated", "expected 6000 bytes", "found 5999 (not a whole number of 2-byte tokens)",
                "hpctrain-prepare"]


def odd_sized_without_sidecar(tmp_path):
    out = _prepared(tmp_path)
    os.remove(tmp_path / "t.json")
    _cut(out, 2 * TOKENS - 1)
    return ["data.dtype=uint16"], ["has 5999 bytes, not a whole number of 2-byte uint16 tokens", "hpctrain-prepare"]


def uint32_cut_mid_token(tmp_path):
    out = _prepared(tmp_path, "uint32")
    _cut(out, 4 * TOKENS - 2)
    return [], ["expected 12000 bytes (3000 uint32 tokens", "found 11998 (not a whole number of 4-byte tokens)"]


def longer_than_its_sidecar(tmp_path):
    out = _prepared(tmp_path)
    with open(out, "ab") as f:
        f.write(b"\0\0" * 10)
    return [], ["is longer than its sidecar", "says: expected 6000 bytes", "found 6020 (3010 tokens)"]


def sidecar_not_json(tmp_path):
    _prepared(tmp_path)
    side = tmp_path / "t.json"
    side.write_text(side.read_text()[:20])  # a sidecar copied incompletely
    return [], ["its sidecar", "t.json cannot be read", "copy it again"]


def sidecar_count_not_a_number(tmp_path):
    _prepared(tmp_path)
    side = tmp_path / "t.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "num_tokens": "3000"}))
    return [], ["num_tokens='3000', not a token count", "re-run hpctrain-prepare"]


def dtype_contradicts_sidecar(tmp_path):
    _prepared(tmp_path)
    return ["data.dtype=uint32"], ["data.dtype=uint32 but the sidecar", "says uint16", "leave data.dtype unset"]


BAD_FILES = [truncated_by_half, odd_sized, odd_sized_without_sidecar, uint32_cut_mid_token, longer_than_its_sidecar,
             sidecar_not_json, sidecar_count_not_a_number, dtype_contradicts_sidecar]


@pytest.mark.parametrize("damage", BAD_FILES, ids=[f.__name__ for f in BAD_FILES])
def test_a_damaged_token_file_is_one_line_naming_it(make_config, pm, tmp_path, damage):
    extra, fragments = damage(tmp_path)
    problems = validate(make_config("data=tokens", f"data.path={tmp_path}/t.bin", *extra), 1, pm)
    assert len(problems) == 1, problems
    [line] = problems
    assert "\n" not in line and f"{tmp_path}/t.bin" in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


def test_a_good_token_file_passes(make_config, pm, tmp_path):
    _prepared(tmp_path)
    assert validate(make_config("data=tokens", f"data.path={tmp_path}/t.bin"), 1, pm) == []
    _prepared(tmp_path, "uint32")
    assert validate(make_config("data=tokens", f"data.path={tmp_path}/t.bin"), 1, pm) == []
