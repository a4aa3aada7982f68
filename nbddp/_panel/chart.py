"""The panel's charts: rank-averaged metric curves as inline SVG, from pure functions.

Related metrics share a chart (``loss``, ``train_loss``, ``eval_loss``, ``val/loss``,
``loss_epoch`` all go in "loss"): a name's group is what is left once common
train/eval/val/validation/test prefixes and suffixes (and ``epoch``/``step`` suffixes)
are stripped. Each chart has a step axis and a value axis with round ticks (1-2-5
steps, labels like ``1k``, ``0.01``, ``2e-4``), a logarithmic value axis where every
value is positive and they span more than two decades (tagged "log scale"), and a legend with
each series' latest value and its best: the minimum for losses and errors, the maximum
for accuracies and scores. Neutral names (learning rate, grad norm, epoch, ...) show
their latest value only: a best learning rate means nothing. Values that are not finite
(nan, inf) are left out of the line, marked by a tick at the top of the plot and counted
in the legend; a series whose latest value is nan says so.

Plain SVG keeps the panel one ipywidgets HTML that JupyterLab, VS Code and Colab all
render, with no JavaScript bundle and no plotting dependency. Text and axes are drawn in
``currentColor``, so a dark theme shows them too.
"""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Points = Sequence[tuple[int, float]]

PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#999999",
           "#F0E442")
"""Okabe-Ito's colour-blind-safe colours, the series of one chart in turn."""
LOG_RATIO = 100.0
"""A value axis is logarithmic when its largest value is over this times its smallest."""
WIDTH, PLOT_HEIGHT, ROW = 380, 130, 15
_TOP = 28  # the title's band above the plot

_ROLES = "train|training|eval|evaluation|val|valid|validation|test"
_PREFIX = re.compile(rf"^(?:{_ROLES})[_/.\-]+(?=.)", re.IGNORECASE)
_SUFFIX = re.compile(rf"(?<=.)[_/.\-]+(?:{_ROLES}|epoch|step)$", re.IGNORECASE)
_LOWER_WORDS, _LOWER_TOKENS = ("loss", "error", "perplexity"), {
    "ppl", "wer", "cer", "mse", "mae", "rmse", "nll", "err"}
_HIGHER_WORDS, _HIGHER_TOKENS = ("accuracy", "precision", "recall", "bleu", "score", "rouge"), {
    "acc", "f1", "auc", "auroc", "iou", "miou", "map", "dice", "top1", "top5"}


# --- names ---------------------------------------------------------------------------


def group_name(metric: str) -> str:
    """The chart a metric goes in: ``eval_loss``, ``train/loss``, ``loss_epoch`` -> ``loss``."""
    name = metric
    while True:
        stripped = _SUFFIX.sub("", _PREFIX.sub("", name))
        if stripped == name:
            return name
        name = stripped


def group_metrics(names: Iterable[str]) -> dict[str, list[str]]:
    """Metric names by chart, charts and metrics in order of first appearance. Names that
    differ only in case share a chart, titled as first seen."""
    titles: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for name in names:
        key = group_name(name)
        title = titles.setdefault(key.lower(), key)
        groups.setdefault(title, []).append(name)
    return groups


def direction(metric: str) -> str | None:
    """``"min"`` when lower is better (loss, error, perplexity, wer, mse, ...), ``"max"``
    when higher is (acc, accuracy, f1, bleu, precision, recall, auc, score, ...), else
    None (learning rate, grad norm, epoch, throughput: no best)."""
    name = metric.lower()
    tokens = set(re.split(r"[^a-z0-9]+", name))
    if any(w in name for w in _LOWER_WORDS) or tokens & _LOWER_TOKENS:
        return "min"
    if any(w in name for w in _HIGHER_WORDS) or tokens & _HIGHER_TOKENS:
        return "max"
    return None


def best(metric: str, points: Points) -> tuple[int, float] | None:
    """The (step, value) of the best finite value, if ``metric`` has a direction."""
    way = direction(metric)
    finite = [p for p in points if math.isfinite(p[1])]
    if way is None or not finite:
        return None
    return (min if way == "min" else max)(finite, key=lambda p: p[1])


# --- numbers -------------------------------------------------------------------------


