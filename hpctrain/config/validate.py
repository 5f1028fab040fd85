"""Validation: every problem with a config, as one-line messages naming the fix.

Runs on every rank before any collective (it depends only on the config, the
world size and the local filesystem), so all ranks reach the same verdict and
exit together. Plugins add their checks through ``hpctrain_validate``.

``check_layout`` holds the plugin-independent layout, batch and model-shape
checks; the planner (``hpctrain.planner``) calls it for every candidate so a
layout it proposes passes the same checks as training.
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Tuple

from omegaconf import OmegaConf

from hpctrain import plugins
from hpctrain.bootstrap import get_runtime, job_nodes
from hpctrain.config.ranges import range_problems
from hpctrain.data.sequence import valid_seq_lens
from hpctrain.data.sources import check_data_config, data_vocab_size
from hpctrain.errors import ConfigError, PluginError
from hpctrain.finetune.checks import lora_problems
from hpctrain.hf.config import hf_model_problems
from hpctrain.hf.weights import init_from_problems
from hpctrain.lustre import problems as lustre_problems
from hpctrain.mesh import AXES, DATA_AXES, DEFAULT_ORDER, resolve_sizes
from hpctrain.model.build import BUILTIN_ATTENTION, BUILTIN_FFN
from hpctrain.model.compile import backends
from hpctrain.model.mtp import mtp_problems
from hpctrain.model.recompute import RECOMPUTE
from hpctrain.model.shapes import ModelShape
from hpctrain.optimizers.checks import optimizer_problems
from hpctrain.plugins import broke_contract, call_each
from hpctrain.train.deadline import parse_end_time
from hpctrain.train.loggers import backend_problems
from hpctrain.train.stopping import parse_duration

PRECISIONS = ("fp32", "bf16", "fp16")
OUTER_OPTIMIZERS = ("none", "diloco")


def check_layout(sizes: Mapping[str, int], trainer: Any, model: Any, world_size: int,
                 order: str = DEFAULT_ORDER, sequence_parallel: bool = True) -> List[str]:
    """The pure layout, batch and model-shape checks (no plugins, no filesystem).

    Shared by training (``validate``) and the planner, which calls it for
    every candidate layout, so both reject exactly the same layouts with the
    same messages. ``sizes`` may hold ``dp=-1``; ``trainer`` needs
    ``global_batch_size``, ``micro_batch_size`` and ``seq_len``; ``model`` is
    a ModelConfig (dataclass or DictConfig).
    """
    problems: List[str] = []
    sizes, resolved = given_sizes(sizes, world_size, order, problems)
    try:
        ModelShape.from_config(model)
    except ConfigError as e:
        problems.append(str(e))

    # samples are split over dp x ep (hpctrain.mesh.SAMPLE_AXES), tokens over cp
    mb, gbs = trainer.micro_batch_size, trainer.global_batch_size
    splitters = [(a, sizes[a]) for a in ("dp", "ep") if a == "dp" or sizes[a] > 1]
    if mb < 1 or gbs < 1:
        problems.append("trainer.global_batch_size and trainer.micro_batch_size must be positive")
    elif not resolved:
        pass  # the batch split needs the data-parallel size, which the world size does not give
    elif gbs % (math.prod(n for _, n in splitters) * mb):
        m = math.prod(n for _, n in splitters) * mb
        lo = max(m, (gbs // m) * m)  # the nearest multiples at or below and above
        hi = lo + m
        shown = " x ".join(f"{a}({n})" for a, n in splitters)
        problems.append(
            f"trainer.global_batch_size={gbs} is not divisible by {shown} x "
            f"trainer.micro_batch_size({mb}) = {m}; use a multiple of {m} (e.g. {lo} or {hi})"
        )
    if trainer.seq_len > model.max_seq_len:
        problems.append(f"trainer.seq_len={trainer.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                        "shorten trainer.seq_len or raise model.max_seq_len")
    problems += _tensor_parallel_checks(sizes["tp"], sizes["cp"], trainer.seq_len, model, sequence_parallel)
    cp = sizes["cp"]
    if cp > 1 and trainer.seq_len % (2 * cp):
        problems.append(
            f"trainer.seq_len={trainer.seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each cp rank holds "
            f"two of {2 * cp} equal chunks); use trainer.seq_len="
            + " or ".join(str(n) for n in valid_seq_lens(trainer.seq_len, cp)))
    return problems


def given_sizes(sizes: Mapping[str, int], world_size: int, order: str,
                problems: List[str]) -> Tuple[Dict[str, int], bool]:
    """(the resolved sizes, True); or, when they do not multiply to the world
    size, the problem appended and (the sizes as given with ``dp=-1`` read as
    1, False), so that every per-axis check still runs and a layout's
    violations are reported together."""
    try:
        return resolve_sizes(sizes, world_size, order), True
    except ConfigError as e:
        problems.append(str(e))
        return {a: max(1, int(sizes.get(a, 1))) for a in AXES}, False


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _tensor_parallel_checks(tp: int, cp: int, seq_len: int, model: Any, sequence_parallel: bool) -> List[str]:
    """Shapes Megatron-style tensor parallelism can cut: whole query heads per
    rank, key/value heads split or replicated in equal groups, the SwiGLU
    width, and (sequence parallelism) equal sequence shards."""
    if tp == 1:
        return []
    try:
        shape = ModelShape.from_config(model)
    except ConfigError:
        return []  # reported by the caller
    problems = []
    if shape.n_heads % tp:
        problems.append(f"parallel.tp={tp} does not divide model.n_heads={shape.n_heads} (each rank holds whole "
                        f"query heads); use parallel.tp in {{{_divisors(shape.n_heads)}}}")
    kv = shape.n_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"parallel.tp={tp} and model.n_kv_heads={kv}: one must divide the other (key/value heads "
                        f"are split over tp, or each is replicated on tp / n_kv_heads ranks); use parallel.tp in "
                        f"{{{_divisors(kv)}}} or a multiple of {kv}")
    if shape.ffn_hidden % tp:
        problems.append(f"parallel.tp={tp} does not divide the SwiGLU width {shape.ffn_hidden} (model.ffn_hidden); "
                        f"set model.ffn_hidden to a multiple of {tp}")
    pad_to = getattr(model, "vocab_pad_to", None)
    if pad_to is not None and (pad_to < 1 or pad_to % tp):
        problems.append(f"model.vocab_pad_to={pad_to} must be a positive multiple of parallel.tp={tp} (the padded "
                        f"vocabulary is cut into tp equal row ranges); use {tp * 64} or null")
    if sequence_parallel and (seq_len % cp or (seq_len // cp) % tp):
        problems.append(f"trainer.seq_len={seq_len}: sequence parallelism cuts each rank's {seq_len // cp or seq_len} "
                        f"tokens into parallel.tp={tp} equal shards; use a multiple of "
                        f"{tp * max(cp, 1) * (2 if cp > 1 else 1)} "
                        "or parallel.sequence_parallel=false")
    return problems


def _with_data_vocab(cfg: Any) -> Tuple[Any, Any]:
    """``cfg`` with ``model.vocab_size=auto`` replaced by the data tokenizer's
    size, or the problem when the data records none. Indexed shards are looked
    at by rank 0 only (the other ranks wait for its agreed verdict)."""
    if cfg.data.source == "indexed" and not get_runtime().is_main:
        return cfg, []
    vocab = data_vocab_size(cfg.data)
    if vocab is None:  # a missing or damaged file first: it is why nothing is recorded
        unrecorded = (f"model.vocab_size=auto: data.source={cfg.data.source} records no tokenizer vocabulary "
                      "(hpctrain-prepare's shard description or a .json sidecar does); "
                      "set model.vocab_size=<the tokenizer's size>")
        return cfg, check_data_config(cfg.data, cfg.trainer.seq_len, 2**31 - 1) or [unrecorded]
    resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    resolved.model.vocab_size = int(vocab)
    return resolved, None


def _core_checks(cfg: Any, world_size: int, pm) -> List[str]:
    if cfg.model.vocab_size == "auto":  # hpctrain-train resolves it; here when called before that
        cfg, unresolved = _with_data_vocab(cfg)
        if unresolved is not None:
            return unresolved
    t, p = cfg.trainer, cfg.parallel
    given = {a: p[a] for a in AXES}
    problems = check_layout(given, t, cfg.model, world_size, p.order, bool(p.sequence_parallel))
    sizes, _ = given_sizes(given, world_size, p.order, [])  # check_layout has reported a bad product
    if cfg.model.recompute not in RECOMPUTE:
        problems.append(f"model.recompute={cfg.model.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    problems += mtp_problems(cfg)
    if t.precision not in PRECISIONS:
        problems.append(f"trainer.precision={t.precision!r} is not one of {', '.join(PRECISIONS)}")
    outer = cfg.optim.outer
    if outer.name not in OUTER_OPTIMIZERS:
        problems.append(f"optim.outer={outer.name!r} is not one of {', '.join(OUTER_OPTIMIZERS)}")
    if outer.dtype not in ("fp32", "bf16"):
        problems.append(f"optim.outer.dtype={outer.dtype!r} is not one of fp32, bf16")
    if outer.name == "diloco" and cfg.optim.name == "muon":
        # Muon spreads each whole matrix's Newton-Schulz over the data ranks, whose replicas differ under DiLoCo
        problems.append("optim=muon with optim.outer=diloco: Muon orthogonalises whole matrices gathered over the "
                        "dp ranks, which are separate replicas under DiLoCo; use optim=adamw, lamb or lars")
    if outer.name == "diloco" and outer.every > int(t.steps):
        problems.append(f"optim.outer.every={outer.every} is more than trainer.steps={t.steps}: the replicas would "
                        f"never average; use optim.outer.every <= {t.steps}")
    if cfg.reliability.nonfinite not in ("stop", "skip"):
        problems.append(f"reliability.nonfinite={cfg.reliability.nonfinite!r} is not one of stop, skip")
    if t.progress not in ("auto", "on", "off"):
        problems.append(f"trainer.progress={t.progress!r} is not one of auto, on, off")
    if t.compile_fullgraph and not t.compile:
        problems.append("trainer.compile_fullgraph=true needs trainer.compile=true (it says how to compile); set "
                        "trainer.compile=true or drop trainer.compile_fullgraph")
    if t.compile_backend != "inductor":  # (the default needs no look-up: listing backends imports dynamo)
        if t.compile_backend not in backends():
            problems.append(f"trainer.compile_backend={t.compile_backend!r} is not a torch.compile backend here; "
                            f"use inductor or aot_eager (or one of {', '.join(backends())})")
    try:
        if (parse_duration(t.max_time) or 0) < 0:
            raise ValueError
    except ValueError:
        problems.append(f"trainer.max_time={t.max_time!r} is not a duration: give seconds (3600) or "
                        "[D-]HH:MM:SS (01:00:00)")
    try:
        parse_end_time(t.end_time)
    except ValueError:
        problems.append(f"trainer.end_time={t.end_time!r} is not a time: give YYYY-MM-DDTHH:MM[:SS] (local time, "
                        "as squeue prints it) or Unix seconds")
    d = cfg.debug
    if d.fault != "none" and d.fault_rank >= world_size:
        problems.append(f"debug.fault_rank={d.fault_rank} is not a rank of this {world_size}-rank job; "
                        f"use 0..{world_size - 1}")
    if d.comm_delay_axis != "none" and d.comm_delay_ms == 0:
        problems.append(f"debug.comm_delay_axis={d.comm_delay_axis} with debug.comm_delay_ms=0 delays nothing; "
                        "set debug.comm_delay_ms (e.g. 50) or debug.comm_delay_axis=none")
    if d.fault != "none" and d.fault_at == "checkpoint" and not cfg.checkpoint.every:
        problems.append("debug.fault_at=checkpoint needs checkpoints: set checkpoint.every")
    if d.fault == "save_error" and not cfg.checkpoint.every:
        problems.append("debug.fault=save_error fails a periodic persistent save: set checkpoint.every")
    if d.fault == "local_save_error" and not cfg.checkpoint.local.every:
        problems.append("debug.fault=local_save_error fails a node-local save: set checkpoint.local.every")

    caps = plugins.capabilities(pm) if pm is not None else {}
    per_axis = [(f"comm.per_axis.{a}", b) for a, b in cfg.comm.per_axis.items()]
    for key, name in [("comm.backend", cfg.comm.backend)] + per_axis:
        if key.startswith("comm.per_axis.") and key.rsplit(".", 1)[1] not in AXES:
            problems.append(f"{key}: {key.rsplit('.', 1)[1]!r} is not a mesh axis ({', '.join(AXES)})")
            continue
        if name == "auto":  # resolved per device in hpctrain.run.resolve_backend_name
            continue
        try:
            plugins.require(pm, "comm.backend", name, key)
        except PluginError as e:
            problems.append(str(e))
    served_axes = caps.get("parallel", [])
    data_size = math.prod(sizes[a] for a in DATA_AXES)
    for axis in AXES:
        needed = data_size > 1 if axis == "dp" else sizes[axis] > 1
        if not needed:
            continue
        if axis not in served_axes:
            if axis == "ep":  # without an expert plugin, ep ranks are plain data-parallel ranks
                continue
            what = f"parallel.{axis}={sizes[axis]}" if axis != "dp" else \
                " x ".join(f"parallel.{a}={sizes[a]}" for a in DATA_AXES if sizes[a] > 1)
            problems.append(
                f"{what} but no installed plugin parallelises axis {axis!r} "
                f"(available: {', '.join(served_axes) or 'none'}); set parallel.{axis}=1 or install its plugin"
                + (f" ({plugins.blocked_hint()})" if plugins.blocked_hint() else "")
            )
            continue
        if pm is not None:
            try:
                plugins.axis_plugin(pm, cfg, axis)
            except PluginError as e:
                problems.append(str(e))
    for kind, builtin in (("attention", BUILTIN_ATTENTION), ("ffn", BUILTIN_FFN)):
        name = cfg.model[kind]
        if name not in builtin and name not in caps.get(f"model.{kind}", []):
            problems.append(f"model.{kind}={name!r} is unknown; choose one of: "
                            f"{', '.join(list(builtin) + caps.get(f'model.{kind}', []))}"
                            + (f" ({plugins.blocked_hint()})" if plugins.blocked_hint() else ""))
    ck = cfg.checkpoint
    if ck.every or ck.resume:
        if ck.format not in caps.get("checkpoint.format", []):
            problems.append(f"checkpoint.format={ck.format!r} is not provided by any installed plugin "
                            f"(available: {', '.join(caps.get('checkpoint.format', [])) or 'none'}); "
                            "set checkpoint.every=0 and checkpoint.resume=null, or install it"
                            + (f" ({plugins.blocked_hint()})" if plugins.blocked_hint() else ""))
    if ck.every and ck.dir:
        problems += _writable(str(ck.dir), "checkpoint.dir")
    problems += _local_tier_checks(cfg, world_size)
    problems += lustre_problems(cfg.checkpoint.lustre)
    problems += _elastic_checks(cfg)
    problems += check_data_config(cfg.data, t.seq_len, cfg.model.vocab_size)

    hf_problems = hf_model_problems(cfg)
    problems += hf_problems
    if not problems:  # the model's tensors are built (on the meta device) to check the weights against

        problems += init_from_problems(cfg, pm)
    problems += optimizer_problems(cfg, pm, caps.get("optim", []))
    problems += lora_problems(cfg, pm)
    problems += _observability_checks(cfg, world_size, pm)
    return problems


def _local_tier_checks(cfg: Any, world_size: int) -> List[str]:
    """checkpoint.local: copies on other nodes than there are, a directory that cannot be written."""
    lc = cfg.checkpoint.local
    if not lc.every:
        return []
    problems = []
    nodes = job_nodes(world_size)
    if lc.replicas >= nodes:
        problems.append(f"checkpoint.local.replicas={lc.replicas} needs more nodes than copies: this job has "
                        f"{nodes} node(s), and a copy on its own node survives nothing the original does not; use "
                        f"checkpoint.local.replicas={max(0, nodes - 1)}" + (" (or more nodes)" if nodes > 1 else
                                                                              " (one node), or more nodes"))
    if lc.dir:
        problems += _writable(str(lc.dir), "checkpoint.local.dir")
    return problems


def _elastic_checks(cfg: Any) -> List[str]:
    """trainer.elastic: a run that must continue from saved state, with replicas it may drop."""
    if not cfg.trainer.elastic:
        return []
    problems = []
    if not cfg.checkpoint.resume:
        problems.append("trainer.elastic=true without checkpoint.resume: a run that shrank would start again from "
                        "step 0; set checkpoint.resume=auto (slurm/train.sbatch does)")
    if cfg.optim.outer.name != "none":
        problems.append(f"trainer.elastic=true with optim.outer={cfg.optim.outer.name}: its dp ranks are replicas "
                        "training alone, and fewer of them would drop replicas' progress; set trainer.elastic=false "
                        "or optim.outer=none")
    return problems


def _observability_checks(cfg: Any, world_size: int, pm) -> List[str]:
    """Logger backends that exist, a logging directory that can be written, profiled steps and ranks that exist."""
    problems = backend_problems(cfg, pm)
    if cfg.logging.dir and cfg.logging.backends:
        problems += _writable(str(cfg.logging.dir), "logging.dir")
    prof = cfg.trainer.profile
    bad_steps = [s for s in prof.steps if not 1 <= s <= cfg.trainer.steps]
    if bad_steps:
        problems.append(f"trainer.profile.steps={list(prof.steps)}: {bad_steps} not steps of this run; "
                        f"use steps in 1..{cfg.trainer.steps} (trainer.steps)")
    bad_ranks = [r for r in prof.ranks if not 0 <= r < world_size]
    if bad_ranks:
        problems.append(f"trainer.profile.ranks={list(prof.ranks)}: {bad_ranks} not ranks of this "
                        f"{world_size}-rank job; use ranks in 0..{world_size - 1}")
    return problems


def _writable(path: str, key: str) -> List[str]:
    """[] when a file can be created in ``path`` (made if missing), else why not:
    found now, before any step is computed, not at the first save."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hpctrain-write-test-"):
            pass
    except OSError as e:
        return [f"{key}={path!r} is not writable ({e.strerror or e}); choose a directory this job can write "
                "(e.g. on the cluster's scratch file system)"]
    return []


def validate(cfg: Any, world_size: int, pm=None, run_dir: Optional[str] = None) -> List[str]:
    """All problems (core first, then plugins'), each with its fix, all at
    once; empty when the run can start. Out-of-range values come alone: the
    other checks would divide by them."""
    out_of_range = range_problems(cfg)
    if out_of_range:
        return out_of_range
    problems = _core_checks(cfg, world_size, pm)
    if pm is not None:
        for plugin, found in call_each(pm, "hpctrain_validate", cfg=cfg, world_size=world_size,
                                   run_dir=run_dir):
            if not (isinstance(found or [], (list, tuple)) and all(isinstance(p, str) for p in found or [])):
                raise broke_contract(plugin, "hpctrain_validate", found, "a list of problems (str)")
            problems += [p for p in (found or []) if p not in problems]
    return problems
