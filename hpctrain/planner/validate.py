"""``hpctrain-plan --validate``: the planner, pinned to each published run's
own layout, beside what that run measured.

For every row of the published-runs table (``hpctrain.planner.published``)
the run is composed as ``hpctrain-plan`` composes a user's run (cluster preset,
GPU count, global batch, sequence, precision: ``plan.plan_inputs``) and the
published layout is pinned with the planner's own pins (``parallel.<axis>=N``,
``trainer.micro_batch_size``, and ``--pin`` zero / recompute / schedule / vpp
through ``plan.parse_pins``). A knob the source does not print stays free:
the planner picks it, as it would for a user, and the row shows the pick.
The search (``search.search``) then answers with its fastest fitting layout,
or refuses; a refusal is reported with the planner's own reason, never
dropped.

Why the comparison is MFU: it is what every source prints or lets one
compute. The published MFU is, in this order of preference,
(1) derived from a printed step time or tokens per second per GPU with the
planner's own model FLOPs (PaLM's 6N + 12lhs, ``compute.model_flops_per_token``),
so that the ratio is exactly the ratio of throughputs; (2) a step time from
hardware TFLOP/s with the source's formula (Narayanan et al.'s F, full
recompute, GPT family); (3) model TFLOP/s over the cluster preset's peak;
(4) the printed MFU. ratio = predicted MFU / published MFU; "within 15%" is
0.85 <= ratio <= 1.15.

Each row is planned with the code that ran it (``framework`` in the table,
``frameworks.FRAMEWORKS``): its kernels, its overlap of communication, its
model states and activations; ``hpctrain-plan`` itself plans hpctrain's own
code.

Rows the planner cannot express are shown as "not expressible" with the
reason (fp8 training, a model family the planner does not know, a
published shape that differs from the named preset); they and the
refusals count as misses in the "within" fraction of all rows.
This module does not change the planner's model: it only reports on it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hpctrain.config.validate import PRECISIONS as PLANNER_PRECISIONS
from hpctrain.errors import ConfigError
from hpctrain.planner.arch import Arch
from hpctrain.planner.compute import model_flops_per_token, narayanan_flops_per_iteration
from hpctrain.planner.frameworks import framework
from hpctrain.planner.plan import parse_pins, plan_inputs
from hpctrain.planner.published import DEFAULT_TABLE, PublishedRun, load_runs
from hpctrain.planner.search import search

TOLERANCE = 0.15
PLANNER_FAMILIES = ("llama", "gpt", "nemotron")

PREDICTED, REFUSED, NOT_EXPRESSIBLE = "predicted", "refused", "not expressible"


@dataclass
class Outcome:
    """One published run and what the planner said about it."""

    run: PublishedRun
    status: str
    reason: str = ""
    published_mfu: Optional[float] = None
    basis: str = ""
    """How ``published_mfu`` was obtained (see the module doc)."""
    published_step_s: Optional[float] = None
    predicted_mfu: Optional[float] = None
    predicted_step_s: Optional[float] = None
    memory_gb: Optional[float] = None
    usable_gb: Optional[float] = None
    pick: str = ""
    """The layout the planner chose within the pins (free knobs included)."""

    @property
    def ratio(self) -> Optional[float]:
        if self.predicted_mfu is None or not self.published_mfu:
            return None
        return self.predicted_mfu / self.published_mfu

    @property
    def within(self) -> bool:
        r = self.ratio
        return r is not None and abs(r - 1.0) <= TOLERANCE + 1e-12

    def as_dict(self) -> Dict[str, Any]:
        run = self.run
        return {"id": run.id, "source": run.source.key, "where": run.where, "cite": run.source.cite,
                "framework": run.framework,
                "held_out": run.held_out, "gpu": run.gpu, "gpus": run.gpus, "layout": run.layout.label(),
                "global_batch": run.global_batch, "seq_len": run.seq_len, "precision": run.precision,
                "status": self.status, "reason": self.reason, "published_mfu": self.published_mfu,
                "published_basis": self.basis, "published_step_s": self.published_step_s,
                "predicted_mfu": self.predicted_mfu, "predicted_step_s": self.predicted_step_s,
                "ratio": self.ratio, "within_tolerance": self.within, "memory_gb": self.memory_gb,
                "usable_gb": self.usable_gb, "pick": self.pick}


# -- one run ------------------------------------------------------------------------
def not_expressible(run: PublishedRun) -> str:
    """Why the planner cannot take this run as published ('' if it can)."""
    m, lay = run.model, run.layout
    if run.precision == "fp8" and not run.framework.startswith("torchtitan"):
        return (f"fp8 training outside torchtitan's float8 linears: the planner plans {', '.join(PLANNER_PRECISIONS)} "
                "and torchtitan's float8")
    if m.family not in PLANNER_FAMILIES:
        return (f"model family {m.family!r}: the planner knows llama (SwiGLU, GQA), gpt (GeLU 4h MLP, "
                "multi-head attention, biases) and nemotron (squared-ReLU MLP, GQA, no biases) blocks")
    if m.vocab is None:
        return "vocabulary size not published in the sources read"
    if m.family == "gpt" and (m.kv_heads != m.heads or m.ffn != 4 * m.hidden):
        return "gpt family with grouped-query attention or an MLP other than 4h"
    if lay.pp > 1 and lay.vpp and lay.vpp > 1 and lay.pp * lay.vpp > m.layers:
        return f"vpp {lay.vpp} on {lay.pp} stages asks for more virtual stages than the {m.layers} blocks"
    return ""


def _overrides(run: PublishedRun) -> List[str]:
    """The run as hpctrain-plan overrides, its mesh and micro-batch pinned."""
    m, lay = run.model, run.layout
    precision = "bf16" if run.precision in ("16-bit", "fp8") else run.precision
    out = [f"cluster={run.gpu}", f"cluster.gpus={run.gpus}", *run.cluster_overrides,
           f"trainer.global_batch_size={run.global_batch}", f"trainer.seq_len={run.seq_len}",
           f"trainer.precision={precision}"]
    if m.family == "llama":
        out += [f"model={m.preset}"] if m.preset else [
            f"model.vocab_size={m.vocab}", f"model.d_model={m.hidden}", f"model.n_layers={m.layers}",
            f"model.n_heads={m.heads}", f"model.n_kv_heads={m.kv_heads}", f"model.ffn_hidden={m.ffn}",
            f"model.tie_embeddings={str(m.tied).lower()}"]
        out.append(f"model.max_seq_len={run.seq_len}")
    out += [f"parallel.{a}={n}" for a, n in (("tp", lay.tp), ("pp", lay.pp), ("dp", lay.dp), ("cp", lay.cp),
                                             ("ep", lay.ep))]
    if lay.micro_batch is not None:
        out.append(f"trainer.micro_batch_size={lay.micro_batch}")
    return out


def _knob_pins(run: PublishedRun) -> Dict[str, Any]:
    """The published knobs as the planner's ``--pin`` values (unpublished ones stay free)."""
    lay = run.layout
    pairs = []
    if lay.zero is not None:
        pairs.append(f"zero={lay.zero}")
    if lay.recompute is not None:
        pairs.append(f"recompute={lay.recompute}")
    if lay.pp > 1 and lay.schedule is not None:
        pairs.append(f"schedule={lay.schedule}")
        if lay.vpp is not None:
            pairs.append(f"vpp={lay.vpp}")
    return parse_pins(pairs)