def compact(value: float, digits: int = 3) -> str:
    """A short label: ``0``, ``0.525``, ``1.5k``, ``2M``, ``2e-4``, ``nan``."""
    if not math.isfinite(value):
        return str(value)
    value = float(f"{value:.{digits}g}")  # rounded first: 999.96 is 1k, not 1e+03
    size = abs(value)
    if size == 0:
        return "0"
    if size < 1e-3 or size >= 1e15:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if size >= scale:
            return f"{value / scale:.{digits}g}{suffix}"
    return f"{value:.{digits}g}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Compact labels with as many digits as it takes to tell the ticks apart."""
    for digits in range(3, 16):
        labels = [compact(t, digits) for t in ticks]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round ticks (1, 2 or 5 times a power of ten apart), about ``count`` intervals,
    the first at or below ``lo`` and the last at or above ``hi``."""
    if not lo < hi:
        raise ValueError(f"empty range {lo}..{hi}")
    raw = (hi - lo) / count
    exponent = math.floor(math.log10(raw))
    norm = raw / 10.0 ** exponent
    factor = 10 if norm >= 7.07 else 5 if norm >= 3.16 else 2 if norm >= 1.41 else 1
    step = factor * 10.0 ** exponent
    if integer and step < 1:
        step, exponent = 1.0, 0
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, max(0, -exponent)) for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten from at or below ``lo`` to at or above ``hi`` (both positive), at
    most about six of them."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    b = max(b, a + 1)
    stride = max(1, math.ceil((b - a) / 5))
    exponents = list(range(a, b + 1, stride))
    if exponents[-1] < b:
        exponents.append(exponents[-1] + stride)
    return [10.0 ** e for e in exponents]


def use_log(values: Sequence[float]) -> bool:
    """Log scale: every value positive, spanning more than ``LOG_RATIO`` (losses)."""
    return bool(values) and min(values) > 0 and max(values) > LOG_RATIO * min(values)


def value_ticks(values: Sequence[float]) -> tuple[list[float], bool]:
    """The value axis for these finite values: ticks covering them, and whether log."""
    if not values:
        return [0.0, 1.0], False
    if use_log(values):
        return log_ticks(min(values), max(values)), True
    lo, hi = min(values), max(values)
    if lo == hi:  # a constant: the line in the middle
        pad = abs(lo) / 2 or 1.0
        lo, hi = lo - pad, hi + pad
    return nice_ticks(lo, hi, 4), False


def step_range(steps: Sequence[int]) -> tuple[float, float, list[float]]:
    """The step axis: its range (the steps', half a step either side of a lone one) and
    the whole-step round ticks inside it."""
    lo, hi = float(min(steps)), float(max(steps))
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi, [t for t in nice_ticks(lo, hi, 5, integer=True) if lo <= t <= hi]


# --- SVG -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plot:
    """The plot area in pixels and the scales onto it."""

    left: float
    right: float
    top: float
    bottom: float
    steps: tuple[float, float]
    values: tuple[float, float]
    log: bool

    def x(self, step: float) -> float:
        lo, hi = self.steps
        return self.left + (step - lo) / (hi - lo) * (self.right - self.left)

    def y(self, value: float) -> float:
        lo, hi = self.values
        if self.log:
            value, lo, hi = math.log10(value), math.log10(lo), math.log10(hi)
        return self.bottom - (value - lo) / (hi - lo) * (self.bottom - self.top)

    def pixels(self, points: Points) -> Iterable[tuple[float, float]]:
        """``x`` and ``y`` of many points, with the scales worked out once."""
        (x0, x1), (y0, y1) = self.steps, self.values
        log = math.log10 if self.log else float
        y0, y1 = log(y0), log(y1)
        sx = (self.right - self.left) / (x1 - x0)
        sy = (self.bottom - self.top) / (y1 - y0)
        return ((self.left + (s - x0) * sx, self.bottom - (log(v) - y0) * sy)
                for s, v in points)


def _text(x: float, y: float, text: str, anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>'
            f"{html.escape(text)}</text>")


def _axes(plot: _Plot, y_ticks: Sequence[float], x_ticks: Sequence[float]) -> list[str]:
    """Grid lines, tick labels and the axis lines, in the text colour."""
    grid = '<path stroke="currentColor" stroke-opacity="0.12" fill="none" d="'
    lines = [f"M{plot.left:.1f},{plot.y(t):.1f}H{plot.right:.1f}" for t in y_ticks]
    lines += [f"M{plot.x(t):.1f},{plot.top:.1f}V{plot.bottom:.1f}" for t in x_ticks]
    parts = [grid + "".join(lines) + '"/>']
    parts += [_text(plot.left - 4, plot.y(t) + 4, label, "end")
              for t, label in zip(y_ticks, tick_labels(y_ticks), strict=True)]
    parts += [_text(plot.x(t), plot.bottom + 14, label, "middle")
              for t, label in zip(x_ticks, tick_labels(x_ticks), strict=True)]
    parts.append(_text(plot.right, plot.bottom + 27, "step", "end", ' fill-opacity="0.6"'))
    parts.append(f'<path class="nbddp-axes" stroke="currentColor" stroke-opacity="0.5" '
                 f'fill="none" d="M{plot.left:.1f},{plot.top:.1f}V{plot.bottom:.1f}'
                 f'H{plot.right:.1f}"/>')
    return parts


def _series(plot: _Plot, name: str, points: Points, color: str) -> list[str]:
    """One metric's line, a dot on its latest finite value, ticks where it is not finite."""
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    label = html.escape(name)
    parts = []
    if finite:
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in plot.pixels(finite))
        parts.append(f'<polyline data-metric="{label}" fill="none" stroke="{color}" '
                     f'stroke-width="1.5" stroke-linejoin="round" points="{coords}">'
                     f"<title>{label}</title></polyline>")
        s, v = finite[-1]
        parts.append(f'<circle cx="{plot.x(s):.1f}" cy="{plot.y(v):.1f}" r="2.5" '
                     f'fill="{color}"/>')
    for s, v in points:
        if not math.isfinite(v):
            parts.append(f'<path class="nbddp-nonfinite" stroke="{color}" stroke-width="2" '
                         f'd="M{plot.x(s):.1f},{plot.top:.1f}v6"><title>{label}: {v} at step '
                         f"{s}</title></path>")
    return parts


