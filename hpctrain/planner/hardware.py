"""What the compute model needs to know about an accelerator, each figure with its source.

A cluster preset (hpctrain/conf/cluster/) names a GPU kind; ``gpu_kind`` finds
its entry here. Every number below is a vendor datasheet figure or a published
measurement, cited on its line and in docs/planner.md ("Hardware figures");
none was fitted to the published training runs the planner is validated
against (``hpctrain-plan --validate``).

- ``sms``: streaming multiprocessors (NVIDIA A100 / H100 whitepapers), for
  the wave quantization of GEMMs (``kernels.gemm_time``).
- ``peak_flops``: dense BF16 tensor-core peak (datasheets); MFU's denominator.
- ``mamf_flops``: Maximum Achievable Matmul FLOPS, the best BF16 ``torch.matmul``
  rate a shape sweep finds (S. Bekman, ml-engineering, compute/accelerator
  README, "Maximum Achievable Matmul FLOPS comparison table", measured with
  ``mamf-finder.py``): A100 SXM 271.2, H100 SXM 794.5 TFLOP/s ("H200 is the
  same"), H100 SXM FP8 1402.6. This is the rate of a GEMM whose shape fills
  the GPU; smaller ones lose to tile and wave quantization.
- ``hbm_bytes_per_s``: datasheet memory bandwidth (A100 80GB SXM 2,039 GB/s,
  H100 SXM 3.35 TB/s, H200 4.8 TB/s; torchtitan's Grand Teton H100 96 GB
  HBM2e: 2.4 TB/s as its benchmark page states).
- ``HBM_EFFICIENCY`` (0.843): the fraction of the datasheet bandwidth a
  streaming kernel reaches: pc2/GPUInspector.jl docs/src/devices/a100_sxm2.md,
  ``memory_bandwidth()`` 1220.7 GiB/s of the theoretical 1448.4 GiB/s on an
  A100-SXM4-40GB (DGX-A100 at PC2). Applied to every HBM part.
- ``attention``: the fraction of ``peak_flops`` a flash-attention kernel
  reaches on the causal FLOPs it executes (forward + backward): FlashAttention-2
  on the A100 0.50, the low end of "50-73% of the theoretical maximum FLOPs/s
  on A100" (Dao 2023, arXiv:2307.08691, abstract; causal training is the low
  end); FlashAttention-2 on the H100 0.35 ("FlashAttention-2 achieving only
  35% utilization on the H100 GPU", Shah et al. 2024, FlashAttention-3,
  arXiv:2407.08608, abstract); a Hopper-native kernel (FlashAttention-3,
  cuDNN's fused attention that Transformer Engine calls) 0.35 x 1.5 = 0.525,
  the low end of FlashAttention-3's "1.5-2.0x" speed-up over FlashAttention-2
  (same abstract).
- ``sustained_clock``: the SM clock a part holds under sustained dense-matrix
  load at its power limit, as a fraction of the boost clock a short benchmark
  (the MAMF sweep, the FlashAttention microbenchmarks) runs at. H100: a Hopper
  GPU overlapping GEMMs with communication dropped from 1,980 to 1,575 MHz
  (deepseek-ai/DeepGEMM issue #120), 0.795; an H100 PCIe at its 350 W limit
  ran 1,395 of 1,755 MHz (chipsandcheese, "Nvidia's H100: Funny L2, and Tons
  of Bandwidth", 2023), the same 0.795. A100: 1,305 of 1,410 MHz, "the clock
  that can be sustained at a GPU's power limit while running HPL", which
  NVIDIA rates the A100's HPL peak at (G. Lockwood, glennklockwood.com,
  "peak FLOPS"), 0.926 (chipsandcheese saw the A100 hold 1,410 MHz in its
  memory tests, a lighter load than tensor-core GEMMs). Compute-bound kernels
  (GEMMs, attention) scale with it; memory-bound ones do not.
- ``capacity_gib``: nvidia-smi's memory.total of the part (81,559 MiB for the
  H100 80GB HBM3, 81,920 MiB for the A100 80GB: modal-labs/modal-client pull
  request #2797, NVIDIA/nccl issue #1264's nvidia-smi output); the planner
  takes ``cluster.gpu_mem_gb`` as GiB (``cluster.capacity_bytes``), which is
  what the marketed "80GB" of these HBM parts is.

An accelerator the table does not know (a CPU "cluster", a custom preset)
gets ``None``: the planner then times GEMM FLOPs at ``cluster.matmul_flops``
and nothing else, as before this table existed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple

HBM_EFFICIENCY = 1220.7 / 1448.4
"""Achieved / datasheet HBM bandwidth of a streaming kernel (GPUInspector.jl, A100-SXM4-40GB)."""

GEMM_TILES: Tuple[Tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128))
"""Output tiles cuBLAS uses for large half-precision GEMMs ("Matrix Multiplication Background User's
Guide", NVIDIA DU-09799-001, section 2.3, "Typical Tile Dimensions In cuBLAS"); the library picks one
per shape, so the planner takes the one that quantizes least (sections 3.1-3.2)."""


@dataclass(frozen=True)
class GpuKind:
    """One accelerator's compute and memory figures (SI units)."""

    name: str
    sms: int
    peak_flops: float
    mamf_flops: float
    hbm_bytes_per_s: float
    attention: Mapping[str, float] = field(default_factory=dict)
    """Fraction of ``peak_flops`` per attention kernel family (``fa2``, ``fa3``)."""
    fp8_mamf_flops: float = 0.0
    fp32_flops: float = 0.0
    """Non-tensor FP32 peak (datasheets: A100 19.5, H100 SXM 67 TFLOP/s): fp32 matmuls without TF32, as
    hpctrain's context-parallel attention blocks run on a GPU (torch does not allow TF32 matmuls by default)."""
    sustained_clock: float = 1.0
    """Sustained / boost SM clock under full load (module docstring)."""
    source: str = ""

    @property
    def hbm_effective(self) -> float:
        """Bytes per second a memory-bound kernel moves."""
        return self.hbm_bytes_per_s * HBM_EFFICIENCY

    def attention_flops(self, kernel: str) -> float:
        """FLOP/s of a fused attention kernel on the FLOPs it executes."""
        if kernel not in self.attention:
            raise ValueError(f"{self.name}: no figure for attention kernel {kernel!r} (known: "
                             f"{', '.join(self.attention)})")
        return self.attention[kernel] * self.peak_flops * self.sustained_clock

    @property
    def sustained_mamf(self) -> float:
        """The matmul rate a training step sustains: the MAMF at the sustained clock."""
        return self.mamf_flops * self.sustained_clock


FA2_A100 = 0.50
FA2_H100 = 0.35
FA3_H100 = FA2_H100 * 1.5

A100_SUSTAINED_CLOCK = 1305 / 1410
"""The A100's clock sustained at its power limit under HPL (NVIDIA's HPL peak; glennklockwood.com)."""
A100_80GB = GpuKind("A100 SXM4 80GB", 108, 312e12, 271.2e12, 2039e9, {"fa2": FA2_A100},
                    fp32_flops=19.5e12, sustained_clock=A100_SUSTAINED_CLOCK,
                    source="NVIDIA A100 datasheet; MAMF table (ml-engineering)")
HOPPER_SUSTAINED_CLOCK = 1575 / 1980
"""DeepGEMM #120 (1,980 -> 1,575 MHz); chipsandcheese's H100 PCIe 1,395 of 1,755 MHz is the same 0.795."""
H100_80GB = GpuKind("H100 SXM5 80GB", 132, 989.4e12, 794.5e12, 3350e9, {"fa2": FA2_H100, "fa3": FA3_H100},
                    fp8_mamf_flops=1402.6e12, fp32_flops=66.9e12, sustained_clock=HOPPER_SUSTAINED_CLOCK,
                    source="NVIDIA H100 datasheet; MAMF table (ml-engineering)")
H200_141GB = replace(H100_80GB, name="H200 SXM 141GB", hbm_bytes_per_s=4800e9,
                     source="NVIDIA H200 datasheet; MAMF table ('H200 is the same' as the H100)")
H100_NVL_PEAK = 1671e12 / 2
"""H100 NVL dense BF16 (datasheet: 1,671 TFLOP/s with sparsity)."""
H100_96GB_GT = replace(
    H100_80GB, name="H100 96GB HBM2e, 500 W (Grand Teton)", hbm_bytes_per_s=2400e9,
    mamf_flops=H100_80GB.mamf_flops * (H100_80GB.peak_flops + H100_NVL_PEAK) / 2 / H100_80GB.peak_flops,
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96GB HBM2e at 2.4 TB/s, 500 W, 'peak between "
           "SXM and NVL': the MAMF scaled to the midpoint of the two datasheet peaks")

KINDS: Dict[str, GpuKind] = {"a100-80gb": A100_80GB, "h100-80gb": H100_80GB, "h200-141gb": H200_141GB,
                             "h100-96gb-gt": H100_96GB_GT}
"""Cluster preset name -> GPU kind."""


def gpu_kind(cluster_name: str) -> Optional[GpuKind]:
    """The GPU kind of a cluster preset (None: not a kind the planner has figures for)."""
    return KINDS.get(cluster_name)


@functools.lru_cache(maxsize=1 << 16)  # a plan asks for the same few shapes once per layout considered
def wave_efficiency(m: float, n: float, sms: int, count: float = 1.0) -> float:
    """Useful share of the tiles' work for ``count`` m x n outputs (tile and wave quantization,
    NVIDIA DU-09799-001 sections 3.1-3.2), with the least wasteful of ``GEMM_TILES``."""
    if m <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(count) * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, math.ceil(count) * m * n / (waves * sms * tm * tn))
    return best
