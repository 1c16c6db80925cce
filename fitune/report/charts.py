"""SVG charts drawn in Python: stacked horizontal bars against a budget line, plain bars, line charts.

No JS is needed to see them; each mark carries `data-key` + `data-bytes` / `data-value` (see html.py) and a
<title> that the page's script turns into a tooltip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .categories import Category
from .html import esc
from .units import byte_unit, format_bytes, format_value, nice_ticks

HATCH_DEFS = ('<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
              '<pattern id="fitune-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
              'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
              '<rect width="3" height="6" fill="#999"/></pattern></defs></svg>')
"""Put once on a page that uses the hatched fill (the allocator's overhead)."""


def fill(color: str) -> str:
    return "url(#fitune-hatch)" if color == "hatch" else color


@dataclass
class Segment:
    category: Category
    n_bytes: int
    key: str
    doc: str | None = None


@dataclass
class BarRow:
    label: str
    segments: list[Segment]
    total_bytes: int | None
    total_key: str | None = None
    note: str = ""
    """Text after the total (e.g. "reserved")."""
    doc: str | None = None
    row_id: str | None = None


@dataclass
class Marker:
    """A vertical line across the bars: the GPU's budget for PyTorch's allocator."""
    n_bytes: int
    label: str
    key: str


def _byte_axis(max_bytes: float) -> tuple[list[float], str, int, float]:
    """Round ticks in the unit of `max_bytes`: (ticks in bytes, unit, bytes per unit, the axis' end in bytes)."""
    unit, size = byte_unit(max_bytes)
    ticks = [t * size for t in nice_ticks(max_bytes / size)]
    return ticks, unit, size, ticks[-1]


def label_width(labels: list[str], least: int = 150, most: int = 560) -> int:
    """Room for the longest label at 13 px (about 7 px a character), within [least, most]."""
    return int(min(most, max(least, 16 + 7.2 * max((len(x) for x in labels), default=0))))


def clip(label: str, width: int) -> str:
    """The label cut to what fits `width` pixels, with an ellipsis (the tooltip has it whole)."""
    room = int((width - 16) / 7.2)
    return label if len(label) <= room else label[:max(room - 1, 1)] + "\u2026"


def stacked_bars(rows: list[BarRow], marker: Marker | None = None, width: int = 1140, label_w: int | None = None,
                 row_h: int = 34, caption: str = "") -> str:
    """Horizontal bars, one per row, each split into categories, on one byte axis, with an optional budget line."""
    label_w = label_w or label_width([r.label for r in rows])
    right_w = 190
    top = 28 if marker else 8
    plot_w = width - label_w - right_w
    biggest = max([r.total_bytes or sum(s.n_bytes for s in r.segments) for r in rows] +
                  [marker.n_bytes if marker else 0] + [1])
    ticks, unit, size, axis_max = _byte_axis(biggest)
    height = top + row_h * len(rows) + 30

    def x(b: float) -> float:
        return label_w + plot_w * b / axis_max

    out = [f'<svg viewBox="0 0 {width} {height}" width="{width}" role="img" aria-label="{esc(caption)}">']
    out += _x_axis(ticks, x, top - 4, height, lambda t: format_value(t / size), unit)
    for i, row in enumerate(rows):
        y = top + i * row_h + 5
        h = row_h - 12
        rid = f' data-row="{esc(row.row_id)}"' if row.row_id else ""
        out.append(f'<g class="bar"{rid}><text x="{label_w - 10}" y="{y + h / 2 + 5:.1f}" text-anchor="end">'
                   f"{esc(clip(row.label, label_w))}<title>{esc(row.label)}</title></text>")
        pos = 0
        for s in row.segments:
            if s.n_bytes <= 0:
                continue
            w = plot_w * s.n_bytes / axis_max
            doc = f' data-doc="{esc(s.doc)}"' if s.doc else ""
            tip = (f"{row.label}: {s.category.label} {format_bytes(s.n_bytes)} ({s.n_bytes:,} bytes)\n"
                   f"{s.category.what}")
            out.append(f'<rect x="{x(pos):.2f}" y="{y}" width="{max(w, 0.5):.2f}" height="{h}" '
                       f'fill="{fill(s.category.color)}" data-key="{esc(s.key)}" data-bytes="{int(s.n_bytes)}"'
                       f'{doc} data-category="{esc(s.category.key)}"><title>{esc(tip)}</title></rect>')
            pos += s.n_bytes
        if row.total_bytes is not None:
            doc = f' data-doc="{esc(row.doc)}"' if row.doc else ""
            key = f' data-key="{esc(row.total_key)}" data-bytes="{int(row.total_bytes)}"' if row.total_key else ""
            out.append(f'<text x="{x(max(pos, row.total_bytes)) + 8:.1f}" y="{y + h / 2 + 5:.1f}" class="total"{key}'
                       f'{doc}>{esc(format_bytes(row.total_bytes, biggest))}{esc(" " + row.note if row.note else "")}'
                       "</text>")
        out.append("</g>")
    if marker:
        mx = x(marker.n_bytes)
        tip = f"{marker.label}: {format_bytes(marker.n_bytes)} ({marker.n_bytes:,} bytes)"
        out.append(f'<g class="marker"><line class="budget" x1="{mx:.1f}" x2="{mx:.1f}" y1="{top - 6}" '
                   f'y2="{height - 24}" data-key="{esc(marker.key)}" data-bytes="{int(marker.n_bytes)}">'
                   f"<title>{esc(tip)}</title></line>"
                   f'<text x="{mx:.1f}" y="{top - 10}" text-anchor="middle" style="fill:#a33a00">'
                   f"{esc(marker.label)} {esc(format_bytes(marker.n_bytes))}</text></g>")
    out.append("</svg>")
    return "".join(out)


def legend(categories: list[Category]) -> str:
    items = []
    for c in categories:
        style = "" if c.color == "hatch" else f' style="background:{c.color}"'
        cls = "swatch hatch" if c.color == "hatch" else "swatch"
        items.append(f'<span title="{esc(c.what)}"><span class="{cls}"{style}></span>{esc(c.label)}</span>')
    return f'<div class="legend">{"".join(items)}</div>'


@dataclass
class ValueBar:
    label: str
    value: float
    key: str
    text: str
    color: str = "#0072B2"
    row_id: str | None = None


def value_bars(rows: list[ValueBar], width: int = 1140, label_w: int | None = None, row_h: int = 30, unit: str = "",
               caption: str = "") -> str:
    """Plain horizontal bars (e.g. predicted tokens/s), each labelled with its value."""
    label_w = label_w or label_width([r.label for r in rows])
    right_w = 150
    plot_w = width - label_w - right_w
    ticks = nice_ticks(max([r.value for r in rows] + [1e-12]))
    axis_max = ticks[-1]
    height = 8 + row_h * len(rows) + 30

    def x(v: float) -> float:
        return label_w + plot_w * v / axis_max

    out = [f'<svg viewBox="0 0 {width} {height}" width="{width}" role="img" aria-label="{esc(caption)}">']
    out += _x_axis(ticks, x, 4, height, format_value, unit)
    for i, r in enumerate(rows):
        y = 8 + i * row_h + 4
        h = row_h - 12
        rid = f' data-row="{esc(r.row_id)}"' if r.row_id else ""
        out.append(f'<g class="bar"{rid}><text x="{label_w - 10}" y="{y + h / 2 + 5:.1f}" text-anchor="end">'
                   f'{esc(clip(r.label, label_w))}</text><rect x="{label_w}" y="{y}" width="{max(plot_w * r.value / axis_max, 0.5):.2f}" '
                   f'height="{h}" fill="{r.color}" data-key="{esc(r.key)}" data-value="{esc(repr(r.value))}">'
                   f"<title>{esc(r.label)}: {esc(r.text)}</title></rect>"
                   f'<text x="{x(r.value) + 8:.1f}" y="{y + h / 2 + 5:.1f}">{esc(r.text)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def _stack_tops(stack: list[Series]) -> list[list[tuple[float, float]]]:
    """The top edge of each stacked area: the running sum of the series' values, point for point."""
    tops: list[list[tuple[float, float]]] = []
    for s in stack:
        below = tops[-1] if tops else None
        tops.append([(x, (below[j][1] if below else 0.0) + (y or 0.0)) for j, (x, y, _) in enumerate(s.points)])
    return tops


@dataclass
class Series:
    name: str
    color: str
    points: list[tuple[float, float, str]] = field(default_factory=list)
    """(x, y, data-key) per point."""
    dash: str = ""


MAX_TICKS = 64
"""An axis never gets more ticks (nice_ticks gives 5-7; the bound only stops a loop on numbers like 1e17 + 1,
whose tick step is below the float's precision)."""


def line_chart(series: list[Series], *, title: str, bytes_axis: bool = False, width: int = 560, height: int = 260,
               x_label: str = "step", max_marks: int = 400, bands: list[tuple[float, float, str, str]] = (),
               stack: list[Series] = (), stack_marks: int = 150) -> str:
    """A line chart over steps; every drawn point (at most `max_marks` per series, evenly picked) is a mark with
    its value. `bytes_axis` labels the y axis in the unit of its largest value. `bands`: shaded x ranges
    (x0, x1, label, colour), e.g. the phases of a profiled step. `stack`: filled areas drawn under the lines, one
    on top of the other (e.g. live bytes by category); their series share the same x values, point for point, and
    each keeps at most `stack_marks` marks, placed on its area's top edge and carrying its own value."""
    tops = _stack_tops(stack)
    pts = [(x, y) for s in series for x, y, _ in s.points if y is not None and math.isfinite(y)]
    pts += [(x, y) for x, y in (tops[-1] if tops else [])]
    if not pts:
        return (f'<figure class="chart"><figcaption><b>{esc(title)}</b></figcaption>'
                '<p class="notes">nothing recorded</p></figure>')
    frame, unit, y_ticks = _line_frame(pts, bytes_axis, width, height)
    out = [f'<figure class="chart" data-chart="{esc(title)}"><figcaption><b>{esc(title)}</b>'
           + (f" ({esc(unit)})" if unit else "") + "</figcaption>",
           f'<svg viewBox="0 0 {width} {height}" width="{width}" role="img" aria-label="{esc(title)}">',
           '<g class="axis">']
    out += _line_axes(frame, y_ticks, bands, x_label)
    for i, s in enumerate(stack):
        out += _stack_area(frame, s, tops, i, bytes_axis, x_label, stack_marks)
    for s in series:
        out += _series_line(frame, s, bytes_axis, x_label, max_marks)
    out.append("</svg>")
    out += _line_legends(series, stack)
    out.append("</figure>")
    return "".join(out)


@dataclass(frozen=True)
class _Frame:
    """Where a line chart's plot area lies in its SVG, and the data ranges its axes span."""

    width: int
    height: int
    left: int
    right: int
    top: int
    pw: int
    ph: int
    x_lo: float
    x_hi: float
    y_min: float
    y_max: float
    size: float
    """The y unit's size: values are divided by it (bytes to the axis unit)."""

    def sx(self, v: float) -> float:
        return self.left + self.pw * (v - self.x_lo) / (self.x_hi - self.x_lo)

    def sy(self, v: float) -> float:
        return self.top + self.ph * (1 - (v / self.size - self.y_min) / (self.y_max - self.y_min))


def _line_frame(pts: list[tuple[float, float]], bytes_axis: bool, width: int,
                height: int) -> tuple[_Frame, str, list[float]]:
    """The plot frame over the points, the y axis unit ("" unless bytes) and its ticks (in that unit)."""
    left, right, top, bottom = 64, 14, 14, 38
    pw, ph = width - left - right, height - top - bottom
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi - x_lo < abs(x_lo) * 1e-9 or x_hi == x_lo:  # one step (or steps too close for a float to tell apart)
        x_hi = x_lo + max(1.0, abs(x_lo) * 1e-9)
    unit, size = byte_unit(max(ys)) if bytes_axis else ("", 1)
    y_lo, y_hi = min(ys) / size, max(ys) / size
    # a loss axis starts near its data; bytes, tokens/s and anything close to 0 start at 0
    lo = 0.0 if (bytes_axis or 0 <= y_lo < 0.5 * y_hi) else y_lo
    probe = nice_ticks(max(y_hi - lo, abs(y_hi) * 1e-9) or 1)  # a tick step a float can add to numbers this large
    step = probe[1] - probe[0]
    start = math.floor(lo / step + 1e-9) * step
    y_ticks = [start]
    while (y_ticks[-1] < y_hi - 1e-9 or len(y_ticks) < 2) and len(y_ticks) < MAX_TICKS:
        y_ticks.append(start + len(y_ticks) * step)
    frame = _Frame(width, height, left, right, top, pw, ph, x_lo, x_hi, y_ticks[0], y_ticks[-1], size)
    return frame, unit, y_ticks


def _line_axes(f: _Frame, y_ticks: list[float], bands, x_label: str) -> list[str]:
    """The shaded bands, the y grid with its labels, the x tick labels and the x axis label (closes the axis group)."""
    out = []
    for x0, x1, label, color in bands:
        out.append(f'<rect x="{f.sx(x0):.1f}" y="{f.top}" width="{max(f.sx(x1) - f.sx(x0), 0.5):.1f}" height="{f.ph}" '
                   f'fill="{color}" fill-opacity="0.14" data-band="{esc(label)}"><title>{esc(label)}</title></rect>')
    for t in y_ticks:
        yy = f.top + f.ph * (1 - (t - f.y_min) / (f.y_max - f.y_min))
        out.append(f'<line class="grid" x1="{f.left}" x2="{f.width - f.right}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
                   f'<text x="{f.left - 6}" y="{yy + 4:.1f}" text-anchor="end">{esc(format_value(t, 3))}</text>')
    xt = nice_ticks(f.x_hi - f.x_lo, 6)
    x_step = xt[1] - xt[0]
    first = math.ceil(f.x_lo / x_step - 1e-9)
    for i in range(first, first + MAX_TICKS):  # counted, not added up: a step below the numbers' precision ends
        v = i * x_step
        if v > f.x_hi + 1e-9:
            break
        out.append(f'<text x="{f.sx(v):.1f}" y="{f.height - 20}" text-anchor="middle">{esc(format_value(v, 3))}</text>')
    out.append(f'<text x="{f.left + f.pw / 2:.1f}" y="{f.height - 4}" text-anchor="middle">{esc(x_label)}</text></g>')
    return out


def _stack_area(f: _Frame, s: Series, tops: list[list[tuple[float, float]]], i: int, bytes_axis: bool, x_label: str,
                stack_marks: int) -> list[str]:
    """The i-th stacked area (between its top edge and the one below) with its marks on the top edge."""
    top_edge = tops[i]
    bottom_edge = tops[i - 1] if i else [(x, 0.0) for x, _ in top_edge]
    poly = " ".join(f"{f.sx(x):.1f},{f.sy(y):.1f}" for x, y in top_edge + bottom_edge[::-1])
    out = [f'<g class="area" data-series="{esc(s.name)}"><polygon points="{poly}" fill="{fill(s.color)}" '
           f'fill-opacity="0.75" stroke="none"/>']
    every = max(1, math.ceil(len(s.points) / max(1, stack_marks)))
    for j in sorted(set(range(0, len(s.points), every)) | {len(s.points) - 1}):
        x, y, k = s.points[j]
        if not y:
            continue
        out.append(_mark(f, s, x, y, top_edge[j][1], "1.6", fill(s.color), k, bytes_axis, x_label))
    out.append("</g>")
    return out


def _mark(f: _Frame, s: Series, x: float, y: float, y_drawn: float, r: str, color: str, k, bytes_axis: bool,
          x_label: str) -> str:
    """One point's circle at (x, y_drawn), its tooltip saying the value y."""
    shown = format_bytes(y) if bytes_axis else format_value(y)
    return (f'<circle cx="{f.sx(x):.1f}" cy="{f.sy(y_drawn):.1f}" r="{r}" fill="{color}" data-key="{esc(k)}" '
            f'data-value="{esc(repr(y))}"><title>{esc(s.name)} at {x_label} {esc(format_value(x))}: '
            f"{esc(shown)}</title></circle>")


def _series_line(f: _Frame, s: Series, bytes_axis: bool, x_label: str, max_marks: int) -> list[str]:
    """One series' polyline over its finite points, with at most `max_marks` marks (the last one always)."""
    good = [(x, y, k) for x, y, k in s.points if y is not None and math.isfinite(y)]
    if not good:
        return []
    path = " ".join(f"{f.sx(x):.1f},{f.sy(y):.1f}" for x, y, _ in good)
    dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
    out = [f'<g class="series" data-series="{esc(s.name)}"><polyline points="{path}" fill="none" '
           f'stroke="{s.color}" stroke-width="2"{dash}/>']
    every = max(1, math.ceil(len(good) / max_marks))
    marks = good[::every]
    if marks[-1] is not good[-1]:
        marks.append(good[-1])
    r = "3.2" if len(marks) <= 60 else "2"
    for x, y, k in marks:
        out.append(_mark(f, s, x, y, y, r, s.color, k, bytes_axis, x_label))
    out.append("</g>")
    return out


def _line_legends(series: list[Series], stack: list[Series]) -> list[str]:
    """The stacked areas' legend (those with a value), then the lines' (when there are several, or areas too)."""
    out = []
    if stack:
        out.append('<div class="legend">' + "".join(
            f'<span><span class="swatch" style="background:{s.color}"></span>{esc(s.name)}</span>'
            for s in stack if any(y for _, y, _ in s.points)) + "</div>")
    if len(series) > 1 or stack:
        out.append('<div class="legend">' + "".join(
            f'<span><span class="swatch line" style="border-top:3px {"dashed" if s.dash else "solid"} {s.color}">'
            f'</span>{esc(s.name)}</span>' if stack else
            f'<span><span class="swatch" style="background:{s.color}"></span>{esc(s.name)}</span>'
            for s in series if s.points) + "</div>")
    return out


def _x_axis(ticks, x, grid_top: float, height: int, label, unit: str) -> list[str]:
    """A bar chart's value axis: a grid line and a label per tick, the unit after the last label (when there is
    one)."""
    out = ['<g class="axis">']
    for t in ticks:
        out.append(f'<line class="grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{grid_top}" y2="{height - 24}"/>'
                   f'<text x="{x(t):.1f}" y="{height - 8}" text-anchor="middle">{esc(label(t))}'
                   f'{" " + unit if t == ticks[-1] and unit else ""}</text>')
    out.append("</g>")
    return out

