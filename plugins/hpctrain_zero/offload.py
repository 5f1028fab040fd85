"""Optimizer-state offload (``parallel.zero.offload``).

``nvme``: each flat group's AdamW moments live in a file of its own under
``parallel.zero.offload_dir`` (``rank<r>-<group>.bin``: exp_avg then
exp_avg_sq, fp32), memory-mapped; the optimizer steps one group at a time
and afterwards writes that group's pages back and drops them from memory
(``madvise(MADV_DONTNEED)``), so the resident memory holds one group's
moments at a time instead of all of them. The page cache may still hold
the files; that memory is the kernel's to reclaim. Files are rewritten
from the start of each run (checkpoints hold the state, not these files).

``cpu`` (GPU runs): the fp32 master chunks and the moments stay in pinned
host memory and AdamW runs on the host; shard gradients come down after
the reduce-scatter and updated parameters go up (stage 3: each gather
copies the master chunk up first). On a CPU-only run everything is on the
host already and ``cpu`` changes nothing. The GPU path is checked by
``scripts/gpu_smoke.sh`` (2 ranks sharing one GPU over the mpi and hier
backends, stages 1-3, fp32 and bf16); CI has no GPU.
"""
from __future__ import annotations

import mmap
import os
from typing import Dict, List, Tuple

import numpy as np
import torch


class MappedState:
    """One flat group's moments in a memory-mapped file."""

    def __init__(self, path: str, numel: int):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.array = np.memmap(path, dtype=np.float32, mode="w+", shape=(2, max(numel, 1)))
        self.exp_avg = torch.from_numpy(self.array[0, :numel])
        self.exp_avg_sq = torch.from_numpy(self.array[1, :numel])

    def release(self) -> None:
        """Write the pages back and drop them from this process's memory."""
        self.array.flush()
        handle = getattr(self.array, "_mmap", None)
        if handle is not None and hasattr(handle, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            handle.madvise(mmap.MADV_DONTNEED)

    @property
    def nbytes(self) -> int:
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes


def mapped_states(directory: str, rank: int, groups: List[Tuple[str, int]]) -> Dict[str, MappedState]:
    """A MappedState per (flat group name, chunk numel)."""

    def safe(name: str) -> str:
        return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)

    return {name: MappedState(os.path.join(directory, f"rank{rank}-{safe(name)}.bin"), numel)
            for name, numel in groups}
