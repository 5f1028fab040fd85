"""Read a Hugging Face model's weights lazily, each rank only its slices.

``HfWeights(dir, ...)`` opens the directory's safetensors (one
``model.safetensors``, or the shards ``model.safetensors.index.json`` maps)
through the ``safetensors`` library, a file only when a tensor in it is
wanted, and ``box(logical, box)`` reads exactly that box of a logical
tensor with ``safe_open(...).get_slice(name)[...]``: a tensor-parallel rank
reads its rows, an expert-parallel rank its experts, a pipeline stage its
layers, so no process ever holds the whole model (a 70B import included).
q_proj / k_proj rows (weights and biases, and the qk-norm weights) come back
in our interleaved RoPE order
(``hpctrain.hf.names``): the slice read covers the whole heads the box
touches, which is the box itself under tensor parallelism (whole heads per
rank).

``check(expected)`` is validation's look at the directory before any
collective: every shard the index names exists and is as long as its header
says (a truncated download or copy: one line naming the file, whether the cut
is in the header or in the data, which the library would only meet when the
tensors are read), every tensor the model needs is there with its shape
(only the files' headers are read).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from hpctrain.checkpoint import weight_mismatches
from hpctrain.errors import ConfigError
from hpctrain.finetune.adapter import is_adapter_name
from hpctrain.hf import PREFIX
from hpctrain.hf.names import HfTensor, hf_tensor, moe_family, rope_row_permutation
from hpctrain.model.build import build_model
from hpctrain.model.shapes import ModelShape
from hpctrain.shard import get_spec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

Box = Sequence[Tuple[int, int]]


def safe_open(path: str, framework: str = "pt"):
    """``safetensors.safe_open`` (one name to wrap: the import-byte test counts what is read through it)."""
    from safetensors import safe_open as _open  # optional: the hf extra

    return _open(path, framework=framework)


class HfWeights:
    """The weights of Hugging Face directory ``hf_dir`` for a model with these heads and experts (``family``:
    the MoE architecture's tensor names, ``hpctrain.hf.names.MOE_FAMILIES``)."""

    def __init__(self, hf_dir: str, n_heads: int, n_kv_heads: int, head_dim: int, num_experts: int = 0,
                 family: str = "mixtral"):
        self.dir = hf_dir
        self.n_heads, self.n_kv_heads, self.head_dim, self.num_experts = n_heads, n_kv_heads, head_dim, num_experts
        self.family = family
        self._files: Dict[str, Any] = {}
        self.weight_map, problems = weight_map(hf_dir)
        if problems:
            raise ConfigError("\n".join(problems))

    def where(self, logical: str) -> Optional[HfTensor]:
        return hf_tensor(logical, self.n_heads, self.n_kv_heads, self.num_experts, self.family)

    def _slice(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(os.path.join(self.dir, file))
        return self._files[file].get_slice(name)

    def box(self, logical: str, box: Box) -> torch.Tensor:
        """The values of ``box`` of logical tensor ``logical``, in fp32."""
        found = self.where(logical)
        if found is None:
            raise KeyError(f"{logical} has no Hugging Face tensor")
        if len(found.names) > 1:  # experts stacked on dim 0: one tensor per expert
            (e0, e1), rest = box[0], box[1:]
            return torch.stack([self._read(found.names[e], rest) for e in range(e0, e1)])
        if found.rope_heads is None:
            return self._read(found.names[0], box)
        (a, b), rest = box[0], box[1:]
        d = self.head_dim
        h0, h1 = a // d, -(-b // d)
        inverse = np.argsort(rope_row_permutation(found.rope_heads, d))
        rows = self._read(found.names[0], [(h0 * d, h1 * d)] + list(rest))
        return rows[torch.from_numpy(inverse[a:b] - h0 * d)]

    def _read(self, name: str, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        sl = self._slice(name)
        index = tuple(slice(lo, hi) for lo, hi in box)
        return sl[index].to(torch.float32) if index else sl[:].to(torch.float32)

    def close(self) -> None:
        self._files.clear()


def weight_map(hf_dir: str) -> Tuple[Dict[str, str], List[str]]:
    """Tensor name -> file (relative to ``hf_dir``), or the problems (no weights, a missing shard)."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                mapping = dict(json.load(f)["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return {}, [f"{index} is not a safetensors index ({e}); download or copy it again"]
        missing = sorted({f for f in mapping.values() if not os.path.isfile(os.path.join(hf_dir, f))})
        if missing:
            return {}, [f"{hf_dir}: shard {missing[0]} named by {INDEX} is missing"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                        + "; download or copy the whole directory again"]
        return mapping, []
    single = os.path.join(hf_dir, SINGLE)
    if os.path.isfile(single):
        damaged = file_problem(single)
        if damaged:
            return {}, [damaged]
        try:
            with safe_open(single) as f:
                return {name: SINGLE for name in f.keys()}, []
        except Exception as e:  # noqa: BLE001 - the library's own error type: one line, before any collective
            return {}, [_unreadable(single, e)]
    if not os.path.isdir(hf_dir):
        return {}, [f"checkpoint.init_from={PREFIX}{hf_dir}: no such directory"]
    return {}, [f"{hf_dir} has neither {SINGLE} nor {INDEX}; hpctrain reads safetensors weights only "
                "(convert a .bin/.pth model with transformers' save_pretrained first)"]


def _unreadable(path: str, e: BaseException) -> str:
    return f"{path} is not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__}); " \
        "download or copy it again"


def file_problem(path: str) -> Optional[str]:
    """Why safetensors file ``path`` is damaged, from its header alone, or None: shorter than the 8-byte
    header length, or than the header it announces, or than the end of its last tensor's data (a
    truncated download or copy, the common case: the header is intact and the data is cut short)."""
    fix = "download or copy it again"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is truncated: {size} bytes, less than a safetensors header's 8-byte length; {fix}"
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                return f"{path} is truncated: {size:,} bytes, but its header alone announces {8 + n:,}; {fix}"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path} cannot be read ({e.strerror}); {fix}"
    except ValueError as e:
        return f"{path} is not a safetensors file (its header is not JSON: {e}); {fix}"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (its header is not a JSON object); {fix}"
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max([int(e) for e in ends if isinstance(e, int)] or [0])
    if size < need:
        return f"{path} is truncated: {size:,} bytes, but its header places tensor data up to byte {need:,}; {fix}"
    return None


def check(hf_dir: str, expected: Mapping[str, Tuple[int, ...]], n_heads: int, n_kv_heads: int,
          num_experts: int = 0, limit: int = 3, model_dir: Optional[str] = None, family: str = "mixtral") -> List[str]:
    """Problems of loading ``hf_dir`` into a model whose logical tensors have the ``expected`` shapes;
    ``model_dir``: the ``model.hf_dir`` the model's shape came from, if any (the fix named depends on it)."""
    mapping, problems = weight_map(hf_dir)
    if problems:
        return problems
    shapes: Dict[str, Tuple[int, ...]] = {}
    by_file: Dict[str, List[str]] = {}
    for name, file in mapping.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        damaged = file_problem(os.path.join(hf_dir, file))
        if damaged:
            return [damaged]
        try:
            with safe_open(os.path.join(hf_dir, file)) as f:
                for name in names:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - any unreadable shard is this one line, before any collective
            return [_unreadable(os.path.join(hf_dir, file), e)]
    missing, wrong = [], []
    mtp_absent = set()
    for logical, shape in expected.items():
        found = hf_tensor(logical, n_heads, n_kv_heads, num_experts, family)
        if found is None:
            missing.append(f"{logical} (no Hugging Face name)")
            continue
        want = tuple(shape[1:]) if len(found.names) > 1 else tuple(shape)
        for name in found.names:
            if name not in shapes and logical.startswith("mtp."):
                mtp_absent.add(name.split(".")[2])  # model.layers.<i>.
            elif name not in shapes:
                missing.append(name)
            elif shapes[name] != want:
                wrong.append(f"{name} is {list(shapes[name])}, the model needs {list(want)}")

    if mtp_absent:
        layers = ", ".join(f"model.layers.{i}" for i in sorted(mtp_absent, key=int))
        depth = len({n.split(".")[2] for n in expected if n.startswith("mtp.")})
        return [f"checkpoint.init_from={PREFIX}{hf_dir}: model.mtp_depth={depth} needs DeepSeek-V3's "
                f"multi-token prediction layer(s) {layers} (num_nextn_predict_layers), which the directory does not "
                "hold (transformers' save_pretrained leaves them out); set model.mtp_depth=0, or start from "
                "weights that have them"]
    return weight_mismatches(f"checkpoint.init_from={PREFIX}{hf_dir}", missing, wrong,
                             *_mismatch_fixes(hf_dir, model_dir), limit)


def _mismatch_fixes(hf_dir: str, model_dir: Optional[str]) -> Tuple[str, str]:
    """(the fix for missing tensors, the fix for tensors of the wrong shape): setting ``model.hf_dir`` only
    where it is not already the weights' directory."""
    if not model_dir:
        fix = f"set model=hf model.hf_dir={hf_dir} so the model takes the directory's shape"
        return fix, fix
    if os.path.realpath(str(model_dir)) != os.path.realpath(hf_dir):
        fix = (f"the model's shape comes from model.hf_dir={model_dir}, another directory: set "
               f"model.hf_dir={hf_dir} too, or init_from the weights of {model_dir}")
        return fix, fix
    damaged = (f"the shape came from {os.path.join(hf_dir, 'config.json')}, which does not describe these "
               "weights: the directory is damaged or mixed from two models; download or copy it again")
    return damaged, damaged


def num_experts_of(cfg: Any) -> int:
    moe = cfg.model.get("moe") if hasattr(cfg.model, "get") else None
    return int(moe.num_experts) if cfg.model.ffn == "moe" and moe is not None else 0


def hf_weights_for(cfg: Any) -> Optional[HfWeights]:
    """The reader ``checkpoint.init_from=hf:DIR`` asks for, or None."""
    src = cfg.checkpoint.get("init_from")
    if not src or not str(src).startswith(PREFIX):
        return None

    s = ModelShape.from_config(cfg.model)
    return HfWeights(str(src)[len(PREFIX):], s.n_heads, s.n_kv_heads, s.head_dim, num_experts_of(cfg),
                     moe_family(cfg.model))


def init_from_problems(cfg: Any, pm: Any) -> List[str]:
    """Validation of ``checkpoint.init_from`` before any collective: hf:DIR is checked against the
    model's logical tensors (built on the meta device: nothing is allocated); another path must exist."""
    src = cfg.checkpoint.get("init_from")
    if not src:
        return []
    src = str(src)
    if not src.startswith(PREFIX):
        if not os.path.exists(src):
            return [f"checkpoint.init_from={src}: no such file or directory; give hf:<Hugging Face directory>, "
                    "a checkpoint file or a checkpoint directory"]
        return []

    model = build_model(cfg, pm)
    expected = {}
    for p in model.parameters():
        spec = get_spec(p)
        if not is_adapter_name(spec.logical_name):  # LoRA adapters start from their init, not the base's files
            expected[spec.logical_name] = tuple(spec.global_shape)
    s = ModelShape.from_config(cfg.model)
    return check(src[len(PREFIX):], expected, s.n_heads, s.n_kv_heads, num_experts_of(cfg),
                 model_dir=cfg.model.get("hf_dir"), family=moe_family(cfg.model))
