"""The report's HTML: one page per run or per sweep, every section with an id the test looks for."""
from __future__ import annotations

import base64
import html
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

from hpctrain.report.data import Run
from hpctrain.report.svg import bar_chart, line_chart

RUN_SECTIONS = ("summary", "curves", "layout", "memory", "comm", "health", "pipeline")
SWEEP_SECTIONS = ("points", "loss-curves", "final-loss")

STYLE = """body{font-family:sans-serif;margin:24px;max-width:1200px;color:#222}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}
th{background:#f4f4f4}td.l,th.l{text-align:left}.charts{display:flex;flex-wrap:wrap;gap:12px}
.note{color:#555;font-size:13px}.empty{color:#777;font-style:italic}img{max-width:100%}"""


def _page(title: str, body: List[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>" + "".join(body) + "</body></html>\n")


def _section(sid: str, title: str, content: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2>{content}</section>'


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        return f'<{tag}{" class=l" if i < left else ""}>{html.escape(str(v))}</{tag}>'

    return ("<table><tr>" + "".join(cell("th", i, h) for i, h in enumerate(head)) + "</tr>"
            + "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
            + "</table>")


def _num(v: Optional[float], unit: str = "", digits: int = 4) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}g}{unit}"


def _bytes(v: Optional[float]) -> str:
    if v is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v:.0f} B"


def _mean_after_first(run: Run, key: str) -> Optional[float]:
    vals = [v for _, v in run.series(key)]
    vals = vals[1:] or vals  # the first step also warms up
    return statistics.fmean(vals) if vals else None


def _kwh(joules: float) -> str:
    return f"{_num(joules / 3.6e6)} kWh ({_num(joules / 1e3)} kJ)"


def usage_rows(run: Run) -> List[tuple]:
    """The newest ``usage.*`` figures (``hpctrain.train.usage``): hours used and projected, energy."""
    m = next((r for r in reversed(run.metrics) if "usage.rank_hours" in r), None)
    if m is None:
        return []
    cfg = run.config
    unit = "GPU-hours" if "usage.gpu_hours" in m else "rank-hours"
    rows = [(f"{unit} used (ranks x {_num(m['usage.wall_s'])} s wall)", _num(m["usage.rank_hours"])),
            ("CPU-hours used (measured)", _num(m["usage.cpu_hours"]))]
    energy = m.get("usage.energy_j")
    if energy is not None:
        sources = [n for n, k in (("RAPL", "usage.energy_rapl_j"), ("NVML", "usage.energy_nvml_j")) if k in m]
        rows.append((f"energy used ({', '.join(sources)})", _kwh(energy)))
    else:
        rows.append(("energy used", "- (no RAPL or NVML counter readable where it ran)"))
    for prefix, what in (("projected", f"trainer.steps={cfg.trainer.steps if cfg is not None else '?'}"),
                         ("target", f"report.target_tokens={cfg.report.target_tokens if cfg is not None else '?'} "
                                    f"({int(m.get('usage.target_steps', 0))} steps)")):
        if f"usage.{prefix}_rank_hours" not in m:
            continue
        rows.append((f"{unit} for {what}", _num(m[f"usage.{prefix}_rank_hours"])))
        rows.append((f"CPU-hours for {what}", _num(m[f"usage.{prefix}_cpu_hours"])))
        if f"usage.{prefix}_energy_j" in m:
            rows.append((f"energy for {what}", _kwh(m[f"usage.{prefix}_energy_j"])))
    return rows


def data_rows(run: Run) -> List[tuple]:
    """Data staging (``data.stage.dir``: the first step's metrics) and the wait for data per step."""
    rows = []
    staged = next((r for r in run.metrics if "data_stage_s" in r), None)
    if staged is not None:
        rows.append(("data staged to node-local disk", f"{_num(staged['data_stage_s'])} s, "
                     f"{_bytes(staged['data_stage_copied_bytes'])} copied of {_bytes(staged['data_stage_bytes'])}"))
    wait = _mean_after_first(run, "data_wait_s")
    if wait is not None:
        rows.append(("data wait per step (mean after step 1)", _num(wait, " s")))
    return rows


