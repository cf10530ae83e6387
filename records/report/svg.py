"""Small inline-SVG charts for the run report: no JavaScript, no external resource, text escaped.

Invariants: every function returns one ``<svg>`` element as well-formed XML text (the page is polyglot
HTML, so a test can parse it as XML); no element refers to anything outside the page (no ``href``,
``src``, ``url(``); hovering a mark shows its exact value through an SVG ``<title>``; empty data gives
an empty chart with a "no data" note, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH = 640
"""Width of a chart, in SVG user units (the page scales them to its column)."""

WIDE = 1290
"""Width of a chart that spans the page (time series)."""

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
"""Categorical colours, in order of use."""

OUTCOME_COLORS = {"completed": "#59a14f", "truncated": "#edc948", "failed": "#e15759", "cancelled": "#9c9c9c"}
"""One colour per rollout outcome, the same in every chart."""

_FONT = 'font-family="sans-serif" font-size="11"'


def _t(s: object) -> str:
    return escape(str(s), quote=True)


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") if math.isfinite(v) else "0"


def fmt(v: float) -> str:
    """A tick or value label: short, no scientific notation for the ranges a run produces."""
    v = v + 0.0  # no "-0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e4:
        return f"{v / 1e3:.0f}k"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.1f}"
    return f"{v:.2g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10) + 0.0)
        v += step
    return ticks


@dataclass(frozen=True)
class Scale:
    """A linear map from data values [lo, hi] to pixels [a, b]."""

    lo: float
    hi: float
    a: float
    b: float

    def __call__(self, v: float) -> float:
        span = self.hi - self.lo or 1.0
        return self.a + (v - self.lo) / span * (self.b - self.a)


def _svg(height: int, body: list[str], label: str, width: int = WIDTH) -> str:
    return (
        f'<svg role="img" aria-label="{_t(label)}" viewBox="0 0 {width} {height}" width="{width}"'
        f' height="{height}" {_FONT}>' + "".join(body) + "</svg>"
    )


def empty(label: str, note: str = "no data") -> str:
    return _svg(
        60,
        [f'<text x="{WIDTH // 2}" y="34" text-anchor="middle" fill="#777">{_t(note)}</text>'],
        label,
    )


def _x_axis(sx: Scale, ticks: list[float], y: float, top: float, label: str, tick_fmt=fmt) -> list[str]:
    out = [f'<line x1="{_num(sx.a)}" y1="{_num(y)}" x2="{_num(sx.b)}" y2="{_num(y)}" stroke="#333"/>']
    for v in ticks:
        x = sx(v)
        out.append(f'<line x1="{_num(x)}" y1="{_num(top)}" x2="{_num(x)}" y2="{_num(y)}" stroke="#eee"/>')
        out.append(f'<text x="{_num(x)}" y="{_num(y + 14)}" text-anchor="middle">{_t(tick_fmt(v))}</text>')
    mid = (sx.a + sx.b) / 2
    out.append(
        f'<text x="{_num(mid)}" y="{_num(y + 30)}" text-anchor="middle" fill="#555">{_t(label)}</text>'
    )
    return out


def _y_axis(sy: Scale, ticks: list[float], x: float, right: float, label: str, tick_fmt=fmt) -> list[str]:
    out = [f'<line x1="{_num(x)}" y1="{_num(sy.a)}" x2="{_num(x)}" y2="{_num(sy.b)}" stroke="#333"/>']
    for v in ticks:
        y = sy(v)
        out.append(f'<line x1="{_num(x)}" y1="{_num(y)}" x2="{_num(right)}" y2="{_num(y)}" stroke="#eee"/>')
        out.append(f'<text x="{_num(x - 4)}" y="{_num(y + 4)}" text-anchor="end">{_t(tick_fmt(v))}</text>')
    out.append(
        f'<text transform="translate(12,{_num((sy.a + sy.b) / 2)}) rotate(-90)" text-anchor="middle"'
        f' fill="#555">{_t(label)}</text>'
    )
    return out


def legend(items: Sequence[tuple[str, str]], x: float, y: float) -> list[str]:
    """A one-row legend of (name, colour) swatches starting at (x, y)."""
    out = []
    for name, color in items:
        out.append(f'<rect x="{_num(x)}" y="{_num(y - 9)}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{_num(x + 14)}" y="{_num(y)}">{_t(name)}</text>')
        x += 24 + 6.5 * len(name)
    return out


def stacked_bars(
    rows: Sequence[tuple[str, Sequence[tuple[str, float, str]]]],
    label: str,
    axis: str,
    percent: bool = False,
    show_legend: bool = True,
) -> str:
    """Horizontal stacked bars: per row label, (part name, value, colour) segments."""
    rows = [(r, parts) for r, parts in rows if parts]
    if not rows:
        return empty(label)
    left, right, bar, gap = 190, WIDTH - 20, 22, 10
    top = 30
    height = top + len(rows) * (bar + gap) + 40
    hi = 1.0 if percent else max(sum(v for _, v, _ in parts) for _, parts in rows) or 1.0
    sx = Scale(0.0, hi, left, right)
    body: list[str] = []
    names: dict[str, str] = {}
    y = top
    for name, parts in rows:
        body.append(f'<text x="{left - 6}" y="{_num(y + bar / 2 + 4)}" text-anchor="end">{_t(name)}</text>')
        x0 = 0.0
        for part, v, color in parts:
            names.setdefault(part, color)
            w = sx(x0 + v) - sx(x0)
            value = f"{v:.1%}" if percent else fmt(v)
            body.append(
                f'<rect x="{_num(sx(x0))}" y="{y}" width="{_num(max(w, 0))}" height="{bar}" fill="{color}">'
                f"<title>{_t(f'{name}: {part} {value}')}</title></rect>"
            )
            if w > 34:
                body.append(
                    f'<text x="{_num(sx(x0) + w / 2)}" y="{_num(y + bar / 2 + 4)}" text-anchor="middle"'
                    f' fill="#fff">{_t(value)}</text>'
                )
            x0 += v
        y += bar + gap
    ticks = nice_ticks(0, hi)
    tick_fmt = (lambda v: f"{v:.0%}") if percent else fmt
    body += _x_axis(sx, [t for t in ticks if t <= hi + 1e-9], y, top - 4, axis, tick_fmt)
    if show_legend:
        body += legend(list(names.items()), left, 16)
    return _svg(height + 10, body, label)


def bars(rows: Sequence[tuple[str, float, str]], label: str, axis: str, percent: bool = False) -> str:
    """Horizontal bars, one per (label, value, colour)."""
    return stacked_bars([(name, [(name, v, c)]) for name, v, c in rows], label, axis, percent, False)


def histogram(values: Sequence[float], label: str, axis: str, bins: int = 20, color: str = PALETTE[0]) -> str:
    """Counts of ``values`` in equal-width bins (one bin per distinct value when there are few)."""
    if not values:
        return empty(label)
    lo, hi = min(values), max(values)
    if hi == lo:  # one value: show it in [0, 1] (rewards, spreads) or in a unit range around it
        lo, hi = (0.0, 1.0) if 0.0 <= lo <= 1.0 else (lo - 0.5, hi + 0.5)
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    left, right, top, bottom = 50, WIDTH - 20, 14, 200
    sx, sy = Scale(lo, hi, left, right), Scale(0, max(counts), bottom, top)
    body = _y_axis(sy, nice_ticks(0, max(counts), 4), left, right, "rollouts")
    for i, c in enumerate(counts):
        if not c:
            continue
        a, b = lo + i * width, lo + (i + 1) * width
        body.append(
            f'<rect x="{_num(sx(a) + 1)}" y="{_num(sy(c))}" width="{_num(max(1.0, sx(b) - sx(a) - 2))}"'
            f' height="{_num(bottom - sy(c))}" fill="{color}"><title>{_t(f"{fmt(a)} to {fmt(b)}: {c}")}'
            "</title></rect>"
        )
    body += _x_axis(sx, nice_ticks(lo, hi), bottom, top, axis)
    return _svg(bottom + 40, body, label)


def strips(rows: Sequence[tuple[str, Sequence[float], str]], label: str, axis: str) -> str:
    """One row per (label, values, colour): every value as a dot, with the median and quartiles marked."""
    rows = [r for r in rows if r[1]]
    if not rows:
        return empty(label)
    left, right, top, row_h = 120, WIDTH - 20, 10, 34
    hi = max(max(v) for _, v, _ in rows)
    lo = min(0.0, min(min(v) for _, v, _ in rows))
    sx = Scale(lo, hi or 1.0, left, right)
    body: list[str] = []
    y = top
    for name, vals, color in rows:
        s = sorted(vals)
        q1, med, q3 = (s[int(p * (len(s) - 1))] for p in (0.25, 0.5, 0.75))
        cy = y + row_h / 2
        body.append(
            f'<text x="{left - 6}" y="{_num(cy + 4)}" text-anchor="end">{_t(f"{name} ({len(s)})")}</text>'
        )
        body.append(
            f'<rect x="{_num(sx(q1))}" y="{_num(cy - 9)}" width="{_num(max(1.0, sx(q3) - sx(q1)))}"'
            f' height="18" fill="{color}" fill-opacity="0.25"/>'
        )
        for i, v in enumerate(s):
            jitter = ((i * 7919) % 13 - 6) * 0.9
            body.append(
                f'<circle cx="{_num(sx(v))}" cy="{_num(cy + jitter)}" r="2.5" fill="{color}"'
                ' fill-opacity="0.7">'
                f"<title>{_t(fmt(v))}</title></circle>"
            )
        body.append(
            f'<line x1="{_num(sx(med))}" y1="{_num(cy - 11)}" x2="{_num(sx(med))}" y2="{_num(cy + 11)}"'
            f' stroke="#222" stroke-width="2"><title>{_t(f"median {fmt(med)}")}</title></line>'
        )
        y += row_h
    body += _x_axis(sx, nice_ticks(lo, hi or 1.0), y + 4, top, axis)
    return _svg(int(y) + 44, body, label)


@dataclass(frozen=True)
class Series:
    """One line of a line chart: (x, y) points, drawn as steps or straight segments."""

    name: str
    points: Sequence[tuple[float, float]]
    color: str
    right_axis: bool = False
    """Plot against the right-hand axis (its own scale)."""
    step: bool = True


def lines(
    series: Sequence[Series],
    label: str,
    x_axis: str,
    y_axis: str,
    y2_axis: str | None = None,
    y2_max: float | None = None,
    width: int = WIDTH,
) -> str:
    """A line chart over time (x in seconds from the start), optionally with a second y axis."""
    series = [s for s in series if s.points]
    if not series:
        return empty(label)
    left, right, top, bottom = 56, width - (56 if y2_axis else 20), 26, 230
    xs = [x for s in series for x, _ in s.points]
    sx = Scale(min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1, left, right)
    y1 = [y for s in series if not s.right_axis for _, y in s.points] or [1.0]
    y2 = [y for s in series if s.right_axis for _, y in s.points] or [1.0]
    sy = Scale(0, max(max(y1), 1e-9), bottom, top)
    sy2 = Scale(0, y2_max if y2_max is not None else max(max(y2), 1e-9), bottom, top)
    body = _y_axis(sy, nice_ticks(0, sy.hi, 4), left, right, y_axis)
    if y2_axis:
        body.append(f'<line x1="{right}" y1="{bottom}" x2="{right}" y2="{top}" stroke="#333"/>')
        for v in nice_ticks(0, sy2.hi, 4):
            if v <= sy2.hi + 1e-9:
                tick = f"{v:.0%}" if sy2.hi <= 1 else fmt(v)
                body.append(f'<text x="{right + 4}" y="{_num(sy2(v) + 4)}">{_t(tick)}</text>')
        body.append(
            f'<text transform="translate({width - 8},{_num((top + bottom) / 2)}) rotate(90)"'
            f' text-anchor="middle" fill="#555">{_t(y2_axis)}</text>'
        )
    for s in series:
        scale = sy2 if s.right_axis else sy
        pts: list[str] = []
        prev: tuple[float, float] | None = None
        for x, y in sorted(s.points):
            if s.step and prev is not None:
                pts.append(f"{_num(sx(x))},{_num(scale(prev[1]))}")
            pts.append(f"{_num(sx(x))},{_num(scale(y))}")
            prev = (x, y)
        body.append(
            f'<polyline points="{" ".join(pts)}" fill="none" stroke="{s.color}" stroke-width="2">'
            f"<title>{_t(s.name)}</title></polyline>"
        )
        if len(s.points) == 1:
            x, y = s.points[0]
            body.append(f'<circle cx="{_num(sx(x))}" cy="{_num(scale(y))}" r="3" fill="{s.color}"/>')
    body += _x_axis(sx, nice_ticks(sx.lo, sx.hi), bottom, top, x_axis)
    body += legend(
        [(s.name + (" (right)" if s.right_axis and y2_axis else ""), s.color) for s in series], left, 14
    )
    return _svg(bottom + 40, body, label, width)


@dataclass(frozen=True)
class Span:
    """One bar of a timeline: a rollout from start to end (seconds from the run's start)."""

    start: float
    end: float
    color: str
    title: str


def timeline(
    lanes: Sequence[tuple[str, Sequence[Span]]],
    label: str,
    axis: str,
    keys: Sequence[tuple[str, str]] = (),
    max_rows: int = 120,
    width: int = WIDTH,
) -> str:
    """Spans stacked in rows within one band per lane (a replica); a span takes the first row it fits.
    ``keys``: (name, colour) legend entries."""
    lanes = [(n, s) for n, s in lanes if s]
    if not lanes:
        return empty(label)
    packed: list[tuple[str, list[list[Span]]]] = []
    for name, spans in lanes:
        rows: list[list[Span]] = []
        for sp in sorted(spans, key=lambda s: (s.start, s.end)):
            for row in rows:
                if row[-1].end <= sp.start:
                    row.append(sp)
                    break
            else:
                rows.append([sp])
        packed.append((name, rows[:max_rows]))
    t0 = min(s.start for _, sp in lanes for s in sp)
    t1 = max(s.end for _, sp in lanes for s in sp)
    left, right, top, row_h, band_gap = 150, width - 20, 30 if keys else 10, 7, 12
    sx = Scale(t0, t1 if t1 > t0 else t0 + 1, left, right)
    body: list[str] = []
    y = float(top)
    for name, rows in packed:
        h = len(rows) * row_h
        body.append(
            f'<rect x="{left}" y="{_num(y - 2)}" width="{right - left}" height="{_num(h + 4)}"'
            ' fill="#f6f6f6"/>'
        )
        short = name if len(name) <= 22 else "…" + name[-21:]
        body.append(
            f'<text x="{left - 6}" y="{_num(y + h / 2 + 4)}" text-anchor="end">{_t(short)}'
            f"<title>{_t(name)}</title></text>"
        )
        for i, row in enumerate(rows):
            for sp in row:
                w = max(1.0, sx(sp.end) - sx(sp.start))
                body.append(
                    f'<rect x="{_num(sx(sp.start))}" y="{_num(y + i * row_h)}" width="{_num(w)}"'
                    f' height="{row_h - 1}" fill="{sp.color}"><title>{_t(sp.title)}</title></rect>'
                )
        y += h + band_gap
    body += _x_axis(sx, nice_ticks(sx.lo, sx.hi), y, top, axis)
    body += legend(keys, left, 16)
    return _svg(int(y) + 44, body, label, width)
