"""What the run costs: rank-hours (GPU-hours on GPUs), measured CPU-hours and
energy, and what ``trainer.steps`` and a token budget (``report.target_tokens``)
would cost at the measured rate.

Every ``trainer.log_every`` steps (and at the last) the trainer adds the
``usage.*`` metrics (one all-reduce over the world, on the steps that already
gather the memory peaks), so metrics.jsonl, the logger backends and
``hpctrain-report`` show them:

- ``usage.wall_s``: seconds since the trainer's set-up began (the set-up,
  data staging included, counts: the allocation is held through it);
- ``usage.rank_hours``: ranks x wall / 3600, the allocation's share this job
  held (``usage.gpu_hours``, the same number, on GPUs: one device per rank);
- ``usage.cpu_hours``: the ranks' process CPU time (every thread) summed,
  measured (``time.process_time``);
- ``usage.projected_*`` for ``trainer.steps`` and ``usage.target_*`` for
  ``report.target_tokens`` (``usage.target_steps`` steps of
  global_batch_size x seq_len tokens): the set-up as measured plus the
  measured cost per step of this run times the steps (``project``), as a run
  from step 0 in one launch;
- ``usage.energy_j`` (and by source ``usage.energy_rapl_j``,
  ``usage.energy_nvml_j``) where the machine exposes a counter: Intel RAPL
  under ``/sys/class/powercap`` (the packages' and their DRAM's, read by one
  rank per host: the counters are the host's, whatever ranks share it; a
  counter that wraps at ``max_energy_range_uj`` is followed by reading it
  every step) and NVML's total energy per GPU (``pynvml``, when installed; one
  reader per host and device). Where neither is readable (a VM or container
  without powercap, energy_uj readable by root only) the run has no energy
  figures, and says nothing.
"""
from __future__ import annotations

import glob
import importlib
import math
import os
import socket
import time
from typing import Any, Dict, List, Optional

import numpy as np

RAPL_ROOT = "/sys/class/powercap"


def wrap_delta(before: int, now: int, max_range: int) -> int:
    """Microjoules a counter advanced from ``before`` to ``now`` (once wrapped at ``max_range`` when it went down)."""
    return now - before if now >= before else now + max_range - before


class RaplCounter:
    """One RAPL zone's energy counter, accumulated across wrap-arounds (read at least once per wrap period)."""

    def __init__(self, zone: str):
        self.zone = zone
        self.max_range = int(_read(os.path.join(zone, "max_energy_range_uj")))
        self.last = self._now()
        self.total_uj = 0

    def _now(self) -> int:
        return int(_read(os.path.join(self.zone, "energy_uj")))

    def sample(self) -> float:
        """Joules since the counter was opened."""
        now = self._now()
        self.total_uj += wrap_delta(self.last, now, self.max_range)
        self.last = now
        return self.total_uj / 1e6


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def rapl_counters(root: str = RAPL_ROOT) -> List[RaplCounter]:
    """The host's package zones (``intel-rapl:N``, not ``psys``, which holds them) and their DRAM
    subzones, those this process can read; [] where there is none."""
    out = []
    for zone in sorted(glob.glob(os.path.join(root, "intel-rapl:*"))):
        parts = os.path.basename(zone).split(":")
        try:
            name = _read(os.path.join(zone, "name"))
            if (len(parts) == 2 and name != "psys") or (len(parts) == 3 and name == "dram"):
                out.append(RaplCounter(zone))
        except (OSError, ValueError):  # energy_uj is root-only since Linux 5.10 on many systems
            continue
    return out


