"""Candidate layouts: every combination of the parallel axes and training knobs that can run.

A layout is the mesh sizes (tp, cp, ep, dp, pp) plus the pipeline schedule
and virtual stages (vpp), the ZeRO stage, the recompute mode and the
micro-batch size. The mesh and batch part is checked by
``hpctrain.config.validate.check_layout``, the same function training calls,
so a proposed layout passes the same checks with the same messages. On top
of it the planner applies the rules the parallel plugins need:

- tp is a power of two that fits in one node (TP all-reduces run per layer,
  so they stay on NVLink) and divides the attention heads and the FFN width;
  kv heads are split or replicated, so tp and n_kv_heads must divide one
  another;
- cp is a power of two and the sequence splits into 2*cp chunks (the
  load-balanced causal split of ring attention) of at least
  ``MIN_CP_CHUNK`` tokens: shorter chunks cannot hide the ring's traffic
  behind attention compute, and they multiply the candidates for nothing;
- ep divides the number of experts (1 for a dense model);
- pp is any stage count with a block per stage, the blocks split by
  ``hpctrain.pipeline.split.auto_counts`` (the ``parallel.pipeline.layers=auto``
  of the pipeline plugin: as even as the end stages' embedding and head allow,
  e.g. 126 blocks on 16 stages [7, 8 x 14, 7]) and, where that differs, by
  the plain even split (the estimate keeps the faster; the printed command
  names the split); interleaving takes any vpp with a block per virtual
  stage (pp x vpp <= layers), chunks uneven where the blocks do not divide;
- every ZeRO stage goes with every pipeline; under a pipeline ZeRO-2/3 keep
  a stage's whole gradient through the step (the estimate counts it);
- sequence parallelism is on whenever tp > 1 (it only removes replicated
  activations; Megatron-LM's practice).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from hpctrain.config.validate import check_layout
from hpctrain.pipeline.bubble import NO_PIPELINE, SCHEDULES, check_schedule
from hpctrain.pipeline.schedules import check_busy
from hpctrain.pipeline.split import auto_counts, end_cost, layer_counts, rank_layers
from hpctrain.planner.activations import RECOMPUTE
from hpctrain.planner.arch import Arch
from hpctrain.planner.memory import ZERO_STAGES

MAX_VPP = 8
MAX_MICRO_BATCH = 64
MIN_CP_CHUNK = 512


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    micro_batch: int
    zero: int = 0
    recompute: str = "none"
    schedule: str = NO_PIPELINE
    vpp: int = 1
    layers: Tuple[int, ...] = ()
    """Blocks per virtual stage (pp x vpp of them), ``parallel.pipeline.layers``; empty: ``auto``
    (``planned_layers``)."""

    @property
    def sp(self) -> bool:
        """Sequence parallelism (on with tensor parallelism)."""
        return self.tp > 1

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    def sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp}

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step: samples are split over dp x ep (``hpctrain.mesh.SAMPLE_AXES``), each rank
        taking ``micro_batch`` samples at a time."""
        return global_batch // (self.dp * self.ep * self.micro_batch)

    def label(self) -> str:
        """Short form for tables: only what differs from the default."""
        parts = [f"{a}{n}" for a, n in self.sizes().items() if n > 1 or a == "dp"]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.vpp})" if self.vpp > 1 else ""))
            if self.layers:
                parts.append(split_text(self.layers))
        return " ".join(parts)


def split_text(layers: Tuple[int, ...]) -> str:
    """Blocks per stage, runs shortened: (7, 8, 8, 8, 7) -> '[7,8x3,7]'."""
    runs: List[List[int]] = []
    for n in layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "[" + ",".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs) + "]"


