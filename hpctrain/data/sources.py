"""Token sources: the embedded corpus, one legacy ``.bin`` token file, or
Megatron-format shards (``data.source=indexed``).

A legacy token file is a flat array of uint16 or uint32 token ids with a
JSON sidecar (``<name>.json``: dtype, vocab_size, num_tokens). Every rank
opens the same file and reads only the windows it samples, with positioned
reads (``hpctrain.data.tokenfile``: a file that shrinks under the job is an
agreed error, not SIGBUS). Validation checks its size against the sidecar
and the dtype before step 1.

Indexed shards (``data.paths`` or ``data.blend``, written by
``hpctrain-prepare``) are indexed once by rank 0 (``index``) and every
rank gets the tables by broadcast; ``orders.sample_orders`` turns them
into the training and validation sample orders the cursor draws from.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hpctrain.bootstrap import get_runtime
from hpctrain.data.embedded import generate_corpus
from hpctrain.data.index import index_on_rank0
from hpctrain.data.indexed import read_json_object
from hpctrain.data.streams import unknown_documents
from hpctrain.data.tokenfile import TokenFile, refill_advice, size_problem
from hpctrain.errors import ConfigError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass
class TokenSource:
    name: str
    tokens: Any  # 1-D, any unsigned int dtype: an ndarray, or a TokenFile read window by window
    vocab_size: int

    def __len__(self) -> int:
        return len(self.tokens)


def embedded_source(num_bytes: int, seed: int) -> TokenSource:
    data = np.frombuffer(generate_corpus(num_bytes, seed), dtype=np.uint8)
    return TokenSource(name=f"embedded(seed={seed}, {num_bytes} bytes)", tokens=data, vocab_size=256)


def sidecar_path(bin_path: str) -> str:
    return os.path.splitext(bin_path)[0] + ".json"


def read_sidecar(bin_path: str) -> Optional[dict]:
    """The sidecar's fields, or None without one; ValueError if it is not a JSON object."""
    return read_json_object(sidecar_path(bin_path))


def token_file_source(path: str, dtype: Optional[str] = None) -> TokenSource:
    try:
        meta = read_sidecar(path) or {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path={path}: its sidecar {sidecar_path(path)} cannot be read ({e}); "
                          f"{refill_advice(path)}") from None
    dtype = dtype or meta.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(
            f"token file {path}: dtype unknown ({dtype!r}); set data.dtype=uint16 or uint32, "
            f"or write it with hpctrain-prepare (which records it in {sidecar_path(path)})"
        )
    # the sidecar's count, not the size now: every rank gets the same sample order (validation
    # has checked that the two agree; a file that shrinks later fails at the step that reads past its end)
    tokens = TokenFile(path, TOKEN_DTYPES[dtype], meta.get("num_tokens"))
    vocab = int(meta.get("vocab_size") or (tokens.max() + 1))
    return TokenSource(name=path, tokens=tokens, vocab_size=vocab)


def _token_file_problems(data: Any, seq_len: int, model_vocab: int) -> list:
    """At most one line per problem of a token file that exists: its sidecar,
    dtype and size (``hpctrain.data.tokenfile.size_problem``), then what the
    run needs of it."""
    path, side = data.path, sidecar_path(data.path)
    try:
        meta = read_sidecar(path) or {}
    except (OSError, ValueError) as e:
        return [f"data.path={path}: its sidecar {side} cannot be read ({e}); {refill_advice(path)}"]
    if data.dtype and meta.get("dtype") and data.dtype != meta["dtype"]:
        return [f"data.dtype={data.dtype} but the sidecar {side} of data.path={path} says {meta['dtype']}; "
                "leave data.dtype unset (null) to use the sidecar's"]
    dtype = data.dtype or meta.get("dtype")
    if dtype not in TOKEN_DTYPES:
        return [f"data.path={path}: token dtype unknown; set data.dtype=uint16 or uint32"]
    count = meta.get("num_tokens")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        return [f"data.path={path}: its sidecar {side} has num_tokens={count!r}, not a token count; "
                f"re-run hpctrain-prepare <input.txt> {path}"]
    size = os.path.getsize(path)
    wrong = size_problem(f"data.path={path}", path, size, np.dtype(TOKEN_DTYPES[dtype]), count, f"its sidecar {side}")
    if wrong:
        return [wrong]
    problems = []
    n = count if count is not None else size // np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if n < seq_len + 1:
        problems.append(f"data.path={path} has {n} tokens, fewer than trainer.seq_len+1={seq_len + 1}")
    vocab = meta.get("vocab_size")
    if vocab is not None and vocab > model_vocab:
        problems.append(f"data.path={path} has vocab_size {vocab} > model.vocab_size={model_vocab}; "
                        f"set model.vocab_size={vocab}")
    return problems