def summary(run: Run) -> str:
    lay, last, cfg = run.layout, run.last, run.config
    rows = [("model", cfg.model.name if cfg is not None else "-"),
            ("parameters", f"{lay['parameters']:,}" if "parameters" in lay else "-"),
            ("layout", " x ".join(f"{a} {n}" for a, n in lay.get("sizes", {}).items()) or "-"),
            ("ranks (devices)", lay.get("world_size", "-")), ("device", lay.get("device", "-")),
            ("steps", last.get("step", 0)), ("final loss", _num(last.get("loss"))),
            ("final validation loss", _num(next((r["val_loss"] for r in reversed(run.metrics) if "val_loss" in r),
                                                None))),
            ("tokens/s per device (mean after step 1)", _num(_mean_after_first(run, "tokens_per_s_per_device"))),
            ("tokens/s global", _num(_mean_after_first(run, "tokens_per_s"))),
            ("model TFLOP/s per device", _num(_mean_after_first(run, "model_tflops_per_device"))),
            ("MFU", _num(100 * m, "%", 3) if (m := _mean_after_first(run, "mfu")) is not None else
             "- (set cluster.peak_tflops)")]
    rows += usage_rows(run) + data_rows(run)
    rows += [("note", note) for note in run.notes]  # e.g. an incomplete last line of metrics.jsonl, skipped
    return _section("summary", "Summary", _table(("", "value"), rows))


def curves(run: Run) -> str:
    charts = [line_chart({"loss": run.series("loss"), "validation loss": run.series("val_loss")},
                         "Loss", "step", "loss"),
              line_chart({"lr": run.series("lr")}, "Learning rate", "step", "lr"),
              line_chart({"grad_norm": run.series("grad_norm")}, "Gradient norm", "step", "norm"),
              line_chart({"per device": run.series("tokens_per_s_per_device")}, "Throughput", "step",
                         "tokens/s per device"),
              line_chart({"MFU %": [(s, 100 * v) for s, v in run.series("mfu")]}, "MFU", "step", "%")
              if run.series("mfu") else
              line_chart({"model TFLOP/s": run.series("model_tflops_per_device")}, "Model TFLOP/s per device "
                         "(no cluster.peak_tflops: no MFU)", "step", "TFLOP/s")]
    return _section("curves", "Curves", '<div class="charts">' + "".join(charts) + "</div>")


def layout(run: Run) -> str:
    lay = run.layout
    if not lay:
        return _section("layout", "Layout", '<p class="empty">no layout.json in the run directory</p>')
    rows = [(a, n, "; ".join(" ".join(map(str, g)) for g in lay.get("groups", {}).get(a, [])) or "-")
            for a, n in lay["sizes"].items()]
    return _section("layout", "Layout and its groups",
                    f'<p class="note">{lay["world_size"]} ranks, rank order {html.escape(lay["order"])} '
                    "(the first axis varies fastest)</p>" + _table(("axis", "size", "groups (world ranks)"), rows, 1))


def memory(run: Run) -> str:
    if not run.peaks:
        return _section("memory", "Peak memory per rank", '<p class="empty">no memory_per_rank.json</p>')
    charts, rows = [], []
    for name, values in run.peaks.items():
        labels = [str(r) for r in range(len(values))]
        charts.append(bar_chart(labels, [v / 2**20 for v in values], name, "MiB"))
        top = max(range(len(values)), key=lambda r: values[r])
        rows.append((name, _bytes(min(values)), _bytes(values[top]), top))
    return _section("memory", "Peak memory per rank", _table(("", "min", "max", "rank of the max"), rows)
                    + '<div class="charts">' + "".join(charts) + "</div>")


def _measured_bytes(run: Run) -> Dict[str, float]:
    """Bytes per step per group of rank 0's communicators (mean after step 1)."""
    keys = sorted({k for r in run.metrics for k in r if k.startswith("comm_bytes.")})
    out = {}
    for k in keys:
        m = _mean_after_first(run, k)
        if m is not None:
            out[k.split(".", 1)[1]] = m
    return out


def _axis_of(group: str) -> str:
    """The planner axis a group's bytes belong to: its name, or dp for the data axes' groups."""
    first = group.split(":", 1)[0]
    return "dp" if "dp" in first.split("-") else first


def comm(run: Run, predicted: Optional[Dict[str, float]], why_not: str = "") -> str:
    measured = _measured_bytes(run)
    by_axis: Dict[str, float] = {}
    for group, v in measured.items():
        by_axis[_axis_of(group)] = by_axis.get(_axis_of(group), 0.0) + v
    axes = [a for a in ("tp", "cp", "ep", "dp", "pp") if (predicted or {}).get(a) or by_axis.get(a)]
    rows = []
    for a in axes:
        p, m = (predicted or {}).get(a), by_axis.get(a)
        rows.append((a, ", ".join(g for g in measured if _axis_of(g) == a) or "-", _bytes(p), _bytes(m),
                     f"{m / p:.2f}" if p and m is not None else "-"))
    note = ('<p class="note">Bus bytes per step (nccl-tests convention): measured by rank 0\'s communicators '
            "(mean after step 1), predicted per GPU by the planner for this config (hpctrain.planner.estimate).</p>")
    if predicted is None:
        note += f'<p class="empty">no prediction: {html.escape(why_not)}</p>'
    chart = bar_chart(axes, [(predicted or {}).get(a, 0.0) / 2**20 for a in axes], "Bytes per step by axis", "MiB",
                      second=[by_axis.get(a, 0.0) / 2**20 for a in axes], names=("predicted", "measured")) \
        if axes else '<p class="empty">no communication (one rank)</p>'
    return _section("comm", "Bytes per axis: measured and predicted",
                    note + _table(("axis", "groups", "predicted", "measured", "measured / predicted"), rows) + chart)


