"""Export a checkpoint's model weights as safetensors in Hugging Face Llama naming.

Names: ``tok_embeddings`` -> ``model.embed_tokens``; per layer ``attn.w{q,k,v,o}``
-> ``self_attn.{q,k,v,o}_proj``, ``ffn.w1/w3/w2`` -> ``mlp.gate/up/down_proj``,
``attn_norm`` / ``ffn_norm`` -> ``input_layernorm`` / ``post_attention_layernorm``;
``norm`` -> ``model.norm``; ``output`` -> ``lm_head`` (left out when the
embeddings are tied: HF then sets ``tie_word_embeddings``). Linear weights
are (out, in) in both, so no transposes.

RoPE: our ``apply_rope`` rotates interleaved pairs (dims 2i, 2i+1 of a head
share frequency i); HF Llama's ``rotate_half`` rotates dims i and i + d/2.
Permuting the rows of each head of ``q_proj`` and ``k_proj`` to
``[0, 2, 4, ..., d-2, 1, 3, ..., d-1]`` turns one into the other: the
rotated q and k come out permuted the same way within each head, and the
attention scores q.k are unchanged, so the exported model computes the same
function (tests/unit/checkpoint/test_export.py checks this on a small tensor).

The safetensors file is written here by hand: the format is an 8-byte
little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw little-endian bytes. Writing it directly avoids a new
dependency for a page of code, streams one tensor at a time (a 70B model
never has to fit in memory), and like the checkpoint involves no pickle.
Each tensor's checksum is verified as it is read.
"""
from __future__ import annotations

import json
import re
import struct
from typing import Any, Dict, List, Optional, Tuple

import h5py
import numpy as np

from hpctrain_h5ckpt import checksum
from hpctrain_h5ckpt.errors import CheckpointError

SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_FLOATS = ("float32", "bfloat16", "float16", "float64")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PER_LAYER = {
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(logical: str) -> Optional[str]:
    """Hugging Face Llama name of a logical tensor name, or None if it has none."""
    if logical in _TOP:
        return _TOP[logical]
    m = _LAYER.match(logical)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}"
    return None


def rope_row_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order taking an interleaved-RoPE projection to HF's rotate_half convention."""
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def model_config(f: h5py.File) -> Any:
    """The ``model`` section of the checkpoint's resolved config."""
    from omegaconf import OmegaConf

    text = f["meta/config"][()]
    return OmegaConf.create(text.decode("utf-8") if isinstance(text, bytes) else str(text)).model


def hf_config(model: Any, torch_dtype: str) -> Dict[str, Any]:
    """A Hugging Face ``config.json`` (LlamaForCausalLM) for the exported weights."""
    from hpctrain.model.shapes import ModelShape

    s = ModelShape.from_config(model)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.d_model,
            "intermediate_size": s.ffn_hidden, "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads,
            "head_dim": s.head_dim, "num_hidden_layers": s.n_layers, "vocab_size": s.vocab_size,
            "rms_norm_eps": float(model.norm_eps), "rope_theta": float(model.rope_theta),
            "max_position_embeddings": int(model.max_seq_len), "tie_word_embeddings": s.tie_embeddings,
            "hidden_act": "silu", "torch_dtype": torch_dtype}


def _torch_dtype(d: h5py.Dataset) -> str:
    value = d.attrs.get("torch_dtype", b"float32")
    return value.decode() if isinstance(value, bytes) else str(value)


def _out_dtype(stored: str, dtype: Optional[str]) -> str:
    return dtype if dtype and stored in _FLOATS else stored


def _convert(arr: np.ndarray, stored: str, target: str) -> np.ndarray:
    """``arr`` as ``target`` (bfloat16 travels as its uint16 pattern)."""
    if target == stored:
        return arr
    from hpctrain_h5ckpt.snapshot import NAME_TO_TORCH, from_numpy, host_copy

    return host_copy(from_numpy(arr, stored).to(NAME_TO_TORCH[target]))


def _read_verified(path: str, dset: h5py.Dataset) -> np.ndarray:
    arr = dset[()]
    stored = np.asarray(dset.attrs.get("checksum"), dtype=np.uint32).reshape(-1)
    got = checksum.whole(arr)
    if not np.array_equal(stored, got):
        raise CheckpointError(f"checkpoint {path}: dataset {dset.name}: checksum mismatch (stored "
                              f"{checksum.fmt(stored)}, computed {checksum.fmt(got)}); the data is corrupt")
    return arr


def export_safetensors(path: str, out: str, dtype: Optional[str] = None) -> List[str]:
    """Write ``out`` from checkpoint ``path``; returns the names written.

    ``dtype`` (float32, bfloat16, float16) converts floating tensors; None keeps them.
    """
    with h5py.File(path, "r") as f:
        model = model_config(f)
        n_heads = int(model.n_heads)
        n_kv = int(model.n_kv_heads) if model.n_kv_heads is not None else n_heads
        head_dim = int(model.d_model) // n_heads
        group = f["model"]
        plan: List[Tuple[str, str]] = []
        unknown: List[str] = []
        for logical in sorted(group):
            name = hf_name(logical)
            if name is None:
                unknown.append(logical)
            else:
                plan.append((logical, name))
        if unknown:
            raise CheckpointError(f"checkpoint {path}: no Hugging Face Llama name for {', '.join(unknown)}")
        header: Dict[str, Any] = {}
        offset = 0
        for logical, name in plan:
            d = group[logical]
            out_dtype = _out_dtype(_torch_dtype(d), dtype)
            nbytes = int(np.prod(d.shape, dtype=np.int64)) * _ITEMSIZE[out_dtype]
            header[name] = {"dtype": SAFETENSORS_DTYPES[out_dtype], "shape": list(d.shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt", "source": "hpctrain-h5ckpt",
                                  "step": str(f["meta"].attrs.get("step")), "rope": "rotate_half"}
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-(8 + len(blob)) % 8)
        with open(out, "wb") as w:
            w.write(struct.pack("<Q", len(blob)))
            w.write(blob)
            for logical, name in plan:
                d = group[logical]
                stored = _torch_dtype(d)
                arr = _convert(_read_verified(path, d), stored, _out_dtype(stored, dtype))
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = n_heads if name.endswith("q_proj.weight") else n_kv
                    if arr.shape[0] != heads * head_dim:
                        raise CheckpointError(f"{logical}: {arr.shape[0]} rows is not {heads} heads x {head_dim}")
                    arr = arr[rope_row_permutation(heads, head_dim)]
                raw = np.require(arr, requirements="C").tobytes()
                begin, end = header[name]["data_offsets"]
                if len(raw) != end - begin:  # pragma: no cover - guards the size arithmetic above
                    raise CheckpointError(f"{logical}: {len(raw)} bytes, header says {end - begin}")
                w.write(raw)
    return [name for _, name in plan]
