"""Typed options of the ZeRO plugin: the ``parallel.zero`` config section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

DTYPES: Dict[str, Optional[torch.dtype]] = {"none": None, "fp32": torch.float32, "bf16": torch.bfloat16,
                                            "fp16": torch.float16}
SHARD_GROUPS = ("world", "node")
OFFLOADS = ("none", "cpu", "nvme")


@dataclass
class ZeroConfig:
    """ZeRO / FSDP-style sharding over the data axes (cp x ep x dp)."""

    stage: int = 0
    """0: plain data parallelism; 1: optimizer state sharded; 2: also gradients; 3: also parameters."""
    reshard_after_forward: bool = True
    """Stage 3: free a unit's gathered parameters after its forward and gather them again for backward (false
    keeps them until its backward: more memory, fewer all-gathers)."""
    param_dtype: str = "none"
    """Dtype parameters are gathered and computed in (bf16 halves the all-gather); none: the parameters' own.
    Master shards stay fp32."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduce-scattered and accumulated in."""
    shard_group: str = "world"
    """world: shard over the whole data group; node: shard within each node and replicate across nodes (HSDP /
    ZeRO++ hpZ)."""
    offload: str = "none"
    """none; cpu: optimizer state in pinned host memory (GPU runs); nvme: optimizer state in memory-mapped
    files under offload_dir."""
    offload_dir: Optional[str] = None
    """Directory of the nvme offload files (one per rank and unit); None: <run dir>/zero_offload."""


def dtype_of(name: str) -> Optional[torch.dtype]:
    return DTYPES[name]
