"""Token sources: the embedded corpus, or a memory-mapped ``.bin`` token file.

A token file is a flat array of uint16 or uint32 token ids with a JSON
sidecar (``<name>.json``: dtype, vocab_size, num_tokens) written by
``hpctrain-prepare``. It is opened with ``np.memmap``, so every rank maps the
same file and reads only the windows it samples.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hpctrain.data.embedded import generate_corpus
from hpctrain.errors import ConfigError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass
class TokenSource:
    name: str
    tokens: np.ndarray  # 1-D, any unsigned int dtype
    vocab_size: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def embedded_source(num_bytes: int, seed: int) -> TokenSource:
    data = np.frombuffer(generate_corpus(num_bytes, seed), dtype=np.uint8)
    return TokenSource(name=f"embedded(seed={seed}, {num_bytes} bytes)", tokens=data, vocab_size=256)


def sidecar_path(bin_path: str) -> str:
    return os.path.splitext(bin_path)[0] + ".json"


def read_sidecar(bin_path: str) -> Optional[dict]:
    path = sidecar_path(bin_path)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def token_file_source(path: str, dtype: Optional[str] = None) -> TokenSource:
    meta = read_sidecar(path) or {}
    dtype = dtype or meta.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(
            f"token file {path}: dtype unknown ({dtype!r}); set data.dtype=uint16 or uint32, "
            f"or write it with hpctrain-prepare (which records it in {sidecar_path(path)})"
        )
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")
    vocab = int(meta.get("vocab_size") or (int(tokens.max()) + 1))
    return TokenSource(name=path, tokens=tokens, vocab_size=vocab)


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
    elif data.source == "tokens":
        if not data.path:
            problems.append("data.source=tokens needs data.path=<file.bin> (make one with: hpctrain-prepare input.txt out.bin)")
        elif not os.path.isfile(data.path):
            problems.append(f"data.path={data.path} does not exist; make it with: hpctrain-prepare <input.txt> {data.path}")
        else:
            meta = read_sidecar(data.path) or {}
            dtype = data.dtype or meta.get("dtype")
            if dtype not in TOKEN_DTYPES:
                problems.append(f"data.path={data.path}: token dtype unknown; set data.dtype=uint16 or uint32")
            else:
                n = os.path.getsize(data.path) // np.dtype(TOKEN_DTYPES[dtype]).itemsize
                if n < seq_len + 1:
                    problems.append(f"data.path={data.path} has {n} tokens, fewer than trainer.seq_len+1={seq_len + 1}")
                vocab = meta.get("vocab_size")
                if vocab is not None and vocab > model_vocab:
                    problems.append(f"data.path={data.path} has vocab_size {vocab} > model.vocab_size={model_vocab}; "
                                    f"set model.vocab_size={vocab}")
    else:
        problems.append(f"data.source={data.source!r} is not one of: embedded, tokens")
    return problems


def open_source(data: Any) -> TokenSource:
    if data.source == "embedded":
        return embedded_source(data.embedded_bytes, data.seed)
    return token_file_source(data.path, data.dtype)