def planner_arch(run: PublishedRun, preset_arch: Arch) -> Arch:
    """The planner's Arch for the run: the llama preset's (checked against the
    published shape) or a GPT-family Arch built from the published dimensions."""
    m = run.model
    if m.family == "gpt":
        positions = run.seq_len if m.positions == "learned" else 0
        return Arch("gpt", int(m.vocab or 0), m.hidden, m.layers, m.heads, m.heads, m.ffn, m.tied, positions,
                    name=run.id)
    if m.family == "nemotron":
        return Arch.nemotron(m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, int(m.vocab or 0), name=run.id)
    got = (preset_arch.n_layers, preset_arch.d_model, preset_arch.n_heads, preset_arch.n_kv_heads,
           preset_arch.ffn_hidden, preset_arch.vocab_size, preset_arch.tie_embeddings)
    want = (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab, m.tied)
    if got != want:
        raise _NotExpressible(f"preset {m.preset!r} has (layers, hidden, heads, kv, ffn, vocab, tied) {got}, "
                              f"the run {want}")
    return preset_arch


class _NotExpressible(Exception):
    pass


def published_figures(run: PublishedRun, arch: Optional[Arch], peak_flops: float
                      ) -> Tuple[Optional[float], str, Optional[float]]:
    """(published MFU, how it was obtained, published step seconds or None); see the module doc."""
    p, tokens = run.published, run.global_batch * run.seq_len
    step, basis = None, ""
    if p.step_time_s is not None:
        step, basis = p.step_time_s, "step time"
    elif p.tokens_per_s_per_gpu is not None:
        step, basis = tokens / (p.tokens_per_s_per_gpu * run.gpus), "tokens/s/GPU"
    elif (p.tflops_per_gpu is not None and p.tflops_kind == "hardware" and run.model.family == "gpt"
          and run.layout.recompute == "full"):
        m = run.model
        flops = narayanan_flops_per_iteration(run.global_batch, run.seq_len, m.layers, m.hidden, int(m.vocab or 0))
        step, basis = flops / (p.tflops_per_gpu * 1e12 * run.gpus), "hardware TFLOP/s (Narayanan's F)"
    if step is not None and arch is not None:
        return model_flops_per_token(arch, run.seq_len) * tokens / (step * run.gpus * peak_flops), basis, step
    if p.tflops_per_gpu is not None and p.tflops_kind == "model":
        return p.tflops_per_gpu * 1e12 / peak_flops, "model TFLOP/s / peak", step
    if p.mfu is not None:
        return p.mfu, "printed MFU", step
    return None, basis or "not derivable", step