def _powers_of_two(limit: int) -> List[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _divisors(n: int, limit: Optional[int] = None) -> List[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def mesh_problems(arch: Arch, tp: int, cp: int, ep: int, pp: int, seq_len: int, gpus_per_node: int) -> str:
    """The planner's structural rule a mesh breaks ('' if none); see the module doc."""
    if tp & (tp - 1) or gpus_per_node % tp:
        return f"tp={tp} must be a power of two within one {gpus_per_node}-GPU node"
    if arch.n_heads % tp or (arch.n_kv_heads % tp and tp % arch.n_kv_heads) or arch.ffn_hidden % tp:
        return (f"tp={tp} must divide the {arch.n_heads} attention heads and the FFN width {arch.ffn_hidden}, "
                f"and divide or be a multiple of the {arch.n_kv_heads} kv heads")
    if cp & (cp - 1) or (cp > 1 and (seq_len % (2 * cp) or seq_len // (2 * cp) < MIN_CP_CHUNK)):
        return f"cp={cp} must be a power of two splitting seq_len into 2*cp chunks of >= {MIN_CP_CHUNK} tokens"
    if arch.num_experts % ep:
        return f"ep={ep} must divide the {arch.num_experts} experts"
    if pp > arch.n_layers:
        return f"pp={pp} leaves pipeline stages without a block: use pp <= the {arch.n_layers} layers"
    return ""


def enumerate_layouts(arch: Arch, model_cfg: Any, global_batch: int, seq_len: int, gpus: int, gpus_per_node: int,
                      pins: Optional[Mapping[str, Any]] = None, schedules: Optional[Sequence[str]] = None,
                      recomputes: Optional[Sequence[str]] = None, zeros: Optional[Sequence[int]] = None,
                      even_chunks: bool = False) -> Tuple[List[Layout], Dict[str, int]]:
    """All runnable layouts on ``gpus`` GPUs, and the count of rejections per reason.

    GPipe is only considered when pinned: 1F1B has its bubble with less memory.

    ``pins`` fixes values: mesh axes (``tp`` ... ``dp``), ``micro_batch``,
    ``zero``, ``recompute``, ``schedule``, ``vpp``, ``layers`` (blocks per
    virtual stage; pipelines of another stage count are rejected).
    ``schedules`` / ``recomputes`` / ``zeros``: the pipeline schedules, recompute modes and ZeRO
    stages the training code has (``frameworks.Framework``; all of hpctrain's by default); a pin
    outside them is refused with that reason. ``even_chunks``: interleaving only where the blocks
    divide into pp x vpp equal chunks (Megatron's rule).
    """
    pins = dict(pins or {})
    rejected: Dict[str, int] = {}

    def reject(reason: str) -> None:
        rejected[reason] = rejected.get(reason, 0) + 1

    def choices(key: str, options: List[Any]) -> List[Any]:
        return [pins[key]] if key in pins else options

    allowed: Dict[str, Tuple[Any, ...]] = {"schedule": tuple(schedules or SCHEDULES),
                                           "recompute": tuple(recomputes or RECOMPUTE),
                                           "zero": tuple(zeros if zeros is not None else ZERO_STAGES),
                                           "even_chunks": (even_chunks,)}
    for key in ("schedule", "recompute", "zero"):
        values = allowed[key]
        if key in pins and pins[key] not in values and not (key == "schedule" and pins[key] == "gpipe"):
            reject(f"{key} {pins[key]} is not available in this training code (it has "
                   f"{', '.join(map(str, values))})")
            return [], rejected

    out: List[Layout] = []
    for tp in choices("tp", _powers_of_two(min(gpus_per_node, gpus))):
        for cp in choices("cp", _powers_of_two(gpus)):
            for ep in choices("ep", _divisors(arch.num_experts)):
                for pp in choices("pp", list(range(1, min(arch.n_layers, gpus) + 1))):
                    rest = tp * cp * ep * pp
                    mesh_pinned = all(a in pins for a in ("tp", "cp", "ep", "pp"))
                    if gpus % rest:
                        if mesh_pinned:  # only then is it the user's mesh, worth naming
                            reject(f"tp({tp}) * cp({cp}) * ep({ep}) * pp({pp}) = {rest} does not divide the "
                                   f"{gpus} GPUs")
                        continue  # not a factorisation of the world
                    dp = gpus // rest
                    if "dp" in pins and pins["dp"] not in (-1, dp):
                        if mesh_pinned:
                            reject(f"tp({tp}) * cp({cp}) * ep({ep}) * dp({pins['dp']}) * pp({pp}) = "
                                   f"{rest * pins['dp']} != {gpus} GPUs")
                        continue
                    problem = mesh_problems(arch, tp, cp, ep, pp, seq_len, gpus_per_node)
                    if problem:
                        reject(problem)
                        continue
                    for layout in _knobs(arch, model_cfg, global_batch, seq_len, gpus, tp, cp, ep, dp, pp,
                                         choices, reject, pins, allowed):
                        out.append(layout)
    return out, rejected


def vpp_choices(n_layers: int, pp: int) -> List[int]:
    """Virtual stages per pipeline rank the search tries: the powers of two up to ``MAX_VPP`` and every
    divisor of the blocks per stage (96 blocks on 8 stages: 2, 3, 4, 6, 8, 12), each leaving every
    virtual stage a block."""
    options = set(_powers_of_two(MAX_VPP)[1:])
    if n_layers % pp == 0:
        options |= {v for v in _divisors(n_layers // pp) if v > 1}
    return sorted(v for v in options if pp * v <= n_layers)


def _knobs(arch: Arch, model_cfg: Any, global_batch: int, seq_len: int, gpus: int, tp: int, cp: int, ep: int,
           dp: int, pp: int, choices: Callable[[str, List[Any]], List[Any]],
           reject: Callable[[str], None], pins: Mapping[str, Any],
           allowed: Mapping[str, Tuple[Any, ...]]) -> Iterator[Layout]:
    """Micro-batch, schedule, ZeRO and recompute choices for one mesh."""
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
    per_replica = max(1, global_batch // dp)
    for mb in choices("micro_batch", _divisors(per_replica, min(per_replica, MAX_MICRO_BATCH))):
        trainer = SimpleNamespace(global_batch_size=global_batch, micro_batch_size=mb, seq_len=seq_len)
        problems = check_layout(sizes, trainer, model_cfg, gpus)
        if problems:
            for p in problems:
                reject(p)
            continue
        m = global_batch // (dp * ep * mb)  # the pipeline plugin counts micro-batches over dp x ep (the sample axes)
        wanted = choices("schedule", [s for s in allowed["schedule"] if s != "gpipe"])
        even = allowed["even_chunks"][0]
        vpps = [v for v in choices("vpp", vpp_choices(arch.n_layers, pp))
                if not even or arch.n_layers % (pp * v) == 0 or "vpp" in pins]
        if pp > 1 and even and not vpps and "interleaved" in wanted:
            reject(f"interleaving {arch.n_layers} blocks on pp={pp} needs pp x vpp equal chunks (this code's rule) "
                   "and no vpp gives them")
        schedules = [(NO_PIPELINE, 1)] if pp == 1 else (
            [(s, 1) for s in wanted if s != "interleaved"]
            + [("interleaved", v) for v in vpps if v > 1 and "interleaved" in wanted])
        if pp > 1 and "interleaved" in wanted and "vpp" in pins:
            v = pins["vpp"]
            if v > 1 and pp * v > arch.n_layers:
                reject(f"vpp={v} on pp={pp} needs {pp * v} virtual stages; the model has {arch.n_layers} blocks")
        for schedule, vpp in schedules:
            if vpp not in choices("vpp", [vpp]) or pp * vpp > arch.n_layers:
                if "vpp" in pins and schedule != "interleaved":
                    reject(f"vpp={pins['vpp']} needs the interleaved schedule (got {schedule})")
                continue
            why = check_schedule(schedule, pp, vpp, m) or check_busy(pp, m)
            if why:
                reject(why)
                continue
            splits: List[Tuple[int, ...]] = [()]
            pinned = pins.get("layers", ())
            if pp > 1 or pinned:
                splits, why = _splits(arch, pp * vpp, tuple(pinned), even)
                if why or pp == 1:
                    reject(why or f"parallel.pipeline.layers={list(pinned)} asks for a pipeline: parallel.pp > 1")
                    continue
            for layers in splits:
                for zero in choices("zero", list(allowed["zero"])):
                    for recompute in choices("recompute", list(allowed["recompute"])):
                        yield Layout(tp, cp, ep, dp, pp, mb, zero, recompute, schedule, vpp, layers)


@lru_cache(maxsize=1024)
def _splits(arch: Arch, stages: int, pinned: Tuple[int, ...], even_only: bool = False
            ) -> Tuple[List[Tuple[int, ...]], str]:
    """(the splits to estimate, ''): the pinned one when it fits ``stages``, else ``auto``'s and,
    where it differs, the plain even split (the remainder on the middle stages): a block also costs
    its tensor-parallel collectives, which the end stages' parameter count does not see, so the
    estimate decides; ([], why) when the pinned one does not fit (the pipeline plugin's message).
    ``even_only``: a code that splits the blocks into equal stages only (Megatron's rule)."""
    if even_only and not pinned:
        if arch.n_layers % stages:
            return [], (f"{arch.n_layers} blocks do not divide into {stages} equal pipeline stages "
                        "(this code's rule)")
        return [(arch.n_layers // stages,) * stages], ""
    if not pinned:
        auto = tuple(auto_counts(arch.n_layers, stages, arch_end_cost(arch)))
        even = tuple(auto_counts(arch.n_layers, stages))
        return [auto] if even == auto else [auto, even], ""
    try:
        return [tuple(layer_counts(list(pinned), arch.n_layers, stages))], ""
    except ValueError as e:
        return [], str(e)


def planned_layers(arch: Arch, lay: Layout) -> Tuple[int, ...]:
    """Blocks per virtual stage: ``lay.layers``, or the ``auto`` split the pipeline plugin makes."""
    if lay.layers:
        return lay.layers
    return tuple(auto_counts(arch.n_layers, lay.pp * lay.vpp, arch_end_cost(arch)))


def per_rank_layers(arch: Arch, lay: Layout) -> List[int]:
    """Blocks on each pipeline rank (its virtual stages summed)."""
    return rank_layers(planned_layers(arch, lay), lay.pp)


def arch_end_cost(arch: Arch) -> float:
    """``split.end_cost`` of the model: the plugin computes it from the same dense-block count
    (``ModelShape.block_params``, which ``Arch.dense_layer_params`` is for our models)."""
    return end_cost(arch.vocab_size, arch.d_model, arch.dense_layer_params)
