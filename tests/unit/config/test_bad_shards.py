"""Bad indexed shards (``data=indexed``) are refused by validation, before
any collective, with one line naming the file and the fix: the bad-config
table (``test_bad_inputs.py``) for rows that need files on disk. Each row
damages good shards in ``tmp_path`` and says what the message must hold;
the good shards pass (``test_good_shards_pass``), so every row fails for
its damage alone."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hpctrain.config.validate import validate
from hpctrain.data.indexed import IndexedWriter

VOCAB = 300


def _shard(prefix, documents, dtype=np.uint16, vocab=VOCAB):
    with IndexedWriter(str(prefix), dtype) as w:  # finished on leaving the block
        for doc in documents:
            w.add_document(doc)
    if vocab is not None:  # the description hpctrain-prepare writes beside a shard
        with open(f"{prefix}.json", "w") as f:
            json.dump({"vocab_size": vocab, "eos_id": 0}, f)


def _documents(seed, n=12):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(20, 80))) for _ in range(n)]


def _good(tmp_path):
    _shard(tmp_path / "a", _documents(0))
    _shard(tmp_path / "b", _documents(1))
    return [f"data.paths=[{tmp_path}/a,{tmp_path}/b]"]


def missing_shard(tmp_path):
    return _good(tmp_path)[:0] + [f"data.paths=[{tmp_path}/a,{tmp_path}/gone]"], \
        [f"{tmp_path}/gone.idx does not exist", "a shard is a .bin/.idx pair"]


def missing_bin(tmp_path):
    overrides = _good(tmp_path)
    os.remove(tmp_path / "b.bin")
    return overrides, [f"{tmp_path}/b.bin does not exist"]


def truncated_bin(tmp_path):
    overrides = _good(tmp_path)
    size = os.path.getsize(tmp_path / "b.bin")
    os.truncate(tmp_path / "b.bin", size // 2)
    return overrides, [f"{tmp_path}/b.bin", "truncated", f"expected {size} bytes", f"found {size // 2}",
                       "b.idx"]


def bad_idx_magic(tmp_path):
    overrides = _good(tmp_path)
    with open(tmp_path / "a.idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    return overrides, [f"{tmp_path}/a.idx is not a Megatron index", "magic", "write it again"]


def idx_cut_short(tmp_path):
    overrides = _good(tmp_path)
    os.truncate(tmp_path / "a.idx", 60)
    return overrides, [f"{tmp_path}/a.idx is not a Megatron index", "copy the shard again"]


def idx_for_another_bin(tmp_path):
    _good(tmp_path)  # writes the shards a and b
    os.replace(tmp_path / "a.idx", tmp_path / "b.idx")  # b.bin with a's index
    return [f"data.paths=[{tmp_path}/b]"], [f"{tmp_path}/b.bin", "its index b.idx"]


def empty_blend_source(tmp_path):
    _good(tmp_path)
    _shard(tmp_path / "empty", [])
    return [f"data.blend=[{{paths:[{tmp_path}/a],weight:0.7}},{{paths:[{tmp_path}/empty],weight:0.3,name:web}}]"], \
        ["data.blend[1].paths", "source 'web' has no document", "drop the source"]


def glob_matching_nothing(tmp_path):
    _good(tmp_path)
    return [f"data.paths=[{tmp_path}/nothing-*]"], [f"{tmp_path}/nothing-* names no shard"]


def vocabulary_larger_than_the_model(tmp_path):
    overrides = _good(tmp_path)
    return overrides + ["model.vocab_size=256"], \
        ["the data's tokenizer has 300 tokens but model.vocab_size=256", "model.vocab_size=auto"]


def foreign_shard_with_a_token_past_the_vocabulary(tmp_path):
    # a Megatron shard written elsewhere records no vocabulary: its largest id is what is checked
    _shard(tmp_path / "foreign", [[5, 6, 7] * 30, [1, 280, 2] * 30], vocab=None)
    return [f"data.paths=[{tmp_path}/foreign]", "model.vocab_size=256"], \
        [f"{tmp_path}/foreign.bin holds token id 280, at or above model.vocab_size=256", "at least 281"]


def auto_vocabulary_not_recorded(tmp_path):
    _shard(tmp_path / "foreign", [[5, 6, 7] * 30], vocab=None)
    return [f"data.paths=[{tmp_path}/foreign]", "model.vocab_size=auto"], \
        ["model.vocab_size=auto: data.source=indexed records no tokenizer vocabulary", "set model.vocab_size="]


def validation_shard_missing(tmp_path):
    return _good(tmp_path) + [f"data.validation.paths=[{tmp_path}/heldout]"], \
        ["data.validation.paths", f"{tmp_path}/heldout.idx does not exist"]


def fewer_tokens_than_a_sample(tmp_path):
    _shard(tmp_path / "tiny", [[1, 2, 3]])
    return [f"data.paths=[{tmp_path}/tiny]"], ["source 'data' has 3 training tokens, fewer than trainer.seq_len+1"]


def split_holding_out_less_than_a_sample(tmp_path):
    return _good(tmp_path) + ["data.split=0.01"], \
        ["data.split=0.01 holds out", "fewer than one sample (trainer.seq_len+1=", "raise data.split"]


def validation_shards_shorter_than_a_sample(tmp_path):
    _good(tmp_path)
    _shard(tmp_path / "tiny", [[1, 2, 3]])
    return _good(tmp_path) + [f"data.validation.paths=[{tmp_path}/tiny]"], \
        ["data.validation.paths hold 3 tokens, fewer than one sample"]


def _chat_shard(prefix, documents):
    """A shard with a loss mask beside it, as hpctrain-prepare --format chat writes it."""
    with IndexedWriter(str(prefix), np.uint16, loss_mask=True) as w:
        for doc in documents:
            w.add_document(doc, np.arange(len(doc)) % 2)
    with open(f"{prefix}.json", "w") as f:
        json.dump({"vocab_size": VOCAB, "eos_id": 0, "loss_mask": {"file": ".mask", "train_on": "assistant"}}, f)


def loss_mask_missing(tmp_path):
    _chat_shard(tmp_path / "chat", _documents(2))
    os.remove(tmp_path / "chat.mask")
    return [f"data.paths=[{tmp_path}/chat]"], \
        [f"{tmp_path}/chat.mask does not exist", "says the shard has a loss mask", "copy it with the shard"]


def loss_mask_truncated(tmp_path):
    _chat_shard(tmp_path / "chat", _documents(2))
    size = os.path.getsize(tmp_path / "chat.mask")
    os.truncate(tmp_path / "chat.mask", size - 5)
    return [f"data.paths=[{tmp_path}/chat]"], [f"{tmp_path}/chat.mask is truncated", f"expected {size} bytes"]


def source_mixing_chat_and_plain_shards(tmp_path):
    _good(tmp_path)
    _chat_shard(tmp_path / "chat", _documents(2))
    return [f"data.paths=[{tmp_path}/a,{tmp_path}/chat]"], \
        ["source 'data' mixes shards with a loss mask", f"({tmp_path}/chat.bin)", f"({tmp_path}/a.bin)",
         "separate data.blend sources"]


BAD_SHARDS = [missing_shard, missing_bin, truncated_bin, bad_idx_magic, idx_cut_short, idx_for_another_bin,
              empty_blend_source, glob_matching_nothing, vocabulary_larger_than_the_model,
              foreign_shard_with_a_token_past_the_vocabulary, auto_vocabulary_not_recorded, validation_shard_missing,
              fewer_tokens_than_a_sample, split_holding_out_less_than_a_sample,
              validation_shards_shorter_than_a_sample, loss_mask_missing, loss_mask_truncated,
              source_mixing_chat_and_plain_shards]


def _validate(make_config, pm, overrides):
    return validate(make_config("data=indexed", "model.vocab_size=512", "data.index_cache=false", *overrides), 1, pm)


@pytest.mark.parametrize("damage", BAD_SHARDS, ids=[f.__name__ for f in BAD_SHARDS])
def test_a_bad_shard_is_one_line_naming_it(make_config, pm, tmp_path, damage):
    overrides, fragments = damage(tmp_path)
    problems = _validate(make_config, pm, overrides)
    assert len(problems) == 1, problems
    [line] = problems
    assert "\n" not in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


def test_good_shards_pass(make_config, pm, tmp_path):
    assert _validate(make_config, pm, _good(tmp_path)) == []
    blend = f"data.blend=[{{paths:[{tmp_path}/a],weight:0.7}},{{paths:[{tmp_path}/b],weight:0.3}}]"
    assert _validate(make_config, pm, [blend, "data.split=0.2"]) == []
    assert _validate(make_config, pm, _good(tmp_path) + [f"data.validation.paths=[{tmp_path}/b]"]) == []
    _shard(tmp_path / "foreign", [[5, 6, 7] * 30, [1, 255, 2] * 30], vocab=None)
    assert _validate(make_config, pm, [f"data.paths=[{tmp_path}/foreign]", "model.vocab_size=256"]) == []
    # chat shards: one short conversation is a sample (packed, padded), and a blend may mix chat and plain sources
    _chat_shard(tmp_path / "chat", [[1, 2, 3]])
    assert _validate(make_config, pm, [f"data.paths=[{tmp_path}/chat]"]) == []
    blend = f"data.blend=[{{paths:[{tmp_path}/a],weight:0.5}},{{paths:[{tmp_path}/chat],weight:0.5}}]"
    assert _validate(make_config, pm, [blend]) == []