def health(run: Run) -> str:
    strag = [(r["step"], int(r["straggler.slowest_rank"]), _num(r["straggler.slowest_compute_s"], " s"),
              _num(r["straggler.median_compute_s"], " s"), _num(r["straggler.max_step_s"], " s"))
             for r in run.metrics if "straggler.slowest_rank" in r]
    skipped = [r["step"] for r in run.metrics if r.get("loss") is None]
    total_skipped = max((int(r.get("skipped_steps", 0)) for r in run.metrics), default=0)
    spikes = [(r["step"], _num(r.get("loss"))) for r in run.metrics if r.get("loss_spike")]
    parts = ["<h3>Stragglers</h3>",
             _table(("step", "slowest rank", "its compute", "others' median", "slowest step"), strag)
             if strag else '<p class="empty">no straggler check in this run (reliability.straggler_every)</p>',
             "<h3>Skipped steps</h3>",
             f"<p>{total_skipped} update(s) skipped" + (f" (non-finite loss at steps {skipped})" if skipped else "")
             + "</p>", "<h3>Loss spikes</h3>",
             _table(("step", "loss"), spikes) if spikes else '<p class="empty">none</p>']
    return _section("health", "Stragglers, skipped steps and spikes", "".join(parts))


def pipeline(run: Run) -> str:
    if run.timeline_png is None:
        return _section("pipeline", "Pipeline timeline", '<p class="empty">no pipeline in this run</p>')
    data = base64.b64encode(run.timeline_png).decode()
    return _section("pipeline", "Pipeline timeline",
                    f'<img alt="pipeline timeline, measured above theory" src="data:image/png;base64,{data}">')


def run_page(run: Run, predicted: Optional[Dict[str, float]], why_not: str = "") -> str:
    body = [summary(run), curves(run), layout(run), memory(run), comm(run, predicted, why_not), health(run),
            pipeline(run)]
    return _page(f"hpctrain run {run.path}", body)


def _swept(points: List[Run]) -> List[str]:
    """Keys whose override differs between points."""
    values: Dict[str, set] = {}
    for p in points:
        for o in p.overrides:
            k, _, v = o.partition("=")
            values.setdefault(k, set()).add(v)
    return [k for k, vs in values.items() if len(vs) > 1 or any(k not in dict(
        o.partition("=")[::2] for o in p.overrides) for p in points)]


def _value(p: Run, key: str) -> str:
    return next((o.partition("=")[2] for o in p.overrides if o.partition("=")[0] == key), "-")


def sweep_page(sweep_dir: str, points: List[Run]) -> str:
    keys = _swept(points)
    rows = [(os.path.basename(p.path), *(_value(p, k) for k in keys), _num(p.last.get("loss")),
             _num(next((r["val_loss"] for r in reversed(p.metrics) if "val_loss" in r), None)),
             _num(_mean_after_first(p, "tokens_per_s_per_device")),
             _num(100 * m, "%", 3) if (m := _mean_after_first(p, "mfu")) is not None else "-")
            for p in points]
    table = _table(("point", *keys, "final loss", "final val_loss", "tokens/s per device", "MFU"), rows)
    curves = line_chart({f"{os.path.basename(p.path)} " + " ".join(f"{k}={_value(p, k)}" for k in keys):
                         p.series("loss") for p in points}, "Loss of every point", "step", "loss")
    finals = []
    for k in keys:
        try:
            pts = [(float(_value(p, k)), float(p.last["loss"])) for p in points]
            finals.append(line_chart({k: sorted(pts)}, f"Final loss against {k}", k, "final loss", markers=True))
        except (ValueError, KeyError, TypeError):  # a key swept over names: one bar per value
            finals.append(bar_chart([_value(p, k) for p in points], [float(p.last.get("loss") or 0) for p in points],
                                    f"Final loss against {k}", "final loss"))
    body = [_section("points", "Points", f'<p class="note">{len(points)} points; each has its own page '
                     "(hpctrain-report on its directory)</p>" + table),
            _section("loss-curves", "Loss curves side by side", curves),
            _section("final-loss", "Final loss against each swept key",
                     '<div class="charts">' + "".join(finals) + "</div>" if finals else
                     '<p class="empty">no key differs between the points</p>')]
    return _page(f"hpctrain sweep {sweep_dir}", body)