class NvmlCounter:
    """A GPU's total energy (NVML, millijoules since the driver loaded; 64 bits, no wrap)."""

    def __init__(self, index: int):
        pynvml = importlib.import_module("pynvml")  # optional (nvidia-ml-py), never required: no stubs either
        pynvml.nvmlInit()
        self._nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.first = self._now()

    def _now(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def sample(self) -> float:
        return (self._now() - self.first) / 1e3


def nvml_counter(device: Any) -> Optional[NvmlCounter]:
    if getattr(device, "type", "cpu") != "cuda":
        return None
    try:
        return NvmlCounter(device.index or 0)
    except Exception:  # noqa: BLE001 - no pynvml, no driver, or a GPU without the counter: no energy figures
        return None


def project(setup: float, now: float, steps: int, target: int) -> float:
    """The cost of ``target`` steps from a measured ``now`` after ``steps`` steps, ``setup`` of it before step 1."""
    return setup + (now - setup) / max(steps, 1) * target


class Usage:
    """This rank's clocks and counters; ``measure`` is collective (every rank, the same steps)."""

    def __init__(self, cfg: Any, comm: Any, world_size: int, device: Any, t0: float, cpu0: float,
                 rapl_root: Optional[str] = None):
        self.cfg, self.comm, self.world_size, self.device = cfg, comm, world_size, device
        self.t0, self.cpu0 = t0, cpu0
        host = socket.gethostname()
        index = device.index if getattr(device, "type", "cpu") == "cuda" else None
        # the processes really running (a dry run plays one rank of a big world alone)
        self.collective = comm is not None and comm.Get_size() > 1
        keys = comm.allgather((host, index)) if self.collective else [(host, index)]
        rank = comm.Get_rank() if self.collective else 0
        first_on_host = [k[0] for k in keys].index(host) == rank
        self.rapl = rapl_counters(rapl_root or RAPL_ROOT) if first_on_host else []
        self.nvml = nvml_counter(device) if index is not None and keys.index((host, index)) == rank else None
        self.steps = 0
        self.start: Optional[np.ndarray] = None
        """(wall, cpu, rapl J, nvml J) when training began: the set-up's share."""

    def _local(self) -> np.ndarray:
        rapl = sum(c.sample() for c in self.rapl)
        nvml = self.nvml.sample() if self.nvml is not None else 0.0
        return np.array([time.perf_counter() - self.t0, time.process_time() - self.cpu0, rapl, nvml])

    def tick(self) -> None:
        """A step ended: count it and read the counters (a RAPL counter must be read once per wrap period)."""
        if self.start is None:
            self.training_started()
        self.steps += 1
        if self.rapl:
            self._local()

    def training_started(self) -> None:
        self.start = self._local()

    def measure(self) -> Dict[str, float]:
        """The ``usage.*`` metrics now (collective: one all-reduce over the world)."""
        if self.start is None:
            self.training_started()
        assert self.start is not None
        now = self._local()
        readers = [float(bool(self.rapl)), float(self.nvml is not None)]
        local = np.concatenate([now[1:], self.start[1:], readers])  # cpu, rapl, nvml; their set-up shares; readers
        total = local.copy()
        if self.collective:
            from mpi4py import MPI  # after bootstrap: MPI is running by now

            self.comm.Allreduce(local, total, op=MPI.SUM)
        cpu, rapl, nvml, cpu_setup, rapl_setup, nvml_setup, rapl_readers, nvml_readers = total.tolist()
        wall, wall_setup = float(now[0]), float(self.start[0])
        t, ranks = self.cfg.trainer, self.world_size
        target_tokens = int(self.cfg.report.target_tokens)
        target = math.ceil(target_tokens / (t.global_batch_size * t.seq_len)) if target_tokens else 0
        out: Dict[str, float] = {"usage.wall_s": wall, "usage.rank_hours": ranks * wall / 3600,
                                 "usage.cpu_hours": cpu / 3600}
        if getattr(self.device, "type", "cpu") == "cuda":
            out["usage.gpu_hours"] = out["usage.rank_hours"]
        energy = []
        if rapl_readers:
            out["usage.energy_rapl_j"] = rapl
            energy.append((rapl, rapl_setup))
        if nvml_readers:
            out["usage.energy_nvml_j"] = nvml
            energy.append((nvml, nvml_setup))
        if energy:
            out["usage.energy_j"] = sum(e for e, _ in energy)
        for prefix, steps in (("projected", int(t.steps)), ("target", target)):
            if not steps:
                continue
            if prefix == "target":
                out["usage.target_steps"] = steps
            out[f"usage.{prefix}_rank_hours"] = ranks * project(wall_setup, wall, self.steps, steps) / 3600
            out[f"usage.{prefix}_cpu_hours"] = project(cpu_setup, cpu, self.steps, steps) / 3600
            if energy:
                out[f"usage.{prefix}_energy_j"] = sum(project(s, e, self.steps, steps) for e, s in energy)
        return out



def usage_line(m: Dict[str, float], cfg: Any) -> str:
    """The run's usage in one line (rank 0, at the end)."""
    gpu = "GPU" if "usage.gpu_hours" in m else "rank"
    parts = [f"usage: {m['usage.rank_hours']:.4g} {gpu}-hours ({m['usage.wall_s']:.1f} s wall), "
             f"{m['usage.cpu_hours']:.4g} CPU-hours"]
    if "usage.energy_j" in m:
        parts.append(f"{m['usage.energy_j'] / 3.6e6:.4g} kWh")
    if "usage.projected_rank_hours" in m:
        parts.append(f"projected for trainer.steps={cfg.trainer.steps}: {m['usage.projected_rank_hours']:.4g} "
                     f"{gpu}-hours" + (f", {m['usage.projected_energy_j'] / 3.6e6:.4g} kWh"
                                       if "usage.projected_energy_j" in m else ""))
    if "usage.target_rank_hours" in m:
        parts.append(f"for report.target_tokens={cfg.report.target_tokens} ({int(m['usage.target_steps'])} steps): "
                     f"{m['usage.target_rank_hours']:.4g} {gpu}-hours" + (
                         f", {m['usage.target_energy_j'] / 3.6e6:.4g} kWh" if "usage.target_energy_j" in m else ""))
    return "; ".join(parts)
