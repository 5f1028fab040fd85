"""What ``hpctrain-plan`` computes, without printing: the run's config composed
as ``hpctrain-train`` composes it, the pins the user gave (``--pin`` and the
knobs' own config keys), the inputs of the search and the search itself
(``make_plan``). ``cli`` prints it, ``compare`` predicts a finished run's own
layout with it and the tuner ranks its candidates with it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf

from hpctrain.config.store import compose, to_config
from hpctrain.config.validate import PRECISIONS, validate
from hpctrain.errors import ConfigError
from hpctrain.optimizers.kinds import OPTIMIZERS
from hpctrain.pipeline.bubble import SCHEDULES
from hpctrain.planner.activations import RECOMPUTE
from hpctrain.planner.arch import Arch
from hpctrain.planner.cluster import cluster_spec, load_calibration
from hpctrain.planner.estimate import Workload
from hpctrain.planner.frameworks import for_config
from hpctrain.planner.lora import lora_plan
from hpctrain.planner.memory import optimizer_profile
from hpctrain.planner.report import PLUGIN_KEYS, unknown_keys
from hpctrain.planner.search import search
from hpctrain.plugins import create_manager

DEFAULT_PRECISION = "bf16"


def parse_pins(pairs: Sequence[str], shown: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """--pin zero=1 --pin recompute=selective -> {"zero": 1, "recompute": "selective"}.
    ``shown``: how each pair was given, for the error (default ``--pin <pair>``)."""
    allowed = {"zero": ("0", "1", "2", "3"), "recompute": RECOMPUTE, "schedule": SCHEDULES, "vpp": None,
               "layers": None, "optim": OPTIMIZERS}
    out: Dict[str, Any] = {}
    for i, pair in enumerate(pairs):
        key, _, value = pair.partition("=")
        if key == "layers":
            counts = _layer_counts(value, shown[i] if shown else f"--pin {pair}")
            if counts:
                out[key] = counts
            continue
        options = allowed.get(key, ())
        bad_vpp = key == "vpp" and not (value.isdigit() and int(value) > 0)
        if key not in allowed or (options and value not in options) or bad_vpp:
            given = shown[i] if shown else f"--pin {pair}"
            raise ConfigError(f"{given}: use zero=0..3, recompute={'|'.join(RECOMPUTE)}, "
                              f"schedule={'|'.join(SCHEDULES)}, vpp=<positive integer>, "
                              f"optim={'|'.join(OPTIMIZERS)} or layers=[blocks per stage]")
        out[key] = int(value) if key in ("zero", "vpp") else value
    return out


def _layer_counts(value: str, given: str) -> Tuple[int, ...]:
    """``[7,8,8,7]`` or ``7,8,8,7`` -> (7, 8, 8, 7); ``auto`` -> () (the planner's own split)."""
    text = value.strip().strip("'\"")
    if text == "auto":
        return ()
    try:
        counts = tuple(int(x) for x in text.strip("[]").split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ConfigError(f"{given}: give auto or the blocks of each pipeline stage, e.g. "
                          "parallel.pipeline.layers=[7,8,8,7]")
    return counts


def _pins(overrides: Sequence[str]) -> Dict[str, Any]:
    """Values the user fixed explicitly: parallel.<axis>=N, trainer.micro_batch_size=N,
    and the knobs' own keys (parallel.zero.stage, model.recompute,
    parallel.pipeline.schedule, parallel.pipeline.vpp), checked as --pin checks them."""
    keys = {f"parallel.{a}": a for a in ("tp", "pp", "cp", "ep", "dp")}
    keys["trainer.micro_batch_size"] = "micro_batch"
    knob_of = {key: knob for knob, key in PLUGIN_KEYS.items()}
    pins: Dict[str, Any] = {}
    knobs: List[str] = []
    shown: List[str] = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in keys and value.lstrip("-").isdigit() and not (key == "parallel.dp" and value == "-1"):
            pins[keys[key]] = int(value)
        elif key in knob_of:
            knobs.append(f"{knob_of[key]}={value}")
            shown.append(o)
    return {**pins, **parse_pins(knobs, shown)}


def compose_config(overrides: List[str], pm) -> Any:
    """The typed run config, with Hydra's errors turned into one clear line."""
    try:
        cfg = compose(overrides, pm)
    except MissingConfigException as e:
        group, _, name = str(e.missing_cfg_file or "").partition("/")
        options = [o for o in (e.options or []) if not o.endswith("_schema")]
        hint = " (or give the dimensions: model.d_model=... model.n_layers=...)" if group == "model" else ""
        raise ConfigError(f"unknown {group or 'config'} preset {name!r}; available: {', '.join(options) or 'none'}"
                          f" (hpctrain/conf/{group}/){hint}") from None
    except HydraException as e:
        cause = f": {e.__cause__}" if e.__cause__ else ""
        raise ConfigError(f"{str(e).splitlines()[0]}{cause}".replace("\n", " ")) from None
    return to_config(OmegaConf.to_container(cfg, resolve=True), pm)


def make_plan(overrides: Sequence[str], calibration: Optional[str] = None, pm=None,
              knob_pins: Optional[Dict[str, Any]] = None) -> Tuple[Any, ...]:
    """(plan, arch, workload, cluster, cfg, user overrides): the whole pipeline without printing."""
    arch, work, cluster, cfg, user, pins = plan_inputs(overrides, calibration, pm, knob_pins)
    return search(arch, cfg.model, work, cluster, pins), arch, work, cluster, cfg, user


def plan_inputs(overrides: Sequence[str], calibration: Optional[str] = None, pm=None,
                knob_pins: Optional[Dict[str, Any]] = None) -> Tuple[Any, ...]:
    """(arch, workload, cluster, cfg, user overrides, pins): what ``make_plan`` searches with."""
    pm = pm or create_manager()
    user = list(overrides)
    knob_pins = dict(knob_pins or {})
    if "optim" in knob_pins:  # --pin optim=NAME is the optimizer's preset, as hpctrain-train takes it
        user.append(f"optim={knob_pins.pop('optim')}")
    if not any(o.split("=", 1)[0] == "trainer.precision" for o in user):
        user.append(f"trainer.precision={DEFAULT_PRECISION}")
    cfg = compose_config(user, pm)
    if cfg.trainer.precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={cfg.trainer.precision!r} is not one of {', '.join(PRECISIONS)}")
    cluster = cluster_spec(cfg.cluster, load_calibration(calibration))
    arch = Arch.from_model_config(cfg.model)
    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.optim.name!r}: the planner knows the state of {', '.join(OPTIMIZERS)}")
    lora = lora_plan(cfg)
    if lora is not None:
        lora.check(arch)
    work = Workload(cfg.trainer.global_batch_size, cfg.trainer.seq_len, cfg.trainer.precision,
                    optimizer_profile(cfg.optim.name, arch.muon_share), cfg.comm.bucket_mb * 2 ** 20,
                    for_config(cfg), lora=lora)
    return arch, work, cluster, cfg, user, {**_pins(overrides), **(knob_pins or {})}


def check_with_training(cfg: Any, train_overrides: List[str], world_size: int, pm) -> Tuple[List[str], List[str]]:
    """(keys the installed schema lacks, problems ``validate`` reports) for the
    best layout's hpctrain-train command, so the user sees what runs today."""
    missing = unknown_keys(train_overrides, cfg)
    known = [o for o in train_overrides if o.split("=", 1)[0] not in missing]
    return missing, validate(compose_config(known, pm), world_size, pm)
