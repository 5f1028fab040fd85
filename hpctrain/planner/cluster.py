"""The machine being planned for: datasheet numbers, optionally replaced by measured ones.

``cluster.*`` (a preset under hpctrain/conf/cluster/ plus overrides) gives GPUs,
GPUs per node, memory, datasheet peak TFLOP/s and per-GPU bus bandwidths
inside and between nodes. A calibration file (JSON, all keys optional)
replaces what was measured on the real system:

    {"matmul_tflops": 720,        dense GEMM TFLOP/s per GPU at the training precision
     "intra_busbw_gbs": 360,      all-reduce busbw inside a node (hpctrain-bench comm, nccl-tests)
     "inter_busbw_gbs": 45,       busbw between nodes, per GPU
     "intra_latency_us": 2,       per ring step
     "inter_latency_us": 5,
     "usable_memory_fraction": 0.9,
     "dp_busbw_gbs": 40,          per axis (tp, cp, ep, dp, pp): what that axis's groups measured
     "dp_latency_us": 30}         (hpctrain-tune writes them); it replaces intra/inter for that axis

A per-axis link is what ``hpctrain-tune`` measured on the groups the
layouts use, node placement included, so it replaces the two-level
intra/inter model for every collective of that axis (the data-parallel
gradient group spans cp, ep and dp: it takes the ``dp`` link). An axis
given only one of its two keys takes the other from intra/inter.

Without calibration, a GPU the planner knows (``hardware.KINDS``, by preset
name) runs GEMMs at its measured maximum achievable matmul rate (MAMF) and
times every other kernel on its HBM bandwidth (``kernels``); any other
accelerator runs GEMM FLOPs at ``DEFAULT_MATMUL_EFFICIENCY`` x peak, an
assumption, and nothing else costs time. The latencies below are assumed.
MFU is always reported against the datasheet peak.

Memory: ``cluster.gpu_mem_gb`` is the marketed capacity, which for HBM parts
is GiB (an "80GB" H100 reports 81,559 MiB: ``hardware``), so the capacity is
``gpu_mem_gb`` x 2^30 bytes; ``usable_memory_fraction`` of it is planned,
the rest left to the CUDA context, communication buffers and the caching
allocator's fragmentation.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from hpctrain.config.store import CONF_DIR
from hpctrain.errors import ConfigError
from hpctrain.planner.comm_model import Link
from hpctrain.planner.hardware import GpuKind, gpu_kind

GIB = 2 ** 30
NVLINK_NCCL_EFFICIENCY = 370 / 450
"""NCCL's bus bandwidth on NVLink over the line rate: "450GB/s is the line rate. With the protocol overhead
(~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" (NCCL maintainer, NVIDIA/nccl-tests issue #212)."""
IB_NCCL_EFFICIENCY = 91 / 100
"""NCCL's bus bandwidth between nodes over the InfiniBand line rate: 91 GB/s busbw on four 200 Gb/s HDR ports
(100 GB/s) between two HGX A100 nodes (NVIDIA/nccl-tests issue #100)."""
DEFAULT_MATMUL_EFFICIENCY = 0.75
DEFAULT_INTRA_LATENCY_US = 2.0
DEFAULT_INTER_LATENCY_US = 5.0
DEFAULT_USABLE_MEMORY_FRACTION = 0.9
"""Leaves 10% for the CUDA context, communication buffers and allocator fragmentation."""

LINK_AXES = ("tp", "cp", "ep", "dp", "pp")
"""Axes that may carry their own measured link (``<axis>_busbw_gbs``, ``<axis>_latency_us``)."""
CALIBRATION_KEYS = ("matmul_tflops", "intra_busbw_gbs", "inter_busbw_gbs", "intra_latency_us",
                    "inter_latency_us", "usable_memory_fraction") + tuple(
    f"{a}_{k}" for a in LINK_AXES for k in ("busbw_gbs", "latency_us"))


@dataclass(frozen=True)
class ClusterSpec:
    """Everything the estimates need, in SI units (bytes, FLOP/s, seconds)."""

    name: str
    gpus: int
    gpus_per_node: int
    mem_bytes: float
    """Memory per GPU the planner may fill (capacity x usable fraction)."""
    capacity_bytes: float
    peak_flops: float
    """Datasheet peak (MFU denominator)."""
    matmul_flops: float
    """Achieved dense GEMM rate used for compute time."""
    intra: Link
    inter: Link
    sources: Dict[str, str] = field(default_factory=dict)
    """Where each number came from (``datasheet``, ``calibration``, ``assumed``)."""
    axis_links: Dict[str, Link] = field(default_factory=dict)
    """Measured links of single axes (calibration ``<axis>_busbw_gbs`` / ``<axis>_latency_us``)."""
    gpu: Optional[GpuKind] = None
    """The accelerator's figures for the kernel-level compute model (None: GEMM FLOPs only)."""

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


def available_presets(group: str) -> List[str]:
    """Preset names under hpctrain/conf/<group>/ (for error messages)."""
    folder = os.path.join(CONF_DIR, group)
    if not os.path.isdir(folder):
        return []
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def load_calibration(path: Optional[str]) -> Dict[str, float]:
    """Read and check a calibration file; {} without one."""
    if not path:
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"calibration file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"calibration file {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"calibration file {path!r} must hold a JSON object with keys among "
                          f"{', '.join(CALIBRATION_KEYS)}")
    unknown = sorted(set(raw) - set(CALIBRATION_KEYS))
    if unknown:
        raise ConfigError(f"calibration file {path!r}: unknown key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(CALIBRATION_KEYS)}")
    out: Dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"calibration file {path!r}: {key}={value!r} must be a positive number")
        out[key] = float(value)
    if out.get("usable_memory_fraction", 0.5) > 1:
        raise ConfigError(f"calibration file {path!r}: "
                          f"usable_memory_fraction={out['usable_memory_fraction']} must be <= 1")
    return out


