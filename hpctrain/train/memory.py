"""Peak memory per rank: what each rank held at most, and which rank held the most.

Every rank reports its own peaks (CPU: the process's peak resident set; CUDA:
the caching allocator's maximum allocated and reserved bytes); every
``trainer.log_every`` steps one all-gather over the world gives rank 0 all of
them, so the log and the metrics show the min and max over the ranks and
the rank holding the max (pipeline ends and ZeRO shards differ), and the
report draws one bar per rank.
"""
from __future__ import annotations

import resource
import sys
from typing import Dict, List

import torch

from hpctrain.mesh import AXES, Mesh


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def local_peaks(device: torch.device) -> Dict[str, float]:
    """This rank's peaks, by metric name."""
    out = {"peak_rss_bytes": float(peak_rss_bytes())}
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
        out["cuda_max_reserved_bytes"] = float(torch.cuda.max_memory_reserved(device))
    return out


def gather_peaks(mesh: Mesh, device: torch.device) -> Dict[str, List[float]]:
    """Every rank's peaks, by metric name, in world-rank order (collective over the world)."""
    mine = local_peaks(device)
    names = sorted(mine)
    world = mesh.group(AXES)
    if world.size == 1:
        return {n: [mine[n]] for n in names}
    local = torch.tensor([mine[n] for n in names], dtype=torch.float64, device=device)
    everyone = torch.empty(world.size * len(names), dtype=torch.float64, device=device)
    world.communicator().all_gather(everyone, local)
    rows = everyone.view(world.size, len(names)).tolist()
    return {n: [row[i] for row in rows] for i, n in enumerate(names)}


def summarise(per_rank: Dict[str, List[float]]) -> Dict[str, float]:
    """``<name>.min``, ``<name>.max`` and ``<name>.max_rank`` of each gathered peak."""
    out: Dict[str, float] = {}
    for name, values in per_rank.items():
        top = max(range(len(values)), key=lambda r: values[r])
        out.update({f"{name}.min": min(values), f"{name}.max": values[top], f"{name}.max_rank": top})
    return out
