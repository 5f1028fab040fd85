"""Search: estimate every candidate layout, rank those that fit, explain when none does.

Ranking is by predicted step time (ties: less memory). When nothing fits,
the error names the smallest change that would: the memory factor the
leanest layout needs, the GPU count at which a layout fits (doubling up to
64x), and for each value the user pinned (``parallel.pp=1`` ...) the value
that would fit if it were left to the planner.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, cast

from omegaconf import DictConfig, OmegaConf

from hpctrain.errors import ConfigError
from hpctrain.log import get_logger
from hpctrain.planner.activations import RECOMPUTE
from hpctrain.planner.arch import Arch
from hpctrain.planner.cluster import ClusterSpec
from hpctrain.planner.estimate import Estimate, Workload, estimate
from hpctrain.planner.layouts import enumerate_layouts

log = get_logger(__name__)

MAX_GPU_GROWTH = 64
PIN_KEYS = {"tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
            "dp": "parallel.dp", "micro_batch": "trainer.micro_batch_size", "zero": "--pin zero",
            "recompute": "--pin recompute", "schedule": "--pin schedule", "vpp": "--pin vpp",
            "layers": "parallel.pipeline.layers"}


@dataclass
class Plan:
    """The outcome of a search."""

    ranked: List[Estimate]
    """Layouts that fit, fastest first."""
    considered: int
    rejected: Dict[str, int] = field(default_factory=dict)
    """Why candidate meshes were skipped (message -> count)."""

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def model_config_for(arch: Arch, max_seq_len: int) -> Any:
    """A ModelConfig-shaped object for ``check_layout`` when the model is not
    one of ours (the GPT family of the published tables)."""
    return SimpleNamespace(vocab_size=arch.vocab_size, d_model=arch.d_model, n_layers=arch.n_layers,
                           n_heads=arch.n_heads, n_kv_heads=arch.n_kv_heads, ffn_hidden=arch.ffn_hidden,
                           ffn_multiple_of=1, tie_embeddings=arch.tie_embeddings, max_seq_len=max_seq_len)


def _plain(model_cfg: Any) -> Any:
    """A plain copy of a DictConfig model section: check_layout reads it for
    every candidate, and OmegaConf attribute access is slow."""
    if isinstance(model_cfg, DictConfig):
        # (cast: OmegaConf types to_container for any node; a DictConfig gives a dict)
        return SimpleNamespace(**cast(Dict[str, Any], OmegaConf.to_container(model_cfg, resolve=True)))
    return model_cfg


def _estimates(arch: Arch, model_cfg: Any, work: Workload, cluster: ClusterSpec,
               pins: Mapping[str, Any]) -> "tuple[List[Estimate], Dict[str, int]]":
    fw = work.framework
    layouts, rejected = enumerate_layouts(arch, _plain(model_cfg), work.global_batch, work.seq_len, cluster.gpus,
                                          cluster.gpus_per_node, pins, fw.schedules, fw.recompute, fw.zero,
                                          fw.even_chunks)
    return [estimate(arch, lay, work, cluster) for lay in layouts], rejected


def search(arch: Arch, model_cfg: Optional[Any], work: Workload, cluster: ClusterSpec,
           pins: Optional[Mapping[str, Any]] = None) -> Plan:
    """Rank every runnable layout; ConfigError (with the smallest fix) when none fits.

    ``model_cfg`` is the ModelConfig the training validator checks; None
    (for a model that is not ours, e.g. the GPT family) derives one from ``arch``.
    """
    pins = dict(pins or {})
    if model_cfg is None:
        model_cfg = model_config_for(arch, work.seq_len)
    found, rejected = _estimates(arch, model_cfg, work, cluster, pins)
    log.debug("planner: %d layouts estimated, %d mesh/batch rejections", len(found), sum(rejected.values()))
    if not found:
        raise ConfigError(_no_valid_layout(arch, model_cfg, work, cluster, rejected, pins))
    fitting = sorted((e for e in found if e.fits), key=_rank_key)
    if not fitting:
        raise ConfigError(_nothing_fits(arch, model_cfg, work, cluster, pins, found))
    return Plan(fitting, len(found), rejected)


def _rank_key(e: Estimate) -> tuple:
    """Fastest first; on a tie (to 0.1%), the simpler layout: fewer parallel
    axes besides dp, lower ZeRO stage, less recompute, then less memory."""
    lay = e.layout
    axes = sum(1 for a, n in lay.sizes().items() if n > 1 and a != "dp")
    return (round(e.time.total, 3 - int(f"{e.time.total:e}".split("e")[1])), axes, lay.zero,
            RECOMPUTE.index(lay.recompute), e.memory.total)


def _value_text(value: Any) -> str:
    """A pinned value as the user types it (blocks per stage: [7,8,8,7])."""
    return f"[{','.join(map(str, value))}]" if isinstance(value, tuple) else str(value)


def _pin_text(pins: Mapping[str, Any]) -> str:
    return ", ".join(f"{PIN_KEYS.get(k, k)}={_value_text(v)}" for k, v in pins.items())


def _unpinned_options(arch: Arch, model_cfg: Any, work: Workload, cluster: ClusterSpec, pins: Mapping[str, Any],
                      need_fit: bool) -> List[str]:
    """For each pinned value: the values that would work if it were free."""
    out = []
    for key, value in pins.items():
        free = {k: v for k, v in pins.items() if k != key}
        found = _estimates(arch, model_cfg, work, cluster, free)[0]
        values = sorted({getattr(e.layout, key) for e in found if e.fits or not need_fit} - {()})
        if values:
            out.append(f"{PIN_KEYS.get(key, key)} in {{{', '.join(map(_value_text, values))}}} instead of the "
                       f"pinned {_value_text(value)}")
    return out


def _no_valid_layout(arch: Arch, model_cfg: Any, work: Workload, cluster: ClusterSpec, rejected: Dict[str, int],
                     pins: Mapping[str, Any]) -> str:
    reasons = sorted(rejected.items(), key=lambda kv: -kv[1])[:4]
    lines = [f"no layout of {cluster.gpus} GPUs ({cluster.gpus_per_node} per node) passes the layout checks"
             + (f" with {_pin_text(pins)}" if pins else "") + "; the checks said, most often first:"]
    lines += [f"  - {msg} ({n} candidate{'s' if n > 1 else ''})" for msg, n in reasons]
    if not reasons:
        lines.append(f"  - no tp*cp*ep*pp with the pins divides the {cluster.gpus} GPUs")
    relaxed = _unpinned_options(arch, model_cfg, work, cluster, pins, need_fit=False)
    bigger = _smallest_valid_batch(arch, model_cfg, work, cluster, pins)
    if bigger:
        relaxed.insert(0, f"trainer.global_batch_size={bigger} (the smallest power-of-two multiple of "
                          f"{work.global_batch} that some layout of {cluster.gpus} GPUs can split)")
    if relaxed:
        lines.append("valid with: " + "; or ".join(relaxed))
    return "\n".join(lines)


MAX_BATCH_GROWTH = 1024
"""How far ``_smallest_valid_batch`` looks: a global batch up to this many times the one given."""


def _smallest_valid_batch(arch: Arch, model_cfg: Any, work: Workload, cluster: ClusterSpec,
                          pins: Mapping[str, Any]) -> Optional[int]:
    """The smallest global batch, the given one times a power of two, that some layout passes; None when
    the batch is not what stops every layout (a small batch on many GPUs is the usual cause: the layout
    checks then name a different rule for each candidate)."""
    k = 2
    while k <= MAX_BATCH_GROWTH:
        grown = dataclasses.replace(work, global_batch=work.global_batch * k)
        if _estimates(arch, model_cfg, grown, cluster, pins)[0]:
            return grown.global_batch
        k *= 2
    return None


def _nothing_fits(arch: Arch, model_cfg: Any, work: Workload, cluster: ClusterSpec, pins: Mapping[str, Any],
                  found: List[Estimate]) -> str:
    lean = min(found, key=lambda e: e.memory.total)
    need = lean.memory.total
    factor = need / cluster.mem_bytes
    per_gb = cluster.capacity_bytes / cluster.mem_bytes  # capacity for a given usable amount
    lay = lean.layout
    # rounded up, so that following the advice is enough (cluster.gpu_mem_gb is in GiB)
    options = [f"needs >= {math.ceil(factor * 100) / 100:.2f}x more GPU memory "
               f"(cluster.gpu_mem_gb >= {math.ceil(need * per_gb / 2 ** 30)})"]
    for k in (2 ** i for i in range(1, MAX_GPU_GROWTH.bit_length())):
        bigger = dataclasses.replace(cluster, gpus=cluster.gpus * k)
        if any(e.fits for e in _estimates(arch, model_cfg, work, bigger, pins)[0]):
            options.append(f"or cluster.gpus >= {bigger.gpus}")
            break
    options += ["or " + o for o in _unpinned_options(arch, model_cfg, work, cluster, pins, need_fit=True)]
    return (f"no layout fits in {cluster.mem_bytes / 1e9:.1f} GB usable per GPU "
            f"({cluster.capacity_bytes / 2 ** 30:g} GiB x usable fraction) out of {len(found)} candidates"
            + (f" with {_pin_text(pins)}" if pins else "") + ". "
            f"The leanest ({lay.label()}, ZeRO {lay.zero}, recompute {lay.recompute}, micro-batch {lay.micro_batch}) "
            f"needs {need / 1e9:.1f} GB. Smallest change: " + "; ".join(options))