def _legend(name: str, points: Points, color: str, x: float, y: float) -> list[str]:
    """``— eval_loss 0.412 min 0.398 @ 1200 3 nan/inf``: name, latest, best, bad values."""
    shown = name if len(name) <= 32 else name[:31] + "\u2026"
    words = [compact(points[-1][1], 4)] if points else []
    top = best(name, points)
    if top is not None:
        words.append(f"{direction(name)} {compact(top[1], 4)} @ {top[0]}")
    bad = sum(not math.isfinite(v) for _, v in points)
    if bad:
        words.append(f"{bad} nan/inf")
    latest = f" {html.escape(words[0])}" if words else ""
    extra = (f'<tspan fill-opacity="0.65"> {html.escape(" ".join(words[1:]))}</tspan>'
             if words[1:] else "")
    return [f'<path stroke="{color}" stroke-width="2.5" d="M{x:.1f},{y - 4:.1f}h14"/>',
            f'<text x="{x + 19:.1f}" y="{y:.1f}"><tspan font-weight="bold">'
            f"{html.escape(shown)}</tspan>{latest}{extra}</text>"]


def chart_svg(title: str, series: Mapping[str, Points], width: int = WIDTH) -> str:
    """One chart of the metrics in ``series`` (name -> (step, value) points), as SVG."""
    steps = [s for points in series.values() for s, _ in points]
    if not steps:
        return ""
    values = [v for points in series.values() for _, v in points if math.isfinite(v)]
    y_ticks, log = value_ticks(values)
    x_lo, x_hi, x_ticks = step_range(steps)
    left = 12 + 6.5 * max(len(label) for label in tick_labels(y_ticks))
    plot = _Plot(left, width - 14, _TOP, _TOP + PLOT_HEIGHT, (x_lo, x_hi),
                 (y_ticks[0], y_ticks[-1]), log)
    height = plot.bottom + 36 + ROW * len(series)
    names = " ".join(series)
    parts = [f'<svg class="nbddp-chart" xmlns="http://www.w3.org/2000/svg" '
             f'data-chart="{html.escape(title)}" data-metrics="{html.escape(names)}" '
             f'data-scale="{"log" if log else "linear"}" width="{width}" height="{height:.0f}" '
             f'role="img" aria-label="{html.escape(f"{title}: {names} over steps")}" '
             'font-family="sans-serif" font-size="11" fill="currentColor" '
             'style="margin:4px;border:1px solid rgba(128,128,128,0.35);border-radius:3px">',
             _text(8, 18, title if len(title) <= 40 else title[:39] + "\u2026",
                   extra=' font-size="13" font-weight="bold"')]
    if log:
        parts.append(_text(width - 14, 18, "log scale", "end",
                           ' class="nbddp-scale" fill-opacity="0.6"'))
    parts += _axes(plot, y_ticks, x_ticks)
    colors = dict(zip(series, itertools.cycle(PALETTE)))
    for name, points in series.items():
        parts += _series(plot, name, points, colors[name])
    for row, (name, points) in enumerate(series.items()):
        parts += _legend(name, points, colors[name], 8, plot.bottom + 44 + ROW * row)
    return "".join(parts) + "</svg>"


def charts_html(series: Mapping[str, Points]) -> str:
    """Every chart, related metrics together, wrapping across the panel's width."""
    charts = [chart_svg(title, {name: series[name] for name in names})
              for title, names in group_metrics(series).items()]
    charts = [c for c in charts if c]
    if not charts:
        return ""
    return ('<div class="nbddp-charts" style="display:flex;flex-wrap:wrap;'
            'align-items:flex-start">' + "".join(charts) + "</div>")
