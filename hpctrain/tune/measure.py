"""What the allocation does, measured with the benchmarks' timing (``hpctrain.bench.common``).

Matmul: each rank times the model's own GEMMs (QKV, attention output, MLP
up and down projections at one micro-batch's tokens) at the training
precision, all ranks at once as in training; the slowest rank's median
gives TFLOP/s per device.

Links: for each axis that some candidate layout splits, the mesh of the
planner's best layout using that axis is built exactly as training builds
it (``hpctrain.run.build_mesh``: the configured backend, node placement,
``debug.comm_delay_*`` included) and that axis's group is timed with an
all-reduce of 16 bytes (latency) and one of the message size that axis
carries in training (bandwidth). Alpha-beta fit, the planner's convention
(``hpctrain.planner.comm_model``): latency per ring step = small time /
2(n-1); busbw = bytes x 2(n-1)/n / (large time - the latency part). The
groups are those of a real layout, so inside or across nodes is whatever
that layout's group is; the per-axis link then replaces the intra/inter
model for that axis (``hpctrain.planner.cluster``), and intra/inter take
the best in-node and cross-node figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from omegaconf import OmegaConf

from hpctrain.bench.common import time_collective
from hpctrain.planner.arch import Arch
from hpctrain.planner.comm_model import bus_factor, latency_steps
from hpctrain.run import build_mesh

LATENCY_BYTES = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class AxisLink:
    """One axis's measured group: size, placement, times and the fitted link."""

    axis: str
    size: int
    nodes: int
    message_bytes: int
    small_s: float
    large_s: float
    latency_us: float
    busbw_gbs: float
    layout: str
    """The layout whose mesh was measured."""


def gemm_shapes(model_cfg: Any, tokens: int) -> List[Tuple[int, int, int]]:
    """(m, k, n) of one block's GEMMs at ``tokens`` tokens (tensor parallelism off)."""
    arch = Arch.from_model_config(model_cfg)
    d = arch.d_model
    return [(tokens, d, d + 2 * arch.kv_dim), (tokens, d, d), (tokens, d, 2 * arch.ffn_hidden),
            (tokens, arch.ffn_hidden, d)]


def matmul_tflops(model_cfg: Any, tokens: int, precision: str, device: torch.device, mpi_comm: Any,
                  iters: int = 5) -> float:
    """Dense GEMM TFLOP/s per device at the model's shapes (slowest rank, median). Collective."""
    dtype = DTYPES.get(precision, torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(0)
    operands = [(torch.randn(m, k, generator=gen).to(device, dtype), torch.randn(k, n, generator=gen).to(device, dtype))
                for m, k, n in gemm_shapes(model_cfg, tokens)]
    flops = sum(2.0 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in operands)
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def gemms() -> None:
        for a, b in operands:
            torch.matmul(a, b)

    timing = time_collective(gemms, mpi_comm, warmup=2, iters=iters, sync=sync)
    return flops / timing.median / 1e12


def message_bytes(axis: str, cfg: Any, elem: int) -> int:
    """The size of one of ``axis``'s collectives in training: an activation message for tp, cp, pp
    (one micro-batch's hidden states), a routed-token message for ep, a gradient bucket for dp."""
    t = cfg.trainer
    act = t.micro_batch_size * t.seq_len * cfg.model.d_model * elem
    if axis == "dp":
        return int(cfg.comm.bucket_mb * 2 ** 20)
    return int(act)


def fit_link(n: int, nbytes: int, small_s: float, large_s: float) -> Tuple[float, float]:
    """(latency per ring step in us, busbw in GB/s) of an all-reduce over n ranks."""
    steps = latency_steps("all_reduce", n)
    alpha = small_s / steps
    transfer = large_s - steps * alpha
    if transfer <= 0.05 * large_s:  # the large message was latency-bound: the bandwidth is at least this
        transfer = 0.05 * large_s
    return alpha * 1e6, nbytes * bus_factor("all_reduce", n) / transfer / 1e9


def time_group(comm: Any, n: int, nbytes: int, dtype: torch.dtype, device: torch.device, mpi_comm: Any,
               iters: int = 5) -> Tuple[float, float]:
    """(small, large) all-reduce median seconds on ``comm`` (every world rank calls it)."""
    elem = torch.empty((), dtype=dtype).element_size()
    small = torch.zeros(max(1, LATENCY_BYTES // elem), dtype=dtype, device=device)
    large = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    t_small = time_collective(lambda: comm.all_reduce(small), mpi_comm, warmup=2, iters=iters, sync=sync).median
    t_large = time_collective(lambda: comm.all_reduce(large), mpi_comm, warmup=1, iters=iters, sync=sync).median
    return t_small, t_large


def measure_links(cfg: Any, layouts: Mapping[str, Tuple[str, Dict[str, int]]], rt: Any, pm,
                  iters: int = 5) -> List[AxisLink]:
    """Each axis's link, on the mesh of ``layouts[axis]`` = (label, sizes), ``iters`` timed all-reduces
    per size. Collective: every rank passes the same ``layouts`` (rank 0's, broadcast)."""
    dtype = DTYPES.get(cfg.trainer.precision, torch.float32)
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    for axis, (label, sizes) in layouts.items():
        layout_cfg = OmegaConf.merge(cfg, {"parallel": dict(sizes)})
        mesh = build_mesh(layout_cfg, rt, pm)
        group = mesh.group(axis)
        nbytes = message_bytes(axis, layout_cfg, elem)
        small, large = time_group(group.communicator(), group.size, nbytes, dtype, rt.device, rt.mpi_comm, iters)
        lat, bw = fit_link(group.size, nbytes, small, large)
        nodes = len({rt.rank_nodes[r] for r in group.ranks}) if rt.rank_nodes else 1
        out.append(AxisLink(axis, group.size, nodes, nbytes, small, large, lat, bw, label))
        del mesh, group
    return out


def calibration(matmul: Optional[float], links: List[AxisLink]) -> Dict[str, float]:
    """The calibration file ``hpctrain-plan --calibration`` reads."""
    cal: Dict[str, float] = {}
    if matmul:
        cal["matmul_tflops"] = matmul
    for link in links:
        cal[f"{link.axis}_latency_us"] = link.latency_us
        cal[f"{link.axis}_busbw_gbs"] = link.busbw_gbs
    for level, inside in (("intra", True), ("inter", False)):
        mine = [k for k in links if (k.nodes == 1) == inside]
        if mine:
            cal[f"{level}_latency_us"] = min(k.latency_us for k in mine)
            cal[f"{level}_busbw_gbs"] = max(k.busbw_gbs for k in mine)
    return cal
