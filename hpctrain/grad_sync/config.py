"""How the gradient-sync engine reduces: one dataclass for every mode."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SyncConfig:
    """The engine's options (``hpctrain.grad_sync.engine``).

    All-reduce mode (data parallelism) uses the first three; reduce-scatter
    mode (ZeRO) the rest."""

    cap_bytes: int = 25 << 20
    """Bucket size in bytes (``comm.bucket_mb``); 0: one bucket per parameter.
    Ignored when the caller gives the buckets (ZeRO's flat groups)."""
    wire_dtype: Optional[torch.dtype] = None
    """bf16/fp16 on the wire with fp32 sums (all-reduce mode); None: the gradient's dtype."""
    overlap: bool = True
    """Launch buckets from backward's gradient hooks (else all after backward)."""
    reduce_scatter: bool = False
    """Keep only this rank's averaged shard of each bucket (ZeRO)."""
    keep_grads: bool = True
    """``.grad`` is a view of the bucket (False, copy-in: hooks add each fresh gradient into the buffer and drop it)."""
    every_microbatch: bool = False
    """Every backward syncs into the shard (ZeRO-2/3 keep no whole gradient between micro-batches)."""
    dtype: Optional[torch.dtype] = None
    """Reduce-scatter buffers' dtype (None: the parameters')."""
    release_buffers: bool = True
    """Copy-in: free a bucket's buffer once its reduction is done."""
    max_in_flight: Optional[int] = None
    """Copy-in with released buffers: at most this many buffers exist; a new one waits for the oldest reduction."""
    device: Optional[torch.device] = None
    """Where buffers and shards live (None: the parameters' device)."""

    def __post_init__(self) -> None:
        if self.cap_bytes < 0:
            raise ValueError(f"bucket cap must be >= 0 bytes, got {self.cap_bytes}")
        if self.reduce_scatter and self.wire_dtype is not None:
            raise ValueError("a compressed wire dtype is for all-reduce mode; "
                             "reduce-scatter buckets in their own dtype")
        if not self.reduce_scatter and (not self.keep_grads or self.every_microbatch or self.dtype is not None):
            raise ValueError("keep_grads=False, every_microbatch and dtype are options of reduce-scatter mode")
        if self.every_microbatch and self.keep_grads:
            raise ValueError("every_microbatch syncs each backward into the shard: use it with keep_grads=False")
