"""``hpctrain-plan --compare RUN_DIR``: the prediction for a finished run's own layout beside what
its ``metrics.jsonl`` measured.

The run's layout comes from the config it trained with (``store.run_config_path``; mesh sizes from
``layout.json`` when the run wrote it, the micro-batch, ZeRO stage, recompute mode, schedule and the
model's shape from the config), each passed to
the planner as a pin, with the run's own overrides (``.hydra/overrides.yaml``) and any given on the
command line after them (the cluster, when the run's config does not name one; its GPU count is the run's
number of ranks unless ``cluster.gpus`` is given). Measured: the median
step time of the steps after the first, the last logged peak memory (CUDA: the allocator's maximum
allocated bytes; CPU: the peak resident set, which includes the interpreter and libraries), bytes
per group per step (median).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Dict, List, Sequence

from omegaconf import OmegaConf

from hpctrain.config.store import run_config_path
from hpctrain.errors import ConfigError
from hpctrain.planner.plan import make_plan

GB = 1e9


def read_run(run_dir: str) -> Dict[str, Any]:
    """The run's config, overrides, mesh sizes and metric rows; ConfigError naming what is missing."""
    hydra = os.path.join(run_dir, ".hydra")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    config = run_config_path(run_dir)
    for path in (config or os.path.join(hydra, "config.yaml"), metrics):
        if not os.path.isfile(path):
            raise ConfigError(f"--compare {run_dir}: {path} does not exist; give the run directory of a finished "
                              "hpctrain-train run (it holds .hydra/ and metrics.jsonl)")
    assert config is not None  # (the loop refused a directory without one)
    cfg: Any = OmegaConf.to_container(OmegaConf.load(config))
    vocab = (cfg.get("model") or {}).get("vocab_size")
    if isinstance(vocab, str):  # auto, in a run older than its resolved_config.yaml
        raise ConfigError(f"--compare {run_dir}: the run's config has model.vocab_size={vocab}; compare a run "
                          "made by this version (it records the number it used)")
    overrides: List[str] = []
    if os.path.isfile(os.path.join(hydra, "overrides.yaml")):
        given: Any = OmegaConf.to_container(OmegaConf.load(os.path.join(hydra, "overrides.yaml")))
        overrides = [str(o) for o in given or []]
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ConfigError(f"--compare {run_dir}: metrics.jsonl has no step")
    sizes = {a: int(cfg["parallel"][a]) for a in ("tp", "cp", "ep", "dp", "pp")}
    layout_file = os.path.join(run_dir, "layout.json")
    if os.path.isfile(layout_file):
        with open(layout_file) as f:
            sizes = {a: int(n) for a, n in json.load(f)["sizes"].items()}
    return {"cfg": cfg, "overrides": overrides, "sizes": sizes, "rows": rows}


MODEL_SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "ffn_multiple_of",
                    "tie_embeddings")
"""The model keys the planner's arithmetic reads (``ModelShape.from_config``)."""


def pins_of(run: Dict[str, Any]) -> List[str]:
    """Overrides that pin the planner to the run's own layout."""
    cfg = run["cfg"]
    out = [f"parallel.{a}={n}" for a, n in run["sizes"].items()]
    out.append(f"trainer.micro_batch_size={cfg['trainer']['micro_batch_size']}")
    out += [f"trainer.global_batch_size={cfg['trainer']['global_batch_size']}",
            f"trainer.seq_len={cfg['trainer']['seq_len']}"]
    out.append(f"trainer.precision={cfg['trainer']['precision']}")
    out.append(f"model.recompute={cfg['model'].get('recompute', 'none')}")
    # the shape the run trained (model.vocab_size=auto and model.hf_dir's shape are filled in at the run's start)
    out += [f"model.{k}={'null' if cfg['model'].get(k) is None else cfg['model'][k]}" for k in MODEL_SHAPE_KEYS
            if k in cfg["model"]]
    zero = (cfg.get("parallel", {}).get("zero") or {}).get("stage")
    if zero is not None:
        out.append(f"parallel.zero.stage={zero}")
    pipe = cfg.get("parallel", {}).get("pipeline") or {}
    if run["sizes"]["pp"] > 1 and pipe:
        out += [f"parallel.pipeline.schedule={pipe['schedule']}", f"parallel.pipeline.vpp={pipe.get('vpp', 1)}"]
    return out


def measured(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    timed = rows[1:] if len(rows) > 1 else rows
    peak_key = next((k for k in ("cuda_max_allocated_bytes.max", "peak_rss_bytes.max", "peak_rss_bytes")
                     if any(k in r for r in rows)), None)
    peaks = [r[peak_key] for r in rows if peak_key and peak_key in r]
    groups = sorted({k for r in timed for k in r if k.startswith("comm_bytes.")})
    return {"step_s": statistics.median(float(r["step_time_s"]) for r in timed),
            "peak_bytes": peaks[-1] if peaks else None, "peak_metric": peak_key,
            "comm_bytes": {k.split(".", 1)[1]: statistics.median(float(r.get(k, 0.0)) for r in timed) for k in groups}}


def compare_text(label: str, est: Any, got: Dict[str, Any]) -> str:
    lines = [f"layout {label}: predicted against measured (median of steps after the first)",
             f"  step time  {est.time.total * 1e3:10.1f} ms   {got['step_s'] * 1e3:10.1f} ms",
             f"  memory     {est.memory.total / GB:10.3f} GB   "
             + (f"{got['peak_bytes'] / GB:10.3f} GB ({got['peak_metric']})" if got["peak_bytes"] else "-"),
             "  bytes on the wire per step: predicted per axis "
             + (", ".join(f"{a} {v / 2 ** 20:.2f} MiB" for a, v in est.comm_bytes.items() if v) or "none")
             + "; measured per group "
             + (", ".join(f"{g} {v / 2 ** 20:.2f} MiB" for g, v in got["comm_bytes"].items()) or "none")]
    return "\n".join(lines)


def compare(run_dir: str, extra: Sequence[str], calibration: Any, pm) -> str:
    run = read_run(run_dir)
    keep = [o for o in run["overrides"] if not o.split("=", 1)[0].lstrip("+~").startswith(
        ("parallel.", "trainer.micro_batch_size", "trainer.precision", "model.recompute", "hydra.",
          "trainer.global_batch_size", "trainer.seq_len"))]
    given = {o.split("=", 1)[0].lstrip("+~") for o in list(keep) + list(extra)}
    ranks = math.prod(run["sizes"].values())
    if not (run["cfg"].get("cluster") or {}).get("gpus") and not any(k.startswith("cluster") for k in given):
        raise ConfigError(f"--compare {run_dir}: the run's config names no cluster to predict for; give the "
                          f"machine it ran on after the directory, e.g. hpctrain-plan --compare {run_dir} "
                          f"cluster=cpu-8 (its {ranks} ranks are taken from the run)")
    # the run's own world, whatever the machine's preset says: a 4-rank run on an 8-rank node is a 4-GPU plan
    overrides = keep + pins_of(run) + list(extra) + ([] if "cluster.gpus" in given else [f"cluster.gpus={ranks}"])
    plan, *_ = make_plan(overrides, calibration, pm)
    return compare_text(plan.best.layout.label(), plan.best, measured(run["rows"]))