def validate_run(run: PublishedRun, pm: Any) -> Outcome:
    """The planner's answer for one published run (never raises for a planner refusal)."""
    why = not_expressible(run)
    # composed as hpctrain-plan composes a run, for the cluster (peak, memory) and the workload
    preset_arch, work, cluster, cfg, _user, pins = plan_inputs(_overrides(run), None, pm,
                                                               {} if why else _knob_pins(run))
    code = framework(run.framework)
    work = replace(work, framework=code, state_bytes=code.states, fp8=run.precision == "fp8")
    arch: Optional[Arch] = None
    if run.model.family in PLANNER_FAMILIES and run.model.vocab is not None:
        try:
            arch = planner_arch(run, preset_arch)
        except _NotExpressible as e:
            why = why or str(e)
    pub_mfu, basis, pub_step = published_figures(run, arch, cluster.peak_flops)
    out = Outcome(run, NOT_EXPRESSIBLE, why, pub_mfu, basis, pub_step, usable_gb=cluster.mem_bytes / 1e9)
    if why or arch is None:
        return out
    try:
        plan = search(arch, cfg.model if run.model.family == "llama" else None, work, cluster, pins)
    except ConfigError as e:
        out.status, out.reason = REFUSED, " / ".join(line.strip() for line in str(e).splitlines() if line.strip())
        return out
    best = plan.best
    lay = best.layout
    out.status = PREDICTED
    out.predicted_mfu, out.predicted_step_s = best.mfu, best.time.total
    out.memory_gb = best.memory.total / 1e9
    out.pick = f"{lay.label()}, zero {lay.zero}, recompute {lay.recompute}, mb {lay.micro_batch}"
    return out


def validate_all(runs: Sequence[PublishedRun], pm: Any) -> List[Outcome]:
    return [validate_run(run, pm) for run in runs]


# -- summary and output ------------------------------------------------------------
def summarize(outcomes: Sequence[Outcome]) -> Dict[str, Any]:
    """Counts, median ratio (of predicted rows) and the fraction within 15% (of all rows and of predicted ones)."""
    predicted = [o for o in outcomes if o.ratio is not None]
    within = sum(1 for o in predicted if o.within)
    ratios = [o.ratio for o in predicted if o.ratio is not None]
    return {"runs": len(outcomes), "predicted": len(predicted),
            "refused": sum(1 for o in outcomes if o.status == REFUSED),
            "not_expressible": sum(1 for o in outcomes if o.status == NOT_EXPRESSIBLE),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "min_ratio": min(ratios) if ratios else None, "max_ratio": max(ratios) if ratios else None,
            "within": within, "within_fraction_of_runs": within / len(outcomes) if outcomes else 0.0,
            "within_fraction_of_predicted": within / len(predicted) if predicted else 0.0}


