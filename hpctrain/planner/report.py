"""Turning a plan into text, JSON and the ``hpctrain-train`` overrides of the best layout.

Builds strings and dicts only; ``cli`` prints them.

Overrides: the mesh sizes and micro-batch size use core keys, the recompute
mode ``model.recompute``; the ZeRO stage, pipeline schedule and the blocks
per pipeline stage belong to their plugins (``PLUGIN_KEYS``). An override of
a knob is emitted only when it differs from the default, except the blocks
per stage, always given with a pipeline (the split the estimate assumed,
which ``parallel.pipeline.layers=auto`` also makes), and ``unknown_keys``
lists those the installed config schema does not have (a plugin not
installed), so the user sees exactly what ``hpctrain-train`` would refuse.
The printed command line is shell-quoted (a list's brackets are glob
characters).
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Sequence

from omegaconf import OmegaConf

from hpctrain.planner.arch import Arch
from hpctrain.planner.band import band_text, load_band
from hpctrain.planner.cluster import ClusterSpec
from hpctrain.planner.estimate import Estimate, Workload
from hpctrain.planner.layouts import Layout
from hpctrain.planner.search import Plan

PLUGIN_KEYS = {
    "zero": "parallel.zero.stage",
    "recompute": "model.recompute",
    "schedule": "parallel.pipeline.schedule",
    "vpp": "parallel.pipeline.vpp",
    "layers": "parallel.pipeline.layers",
}
PLANNED_CORE_KEYS = ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.dp",
                     "trainer.micro_batch_size", "trainer.precision")

GB = 1e9


def layout_overrides(lay: Layout, precision: str) -> List[str]:
    """The ``key=value`` overrides that select ``lay`` in hpctrain-train."""
    out = [f"parallel.{a}={n}" for a, n in lay.sizes().items()]
    out += [f"trainer.micro_batch_size={lay.micro_batch}", f"trainer.precision={precision}"]
    if lay.zero:
        out.append(f"{PLUGIN_KEYS['zero']}={lay.zero}")
    if lay.recompute != "none":
        out.append(f"{PLUGIN_KEYS['recompute']}={lay.recompute}")
    if lay.pp > 1:
        out.append(f"{PLUGIN_KEYS['schedule']}={lay.schedule}")
    if lay.vpp > 1:
        out.append(f"{PLUGIN_KEYS['vpp']}={lay.vpp}")
    if lay.pp > 1 and lay.layers:
        out.append(f"{PLUGIN_KEYS['layers']}=[{','.join(map(str, lay.layers))}]")
    return out


def train_overrides(user_overrides: Sequence[str], lay: Layout, precision: str) -> List[str]:
    """The user's overrides (model, batch, sequence, cluster...) minus what the
    planner decides, then the planned ones."""
    planned = set(PLANNED_CORE_KEYS) | set(PLUGIN_KEYS.values())
    kept = [o for o in user_overrides if o.split("=", 1)[0].lstrip("+~") not in planned]
    return kept + layout_overrides(lay, precision)


def unknown_keys(overrides: Sequence[str], cfg: Any) -> List[str]:
    """Override keys that the composed config (schema with installed plugins) lacks."""
    missing = object()
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" in o and "." in key and OmegaConf.select(cfg, key, default=missing) is missing:
            out.append(key)
    return out


def launch_line(cluster: ClusterSpec, overrides: Sequence[str]) -> str:
    """An srun line for the whole allocation (pmix is what works with Open MPI)."""
    return (f"srun --nodes={cluster.nodes} --ntasks-per-node={cluster.gpus_per_node} --mpi=pmix "
            f"hpctrain-train {' '.join(shlex.quote(o) for o in overrides)}")


def _row(rank: int, e: Estimate) -> List[str]:
    m, lay = e.memory, e.layout
    return [str(rank), lay.label(), str(lay.zero), lay.recompute, str(lay.micro_batch), str(e.microbatches),
            f"{m.weights / GB:.1f}", f"{m.grads / GB:.1f}", f"{m.optimizer / GB:.1f}", f"{m.activations / GB:.1f}",
            f"{m.buffers / GB:.1f}", f"{m.total / GB:.1f}", f"{e.time.total:.3f}", f"{100 * e.bubble_fraction:.1f}",
            f"{100 * e.mfu:.1f}"]


HEADER = ["#", "layout", "zero", "recompute", "mb", "m", "weights", "grads", "optim", "activ", "other",
          "total GB", "step s", "bubble%", "MFU%"]


def table(estimates: Sequence[Estimate]) -> str:
    rows = [HEADER] + [_row(i + 1, e) for i, e in enumerate(estimates)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(HEADER))]
    lines = ["  ".join(cell.rjust(w) if c not in (1, 3) else cell.ljust(w)
                       for c, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _matmul_source(cluster: ClusterSpec) -> str:
    source = cluster.sources.get("matmul_tflops")
    if source == "calibration":
        return "calibration"
    if cluster.gpu is not None:
        return (f"{cluster.gpu.name}: measured maximum achievable matmul; HBM "
                f"{cluster.gpu.hbm_bytes_per_s / 1e12:g} TB/s, kernel-level compute model")
    return f"assumed {cluster.matmul_flops / cluster.peak_flops:.2f} x peak: pass a measured one with --calibration"


def summary(arch: Arch, work: Workload, cluster: ClusterSpec) -> str:
    return (f"model {arch.name} ({arch.family}): {arch.total_params / 1e9:.3f}B parameters, {arch.n_layers} layers, "
            f"h={arch.d_model}, heads {arch.n_heads}/{arch.n_kv_heads} kv"
            + (f", {arch.num_experts} experts top-{arch.top_k}" if arch.is_moe else "") + "\n"
            f"cluster {cluster.name}: {cluster.gpus} GPUs ({cluster.nodes} x {cluster.gpus_per_node}), "
            f"{cluster.capacity_bytes / 2 ** 30:g} GiB = {cluster.capacity_bytes / GB:.1f} GB "
            f"({cluster.mem_bytes / GB:.1f} usable), peak "
            f"{cluster.peak_flops / 1e12:g} TFLOP/s, matmul {cluster.matmul_flops / 1e12:g} TFLOP/s "
            f"({_matmul_source(cluster)}), busbw {cluster.intra.busbw / GB:g} / "
            f"{cluster.inter.busbw / GB:g} GB/s intra/inter ({cluster.sources.get('intra_busbw')})\n"
            f"workload: global batch {work.global_batch} x {work.seq_len} tokens, {work.precision}, "
            f"state bytes/param {work.state_bytes.per_param:g} ({work.state_bytes.name}); code: "
            f"{work.framework.label}")


def best_text(best: Estimate, overrides: Sequence[str], not_in_schema: Sequence[str], train_problems: Sequence[str],
              cluster: ClusterSpec) -> str:
    t = best.time
    exposed = ", ".join(f"{a} {v * 1e3:.1f} ms" for a, v in t.exposed.items() if v > 0) or "none"
    lines = [f"best: {best.layout.label()}, ZeRO {best.layout.zero}, recompute {best.layout.recompute}, "
             f"micro-batch {best.layout.micro_batch} x {best.microbatches}",
             f"  step {t.total:.3f} s = compute {t.compute:.3f} + bubble {t.bubble:.3f} + exposed comm ({exposed}) "
             f"+ optimizer {t.optimizer:.3f} + overlap contention {t.contention:.3f}; "
             f"{best.tokens_per_s:,.0f} tokens/s",
             f"  {band_text(best.mfu, load_band())}",
             f"  memory {best.memory.total / GB:.1f} GB of {cluster.mem_bytes / GB:.1f} usable "
             f"(stage {best.memory.stage})",
             "  on the wire per GPU per step: " + (", ".join(
                 f"{a} {v / GB:.2f} GB in {best.comm_time.get(a, 0.0):.3f} s" for a, v in best.comm_bytes.items()
                 if v > 0) or "nothing") + " (seconds: the collectives alone, before overlap)",
             "run it with:", "  " + launch_line(cluster, overrides)]
    if not_in_schema:
        lines.append("note: not in this installation's config schema (their plugins are not installed): "
                     + ", ".join(not_in_schema))
    if train_problems:
        lines.append("note: hpctrain-train with the installed plugins would refuse it today:")
        lines += [f"  - {p}" for p in train_problems]
    return "\n".join(lines)


def as_json(plan: Plan, arch: Arch, work: Workload, cluster: ClusterSpec, top: int, overrides: Sequence[str],
            not_in_schema: Sequence[str], train_problems: Sequence[str]) -> Dict[str, Any]:
    return {
        "model": {"name": arch.name, "family": arch.family, "params": arch.total_params, "layers": arch.n_layers,
                  "d_model": arch.d_model, "heads": arch.n_heads, "kv_heads": arch.n_kv_heads,
                  "experts": arch.num_experts, "top_k": arch.top_k},
        "cluster": {"name": cluster.name, "gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                    "capacity_bytes": cluster.capacity_bytes, "usable_bytes": cluster.mem_bytes,
                    "peak_flops": cluster.peak_flops, "matmul_flops": cluster.matmul_flops,
                    "intra_busbw": cluster.intra.busbw, "inter_busbw": cluster.inter.busbw,
                    "sources": cluster.sources},
        "workload": {"global_batch": work.global_batch, "seq_len": work.seq_len, "precision": work.precision,
                     "state_bytes": work.state_bytes.name},
        "considered": plan.considered,
        "fitting": len(plan.ranked),
        "layouts": [e.to_dict() for e in plan.ranked[:top]],
        "best": {"estimate": plan.best.to_dict(), "mfu_band": load_band(), "overrides": list(overrides),
                 "command": launch_line(cluster, overrides), "not_in_schema": list(not_in_schema),
                 "train_problems": list(train_problems)},
    }
