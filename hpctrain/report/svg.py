"""Inline SVG charts: line charts (one or several series) and bar charts, no library, no script."""
from __future__ import annotations

import html
import math
from typing import Dict, List, Optional, Sequence, Tuple

W, H = 560, 300
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 30, 45
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _ticks(lo: float, hi: float, n: int = 5) -> List[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10) if m * mag >= raw), default=raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _frame(title: str, xlabel: str, ylabel: str, xlo: float, xhi: float, ylo: float, yhi: float):
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - xlo) / (xhi - xlo or 1) * pw

    def sy(y: float) -> float:
        return TOP + ph - (y - ylo) / (yhi - ylo or 1) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">',
           f"<title>{html.escape(title)}</title>",
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">{html.escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for t in _ticks(ylo, yhi):
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 5}" y="{sy(t) + 4:.1f}" text-anchor="end" font-size="11">{_fmt(t)}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 8}" text-anchor="middle" font-size="12">{html.escape(xlabel)}</text>'
               f'<text x="14" y="{TOP + ph / 2}" text-anchor="middle" font-size="12" '
               f'transform="rotate(-90 14 {TOP + ph / 2})">{html.escape(ylabel)}</text>')
    return out, sx, sy


def line_chart(series: Dict[str, Sequence[Tuple[float, float]]], title: str, xlabel: str, ylabel: str,
               markers: bool = False) -> str:
    """One polyline per series (points with markers when ``markers`` or a series has one point)."""
    pts = [p for s in series.values() for p in s if math.isfinite(p[1])]
    if not pts:
        return f'<p class="empty">{html.escape(title)}: no values</p>'
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    ylo, yhi = min(ys), max(ys)
    pad = (yhi - ylo) * 0.05 or abs(yhi) * 0.05 or 1.0
    out, sx, sy = _frame(title, xlabel, ylabel, min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1,
                         ylo - pad, yhi + pad)
    for t in _ticks(min(xs), max(xs)):
        out.append(f'<text x="{sx(t):.1f}" y="{H - BOTTOM + 15}" text-anchor="middle" font-size="11">{_fmt(t)}</text>')
    for i, (name, s) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        good = [(x, y) for x, y in s if math.isfinite(y)]
        if len(good) > 1 and not markers:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
        else:
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{colour}"/>' for x, y in good]
        if len(series) > 1:
            out.append(f'<text x="{LEFT + 8}" y="{TOP + 14 + 14 * i}" font-size="11" fill="{colour}">'
                       f"{html.escape(name)}</text>")
    out.append("</svg>")
    return "".join(out)


def bar_chart(labels: Sequence[str], values: Sequence[float], title: str, ylabel: str,
              second: Optional[Sequence[float]] = None, names: Tuple[str, str] = ("", "")) -> str:
    """Bars per label (a second, paired series beside the first when given)."""
    allv = list(values) + list(second or [])
    if not allv:
        return f'<p class="empty">{html.escape(title)}: no values</p>'
    out, _, sy = _frame(title, "", ylabel, 0, 1, 0, max(allv) * 1.1 or 1.0)
    pw = W - LEFT - RIGHT
    slot = pw / len(labels)
    width = slot * (0.35 if second is not None else 0.7)
    for i, label in enumerate(labels):
        x0 = LEFT + i * slot + slot * 0.15
        for j, vals in enumerate([values] + ([second] if second is not None else [])):
            v = vals[i]
            out.append(f'<rect x="{x0 + j * width:.1f}" y="{sy(v):.1f}" width="{width:.1f}" '
                       f'height="{max(0.0, sy(0) - sy(v)):.1f}" fill="{COLOURS[j]}"><title>{html.escape(label)}: '
                       f"{_fmt(v)}</title></rect>")
        out.append(f'<text x="{LEFT + (i + 0.5) * slot:.1f}" y="{H - BOTTOM + 15}" text-anchor="middle" '
                   f'font-size="11">{html.escape(label)}</text>')
    if second is not None:
        for j, name in enumerate(names):
            out.append(f'<text x="{LEFT + 8}" y="{TOP + 14 + 14 * j}" font-size="11" fill="{COLOURS[j]}">'
                       f"{html.escape(name)}</text>")
    out.append("</svg>")
    return "".join(out)
