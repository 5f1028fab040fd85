"""``checkpoint.init_from=<one of our checkpoints>``: its model weights, each rank reading only its boxes.

A weights-only start (fresh optimizer, step 0, data cursor 0), distinct from
``resume``. The file is opened read-only with the default HDF5 driver on
each rank (no collective: the model is being materialised) and each box a
rank holds is read as a hyperslab of the logical tensor. Box reads cannot
check the per-dataset checksums (they cover whole datasets);
``hpctrain-ckpt verify`` checks a file whole.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple

import h5py
import torch

from hpctrain.checkpoint import weight_mismatches
from hpctrain.finetune.adapter import is_adapter_name
from hpctrain.model.build import build_model
from hpctrain.plugins import get_manager
from hpctrain.shard import get_spec

from hpctrain_h5ckpt import store
from hpctrain_h5ckpt.snapshot import from_numpy


def resolve(path: str) -> Optional[str]:
    """The checkpoint file ``path`` names (a directory: its newest committed one), or None."""
    if os.path.isdir(path):
        found = store.candidates(path)
        return found[0] if found else None
    return path if os.path.isfile(path) and h5py.is_hdf5(path) else None


class H5Weights:
    def __init__(self, path: str):
        self.path = path
        self.file = h5py.File(path, "r")
        self.group = self.file["model"]

    def where(self, logical: str) -> Optional[str]:
        return logical if logical in self.group else None

    def close(self) -> None:
        self.file.close()

    def box(self, logical: str, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        d = self.group[logical]
        arr = d[tuple(slice(a, b) for a, b in box)]
        value = d.attrs.get("torch_dtype", b"float32")
        return from_numpy(arr, value.decode() if isinstance(value, bytes) else str(value)).float()


def init_from_problems(cfg: Any, limit: int = 3) -> List[str]:
    """Validation of ``checkpoint.init_from`` naming one of our checkpoints, before any collective: it is one,
    and it holds every tensor of this model with its shape (the model is built on the meta device)."""
    src = cfg.checkpoint.get("init_from")
    if not src or str(src).startswith("hf:") or not os.path.exists(str(src)):
        return []  # hf:DIR and a path that does not exist: the core's checks
    found = resolve(str(src))
    if found is None:
        return [f"checkpoint.init_from={src} is neither hf:<Hugging Face directory> nor an hpctrain checkpoint "
                "(an HDF5 step_*.h5, or a directory holding committed ones)"]

    with h5py.File(found, "r") as f:
        stored = {name: tuple(d.shape) for name, d in f["model"].items()} if "model" in f else {}
    missing, wrong = [], []
    for p in build_model(cfg, get_manager()).parameters():
        spec = get_spec(p)
        shape = stored.get(spec.logical_name)
        if shape is None:
            if not is_adapter_name(spec.logical_name):  # LoRA on a pretrained checkpoint: adapters from their init
                missing.append(spec.logical_name)
        elif shape != tuple(spec.global_shape):
            wrong.append(f"{spec.logical_name} is {list(shape)}, the model needs {list(spec.global_shape)}")

    return weight_mismatches(f"checkpoint.init_from={found}", missing, wrong,
                             "it was saved by another model: set the model it was trained with",
                             "set the model it was trained with", limit)