def check_cluster(c: Any) -> List[str]:
    """Problems with a ClusterConfig, each naming the key to set."""
    presets = ", ".join(f"cluster={p}" for p in available_presets("cluster") if p != "local")
    missing = [k for k in ("gpus", "gpus_per_node", "gpu_mem_gb", "peak_tflops")
               if not getattr(c, k) or getattr(c, k) < 0]
    multi_node = c.gpus > c.gpus_per_node > 0
    needs_intra = min(c.gpus, c.gpus_per_node) > 1
    if needs_intra and c.intra_bw_gbs <= 0:
        missing.append("intra_bw_gbs")
    if multi_node and c.inter_bw_gbs <= 0:
        missing.append("inter_bw_gbs")
    problems: List[str] = []
    if missing:
        problems.append(
            f"cluster '{c.name}' does not say {', '.join('cluster.' + k for k in missing)} "
            f"(zero or negative); set them, or start from a preset ({presets or 'none found'})")
        return problems
    if multi_node and c.gpus % c.gpus_per_node:
        nodes = c.gpus // c.gpus_per_node
        problems.append(
            f"cluster.gpus={c.gpus} is not a whole number of {c.gpus_per_node}-GPU nodes; "
            f"use {nodes * c.gpus_per_node} or {(nodes + 1) * c.gpus_per_node}")
    if multi_node and needs_intra and c.inter_bw_gbs > c.intra_bw_gbs:
        problems.append(
            f"cluster.inter_bw_gbs={c.inter_bw_gbs:g} is larger than cluster.intra_bw_gbs={c.intra_bw_gbs:g}: "
            "between nodes a GPU cannot be faster than inside its node. Both are per-GPU bus bandwidths in "
            "GB/s (bytes, not bits: 400 Gb/s InfiniBand is 50 GB/s); did you swap them?")
    return problems


def cluster_spec(c: Any, calibration: Optional[Mapping[str, float]] = None) -> ClusterSpec:
    """A ClusterSpec from a ClusterConfig and optional calibration; ConfigError on bad input."""
    problems = check_cluster(c)
    if problems:
        raise ConfigError("\n".join(problems))
    cal = dict(calibration or {})
    sources: Dict[str, str] = {}
    gpu = gpu_kind(str(c.name))

    def pick(key: str, default: float, what: str, datasheet: bool) -> float:
        if key in cal:
            sources[what] = "calibration"
            return cal[key]
        sources[what] = "datasheet" if datasheet else "assumed"
        return default

    per_node = min(c.gpus_per_node, c.gpus)
    peak = c.peak_tflops * 1e12
    if gpu is not None and "matmul_tflops" not in cal:
        # the measured rate at the clock a training step sustains; a preset's peak override scales it
        matmul = gpu.sustained_mamf * peak / gpu.peak_flops
        sources["matmul_tflops"] = "measured (MAMF table, sustained clock)"
    else:
        matmul = pick("matmul_tflops", c.peak_tflops * DEFAULT_MATMUL_EFFICIENCY, "matmul_tflops", False) * 1e12
    # a known GPU's preset gives line rates: NCCL reaches a measured share of them (the constants above);
    # a calibration's busbw is what nccl-tests measured and is taken as it is
    intra_eff = NVLINK_NCCL_EFFICIENCY if gpu is not None else 1.0
    inter_eff = IB_NCCL_EFFICIENCY if gpu is not None else 1.0
    intra_bw = pick("intra_busbw_gbs", (c.intra_bw_gbs or c.inter_bw_gbs or 1.0) * intra_eff, "intra_busbw",
                    True) * 1e9
    inter_bw = pick("inter_busbw_gbs", (c.inter_bw_gbs or c.intra_bw_gbs or 1.0) * inter_eff, "inter_busbw",
                    True) * 1e9
    for what in ("intra_busbw", "inter_busbw"):
        if gpu is not None and sources[what] == "datasheet":
            sources[what] = "datasheet x NCCL efficiency"
    intra_lat = pick("intra_latency_us", DEFAULT_INTRA_LATENCY_US, "intra_latency", False) * 1e-6
    inter_lat = pick("inter_latency_us", DEFAULT_INTER_LATENCY_US, "inter_latency", False) * 1e-6
    usable = pick("usable_memory_fraction", DEFAULT_USABLE_MEMORY_FRACTION, "usable_memory", False)
    if matmul > peak * 1.0001:
        raise ConfigError(f"calibration matmul_tflops={matmul / 1e12:g} exceeds cluster.peak_tflops={c.peak_tflops:g}; "
                          "the peak is the datasheet ceiling: fix one of them")
    capacity = c.gpu_mem_gb * GIB
    axis_links: Dict[str, Link] = {}
    for a in LINK_AXES:
        bw, lat = cal.get(f"{a}_busbw_gbs"), cal.get(f"{a}_latency_us")
        if bw is None and lat is None:
            continue
        # the missing half from the level the axis would cross (inter: it may leave the node)
        axis_links[a] = Link(bw * 1e9 if bw is not None else min(intra_bw, inter_bw),
                             lat * 1e-6 if lat is not None else max(intra_lat, inter_lat))
        sources[f"{a}_link"] = "calibration"
    return ClusterSpec(str(c.name), int(c.gpus), int(per_node), capacity * usable, capacity, peak, matmul,
                       Link(intra_bw, intra_lat), Link(inter_bw, inter_lat), sources, axis_links, gpu)
