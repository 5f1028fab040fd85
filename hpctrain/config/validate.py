"""Validation: every problem with a config, as one-line messages naming the fix.

Runs on every rank before any collective (it depends only on the config, the
world size and the local filesystem), so all ranks reach the same verdict and
exit together. Plugins add their checks through ``hpctrain_validate``.
"""
from __future__ import annotations

from typing import Any, List

from hpctrain.errors import ConfigError, PluginError
from hpctrain.mesh import AXES, resolve_sizes

PRECISIONS = ("fp32", "bf16")


def _core_checks(cfg: Any, world_size: int, pm) -> List[str]:
    from hpctrain import plugins
    from hpctrain.data.sources import check_data_config
    from hpctrain.model.build import BUILTIN_ATTENTION, BUILTIN_FFN
    from hpctrain.model.shapes import ModelShape

    problems: List[str] = []
    t, p = cfg.trainer, cfg.parallel
    try:
        sizes = resolve_sizes({a: p[a] for a in AXES}, world_size, p.order)
    except ConfigError as e:
        return [str(e)]  # everything below depends on the layout

    try:
        ModelShape.from_config(cfg.model)
    except ConfigError as e:
        problems.append(str(e))

    dp, mb = sizes["dp"], t.micro_batch_size
    if mb < 1 or t.global_batch_size < 1:
        problems.append("trainer.global_batch_size and trainer.micro_batch_size must be positive")
    elif t.global_batch_size % (dp * mb):
        m = dp * mb
        lo, hi = max(m, (t.global_batch_size // m) * m), (t.global_batch_size // m + 1) * m
        problems.append(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by dp({dp}) x "
            f"trainer.micro_batch_size({mb}) = {m}; use a multiple of {m} (e.g. {lo} or {hi})"
        )
    if t.seq_len > cfg.model.max_seq_len:
        problems.append(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if t.steps < 0:
        problems.append(f"trainer.steps={t.steps} must be >= 0")
    if t.log_every < 1:
        problems.append(f"trainer.log_every={t.log_every} must be >= 1")
    if t.precision not in PRECISIONS:
        problems.append(f"trainer.precision={t.precision!r} is not one of {', '.join(PRECISIONS)}")
    if t.progress not in ("auto", "on", "off"):
        problems.append(f"trainer.progress={t.progress!r} is not one of auto, on, off")

    caps = plugins.capabilities(pm) if pm is not None else {}
    for key, name in [("comm.backend", cfg.comm.backend)] + [(f"comm.per_axis.{a}", b) for a, b in cfg.comm.per_axis.items()]:
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
    for axis in AXES:
        if sizes[axis] > 1 and axis not in served_axes:
            problems.append(
                f"parallel.{axis}={sizes[axis]} but no installed plugin parallelises axis {axis!r} "
                f"(available: {', '.join(served_axes) or 'none'}); set parallel.{axis}=1 or install its plugin"
            )
    for kind, builtin in (("attention", BUILTIN_ATTENTION), ("ffn", BUILTIN_FFN)):
        name = cfg.model[kind]
        if name not in builtin and name not in caps.get(f"model.{kind}", []):
            problems.append(f"model.{kind}={name!r} is unknown; choose one of: "
                            f"{', '.join(list(builtin) + caps.get(f'model.{kind}', []))}")
    ck = cfg.checkpoint
    if ck.every or ck.resume:
        if ck.format not in caps.get("checkpoint.format", []):
            problems.append(f"checkpoint.format={ck.format!r} is not provided by any installed plugin "
                            f"(available: {', '.join(caps.get('checkpoint.format', [])) or 'none'}); "
                            "set checkpoint.every=0 and checkpoint.resume=null, or install it")
    problems += check_data_config(cfg.data, t.seq_len, cfg.model.vocab_size)
    return problems


def validate(cfg: Any, world_size: int, pm=None) -> List[str]:
    """All problems (core first, then plugins'); empty when the run can start."""
    problems = _core_checks(cfg, world_size, pm)
    if pm is not None and not problems:
        for found in pm.hook.hpctrain_validate(cfg=cfg, world_size=world_size):
            problems += list(found or [])
    return problems