def _summary_line(label: str, s: Dict[str, Any]) -> str:
    if s["median_ratio"] is None:
        ratios = "no predictions"
    else:
        ratios = (f"median ratio {s['median_ratio']:.2f} (range {s['min_ratio']:.2f}-{s['max_ratio']:.2f}, "
                  f"{s['predicted']} predicted)")
    return (f"  {label:<9} {s['runs']} runs: {s['predicted']} predicted, {s['refused']} refused, "
            f"{s['not_expressible']} not expressible; {ratios}; within 15%: {s['within']} of {s['runs']} runs "
            f"({s['within_fraction_of_runs']:.0%}), {s['within']} of {s['predicted']} predicted "
            f"({s['within_fraction_of_predicted']:.0%})")


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def text(outcomes: Sequence[Outcome], table: str) -> str:
    """One line per run (a refusal's or inexpressible row's reason on it), then the summary."""
    lines = [f"hpctrain-plan --validate: {len(outcomes)} published runs from {table}, the planner pinned to each "
             "run's published layout (knobs the source does not print are the planner's pick);",
             "published MFU from the printed step time or tokens/s with the planner's model FLOPs (6N + 12lhs), "
             "else from TFLOP/s or the printed MFU; ratio = predicted / published; H = held out.",
             f"{'#':>3} {'run':<40} H {'GPUs':>6}  {'published layout':<26} {'pub MFU':>7} {'pred MFU':>8} "
             f"{'ratio':>5} {'pub s':>8} {'pred s':>8} {'GB':>6}  verdict"]
    for i, o in enumerate(outcomes, 1):
        run = o.run
        if o.status == PREDICTED:
            verdict = f"fits {o.usable_gb:.0f} GB usable; pick: {o.pick}"
        else:
            verdict = f"{o.status}: {o.reason}"
        lines.append(f"{i:>3} {run.id:<40} {'H' if run.held_out else ' '} {run.gpus:>6}  "
                     f"{run.layout.label():<26} {_pct(o.published_mfu):>7} {_pct(o.predicted_mfu):>8} "
                     f"{_num(o.ratio, '.2f'):>5} {_num(o.published_step_s, '.2f'):>8} "
                     f"{_num(o.predicted_step_s, '.2f'):>8} {_num(o.memory_gb, '.1f'):>6}  {verdict}")
    held = [o for o in outcomes if o.run.held_out]
    lines += ["summary (within 15%: 0.85 <= predicted / published MFU <= 1.15):",
              _summary_line("all", summarize(outcomes)), _summary_line("held-out", summarize(held))]
    return "\n".join(lines)


def band(outcomes: Sequence[Outcome]) -> Dict[str, Any]:
    """How far the planner's MFU was from the published one: the range of (predicted / published - 1)
    over the predicted runs, the share of all runs within the tolerance, for all and held-out runs
    (``hpctrain.planner.band`` stores it for ``hpctrain-plan`` to print)."""
    def part(rows: Sequence[Outcome]) -> Dict[str, Any]:
        s = summarize(rows)
        errors = [o.ratio - 1.0 for o in rows if o.ratio is not None]
        return {"runs": s["runs"], "predicted": s["predicted"], "within": s["within"],
                "within_fraction_of_runs": round(s["within_fraction_of_runs"], 4),
                "median_ratio": None if s["median_ratio"] is None else round(s["median_ratio"], 4),
                "min_error": round(min(errors), 4) if errors else None,
                "max_error": round(max(errors), 4) if errors else None}
    return {"command": "hpctrain-plan --validate --write-band", "tolerance": TOLERANCE,
            "all": part(outcomes), "held_out": part([o for o in outcomes if o.run.held_out])}


def as_json(outcomes: Sequence[Outcome], table: str) -> Dict[str, Any]:
    held = [o for o in outcomes if o.run.held_out]
    return {"table": table, "tolerance": TOLERANCE, "runs": [o.as_dict() for o in outcomes],
            "summary": {"all": summarize(outcomes), "held_out": summarize(held)}, "band": band(outcomes)}


def run_validation(path: Optional[str], overrides: Sequence[str], make_manager: Callable[[], Any]
                   ) -> Tuple[List[Outcome], str]:
    """(outcomes, the table as shown) for ``hpctrain-plan --validate [TABLE]``. The table is read and
    checked before the plugins load, so a malformed one fails fast with one line."""
    if overrides:
        raise ConfigError(f"--validate takes no overrides (each published run names its model, cluster and "
                          f"layout); got {' '.join(overrides)}")
    runs = load_runs(path)
    shown = path or f"{DEFAULT_TABLE.parent.parent.name}/{DEFAULT_TABLE.parent.name}/{DEFAULT_TABLE.name}"
    return validate_all(runs, make_manager()), shown
