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
from typing import Optional, Sequence, Tuple

import h5py
import torch

from hpctrain_h5ckpt import store


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
        from hpctrain_h5ckpt.snapshot import from_numpy

        d = self.group[logical]
        arr = d[tuple(slice(a, b) for a, b in box)]
        value = d.attrs.get("torch_dtype", b"float32")
        return from_numpy(arr, value.decode() if isinstance(value, bytes) else str(value)).float()
