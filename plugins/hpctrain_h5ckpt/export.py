"""Export a checkpoint's model weights as a Hugging Face model directory.

The checkpoint holds logical tensors whatever the layout that saved it, so
the export reads each one whole (its checksum verified) in one process with
the default HDF5 driver and hands it to the core's writer
(``hpctrain.hf.export.write_hf_dir``: names, RoPE row order, experts, the
safetensors shards and their index, config.json, generation_config.json).
Persistent buffers (``/buffers``: DeepSeek-V3's expert bias) are written
beside the weights. The run's tokenizer files are copied alongside: those
of ``model.hf_dir`` (an imported model), the one its hpctrain-prepare
shards were made with (whose BOS/EOS ids also go into config.json when the
model config has none) and any ``--tokenizer`` given.

A LoRA run's checkpoint (``finetune=lora``) holds the base weights and the
adapters: ``--merge`` exports the merged model, ``--adapter DIR`` the
adapters alone in the PEFT format (``hpctrain.finetune.peft_export``).
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, List, Optional

import h5py
import numpy as np
import torch
from omegaconf import OmegaConf

from hpctrain.data.tokenize import TokenizerError, tokenizer_vocab_size
from hpctrain.errors import ConfigError
from hpctrain.finetune.adapter import is_adapter_name
from hpctrain.finetune.peft_export import merged_entries, write_adapter_dir
from hpctrain.hf.export import Entry, check_target, data_tokenizer, write_hf_dir

from hpctrain_h5ckpt import checksum
from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.snapshot import from_numpy

_LAYER = re.compile(r"^layers\.(\d+)\.")


def run_config(f: h5py.File) -> Any:
    """The checkpoint's resolved config."""

    text = f["meta/config"][()]
    return OmegaConf.create(text.decode("utf-8") if isinstance(text, bytes) else str(text))


def model_config(f: h5py.File) -> Any:
    """The ``model`` section of the checkpoint's resolved config."""
    return run_config(f).model


def _torch_dtype(d: h5py.Dataset) -> str:
    value = d.attrs.get("torch_dtype", b"float32")
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_verified(path: str, dset: h5py.Dataset) -> torch.Tensor:
    arr = dset[()]
    stored = np.asarray(dset.attrs.get("checksum"), dtype=np.uint32).reshape(-1)
    got = checksum.whole(arr)
    if not np.array_equal(stored, got):
        raise CheckpointError(f"checkpoint {path}: dataset {dset.name}: checksum mismatch (stored "
                              f"{checksum.fmt(stored)}, computed {checksum.fmt(got)}); the data is corrupt")
    return from_numpy(arr, _torch_dtype(dset)).float()


def _reader(path: str, dset: h5py.Dataset) -> Callable[[], torch.Tensor]:
    return lambda: _read_verified(path, dset)


def _order(logical: str) -> tuple:
    """Hugging Face's order: the embedding, the layers in turn, the final norm, the head."""
    m = _LAYER.match(logical)
    if logical.startswith("tok_embeddings"):
        return (0, 0, logical)
    if m:
        return (1, int(m.group(1)), logical)
    return (2, 0 if logical.startswith("norm") else 1, logical)


def _check_tokenizer(tokenizer: str, model_vocab: Any) -> None:
    """``--tokenizer``: one that exists and whose ids all have a row in the model's embedding."""

    try:
        vocab = tokenizer_vocab_size(tokenizer)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None
    if isinstance(model_vocab, int) and vocab > model_vocab:
        raise ConfigError(f"--tokenizer {tokenizer} has {vocab} tokens, more than the model's vocabulary of "
                          f"{model_vocab} (model.vocab_size): its ids from {model_vocab} on have no embedding row; "
                          "give the tokenizer the model was trained with")


def _open(path: str) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot be opened as HDF5 ({e}); the file is truncated, torn "
                              "or not a checkpoint") from None


def _entries(path: str, f: h5py.File) -> List[Entry]:
    group = f["model"]
    return [Entry(name, tuple(group[name].shape), _reader(path, group[name])) for name in sorted(group, key=_order)]


def _with_buffers(path: str, f: h5py.File, entries: List[Entry]) -> List[Entry]:
    """``entries`` and the checkpoint's persistent buffers (``/buffers``: a sigmoid router's selection bias,
    DeepSeek-V3's e_score_correction_bias), in Hugging Face's order."""
    group = f.get("buffers")
    if group is None or not len(group):
        return entries
    more = [Entry(name, tuple(group[name].shape), _reader(path, group[name])) for name in group]
    return sorted(entries + more, key=lambda e: _order(e.logical))


def export_adapter(path: str, out: str, overwrite: bool = False) -> List[str]:
    """Write the PEFT adapter of LoRA checkpoint ``path`` to ``out`` (``write_adapter_dir``); returns the files."""
    check_target(out, overwrite)
    with _open(path) as f:
        return write_adapter_dir(out, run_config(f), _entries(path, f), overwrite)


def export_hf(path: str, out: str, dtype: str = "float32", max_shard_bytes: int = 5 * 10**9,
              tokenizer: Optional[str] = None, overwrite: bool = False, merge: bool = False) -> List[str]:
    """Write Hugging Face directory ``out`` from checkpoint ``path``; returns the files written. A
    directory ``out`` that holds files is refused unless ``overwrite``, then replaced whole, atomically
    (``write_hf_dir``). ``merge``: a LoRA checkpoint's adapters merged into their projections."""

    check_target(out, overwrite)
    with _open(path) as f:
        cfg = run_config(f)
        model = cfg.model
        if tokenizer:
            _check_tokenizer(tokenizer, model.vocab_size)
        entries = _with_buffers(path, f, _entries(path, f))
        if merge:
            entries = merged_entries(cfg, entries)
        elif any(is_adapter_name(e.logical) for e in entries):
            raise ConfigError(f"checkpoint {path} holds LoRA adapters (finetune=lora): pass --merge for the merged "
                              "model, or --adapter DIR for the adapters in the PEFT format")
        sources = [str(model.hf_dir)] if model.get("hf_dir") and os.path.isdir(str(model.hf_dir)) else []
        data_files, token_ids = data_tokenizer(cfg.get("data"))
        sources += [p for p in data_files if os.path.isfile(p)] + ([tokenizer] if tokenizer else [])
        step = f["meta"].attrs.get("step")
        return write_hf_dir(out, model, entries, dtype, max_shard_bytes, sources,
                            {"source": "hpctrain-h5ckpt", "step": str(step)}, token_ids, overwrite)