def check_data_config(data: Any, seq_len: int, model_vocab: int) -> list:
    """Problems with the data section, as one-line messages (no I/O beyond stat/sidecar)."""
    problems = []
    if data.source == "embedded":
        if data.embedded_bytes < 2 * (seq_len + 1):
            problems.append(f"data.embedded_bytes={data.embedded_bytes} is too small for trainer.seq_len={seq_len}; "
                            f"use at least {2 * (seq_len + 1)}")
        if model_vocab < 256:
            problems.append(f"the embedded corpus is byte-level (256 tokens) but model.vocab_size={model_vocab}; "
                            "set model.vocab_size>=256")
    elif data.source == "indexed":
        problems += _indexed_problems(data, seq_len, model_vocab)
    elif data.source == "tokens":
        if not data.path:
            problems.append("data.source=tokens needs data.path=<file.bin> "
                            "(make one with: hpctrain-prepare input.txt out.bin)")
        elif not os.path.isfile(data.path):
            problems.append(f"data.path={data.path} does not exist; "
                            f"make it with: hpctrain-prepare <input.txt> {data.path}")
        else:
            problems += _token_file_problems(data, seq_len, model_vocab)
    else:
        problems.append(f"data.source={data.source!r} is not one of: embedded, tokens, indexed")
    if data.source != "indexed" and (data.paths or data.blend or data.validation.paths or data.split):
        problems.append(f"data.paths, data.blend, data.validation.paths and data.split are for Megatron-format shards; "
                        f"set data.source=indexed (data=indexed), not {data.source}")
    if data.document_mask and data.source != "indexed":
        problems.append(unknown_documents(f"data.source={data.source}"))
    if data.stage.dir and data.source != "indexed":
        problems.append(f"data.stage.dir={data.stage.dir} stages Megatron shards (data.source=indexed); "
                        f"data.source={data.source} has none: leave data.stage.dir unset (null)")
    if data.stage.all and not data.stage.dir:
        problems.append("data.stage.all=true needs data.stage.dir=<a node-local directory> to copy the shards to")
    return problems


def _indexed_problems(data: Any, seq_len: int, model_vocab: int) -> list:
    """Rank 0 indexes the shards (the other ranks never touch them before
    training; the problems are agreed with theirs) and reports what it found."""
    if not (data.paths or data.blend):
        return ["data.source=indexed needs data.paths=[<shards>] or data.blend (shards written by hpctrain-prepare)"]
    if data.paths and data.blend:
        return ["set data.paths (one source) or data.blend (several), not both"]
    problems = []
    for i, source in enumerate(data.blend):
        weight = source.weight
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            problems.append(f"data.blend[{i}].weight={weight}: must be a finite number > 0 (the weights are "
                            "normalised); drop the source to leave it out")
        if not source.paths:
            problems.append(f"data.blend[{i}].paths is empty; give the source's shards (prefixes, directories, "
                            "globs or manifests)")
    if data.split and data.validation.paths:
        problems.append(f"data.split={data.split} and data.validation.paths both choose the validation documents; "
                        "set one (data.split=0 to use the validation shards)")
    if problems:
        return problems
    if not get_runtime().is_main:
        return []
    index = index_on_rank0(data, model_vocab)
    problems = list(index.problems)
    for s in index.sources:
        if s.masked:  # chat data: whole conversations packed, padded; one conversation makes a sample
            continue
        if len(s.train.length) and int(s.train.length.sum()) < seq_len + 1:
            problems.append(f"source {s.name!r} has {int(s.train.length.sum())} training tokens, fewer than "
                            f"trainer.seq_len+1={seq_len + 1}")
        held = 0 if s.valid is None else int(s.valid.length.sum())
        if s.valid is not None and held < seq_len + 1:
            problems.append(f"data.split={data.split} holds out {held} tokens of source {s.name!r}, fewer than one "
                            f"sample (trainer.seq_len+1={seq_len + 1}); raise data.split or name validation shards "
                            "(data.validation.paths)")
    for s in index.validation:
        if not s.masked and int(s.train.length.sum()) < seq_len + 1:
            problems.append(f"data.validation.paths hold {int(s.train.length.sum())} tokens, fewer than one sample "
                            f"(trainer.seq_len+1={seq_len + 1})")
    return problems


def open_source(data: Any) -> TokenSource:
    """The one flat source of ``data.source=embedded`` or ``tokens``."""
    if data.source == "embedded":
        return embedded_source(data.embedded_bytes, data.seed)
    return token_file_source(data.path, data.dtype)


def data_vocab_size(data: Any) -> Optional[int]:
    """The vocabulary of the data's tokenizer (``model.vocab_size=auto``), where it is recorded."""
    if data.source == "embedded":
        return 256
    if data.source == "tokens":
        try:
            meta = read_sidecar(data.path) or {}
        except (OSError, ValueError):
            return None
        return meta.get("vocab_size")
    return index_on_rank0(data, 0).vocab_size
