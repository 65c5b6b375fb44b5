"""Inline SVG charts, written as text: a line chart, grouped bars, a pipeline timeline, the mesh.

Why inline SVG and not a vendored charting library: the page must open offline, and the
charts here are small (hundreds of points), so a few hundred lines of Python draw them with
nothing to vendor or update, and every drawn point is an element the browser test can count:
each ``<polyline>`` carries ``data-series`` and ``data-points`` (its number of points, also
``polyline.points.numberOfItems`` in the browser), each bar and timeline box is a ``<rect>``.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
           "#8C8C8C", "#CCB974", "#64B5CD")


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (1, 2, 5 × 10^k steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, t = [], first
    while t <= hi + step * 1e-9:
        out.append(round(t, 12))
        t += step
    return out


def fmt(v: float) -> str:
    """A tick label: 3 significant digits, SI suffixes for large values."""
    if v == 0:
        return "0"
    a = abs(v)
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{suf}"
    return f"{v:.3g}"


def line_chart(chart_id: str, series: list[dict], *, xlabel: str = "step", ylabel: str = "",
               width: int = 720, height: int = 280, log_y: bool = False,
               marks: list[dict] | None = None, title: str = "") -> str:
    """An SVG line chart. ``series``: ``[{"name", "points": [(x, y)], "colour"?, "markers"?,
    "dash"?}]`` (non-finite y values are left out of the line and not counted); ``marks``:
    vertical lines ``[{"x", "label", "cls"}]`` (e.g. the first diverging step). ``log_y``:
    a log10 y axis (values ≤ 0 left out)."""
    L, R, T, B = 64, 16, 24 if title else 12, 40
    pw, ph = width - L - R, height - T - B
    keep = []
    for s in series:
        pts = [(float(x), float(y)) for x, y in s["points"]
               if math.isfinite(float(y)) and (not log_y or float(y) > 0)]
        keep.append((s, pts))
    xs = [x for _, pts in keep for x, _ in pts] + [m["x"] for m in marks or []]
    ys = [math.log10(y) if log_y else y for _, pts in keep for _, y in pts]
    parts = [f'<svg class="chart" id="{escape(chart_id)}" data-chart="{escape(chart_id)}" '
             f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'role="img" xmlns="http://www.w3.org/2000/svg">']
    if title:
        parts.append(f'<text x="{L}" y="15" class="ctitle">{escape(title)}</text>')
    if not ys:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" '
                     'class="empty">no data</text></svg>')
        return "".join(parts)
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or abs(y0) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad

    def X(x):
        return L + (x - x0) / (x1 - x0) * pw

    def Y(y):
        v = math.log10(y) if log_y else y
        return T + ph - (v - y0) / (y1 - y0) * ph

    parts.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" class="plot"/>')
    if log_y:
        yt = [10.0 ** k for k in range(math.floor(y0), math.ceil(y1) + 1)
              if y0 <= k <= y1]
    else:
        yt = nice_ticks(y0, y1)
    for t in yt:
        y = Y(t)
        parts.append(f'<line x1="{L}" x2="{L + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                     f'{escape(f"1e{round(math.log10(t))}" if log_y else fmt(t))}</text>')
    for t in nice_ticks(x0, x1, 8):
        x = X(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{T}" y2="{T + ph}" class="grid"/>'
                     f'<text x="{x:.1f}" y="{T + ph + 16}" text-anchor="middle" class="tick">'
                     f'{fmt(t)}</text>')
    parts.append(f'<text x="{L + pw / 2}" y="{height - 6}" text-anchor="middle" '
                 f'class="axis">{escape(xlabel)}</text>'
                 f'<text transform="translate(14 {T + ph / 2}) rotate(-90)" '
                 f'text-anchor="middle" class="axis">{escape(ylabel)}</text>')
    for i, (s, pts) in enumerate(keep):
        colour = s.get("colour") or PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="6 3"' if s.get("dash") else ""
        coords = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-series="{escape(s["name"])}" '
                     f'data-points="{len(pts)}" points="{coords}" fill="none" '
                     f'stroke="{colour}" stroke-width="1.6"{dash}/>')
        if s.get("markers"):
            for x, y in pts:
                parts.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{colour}" '
                             f'data-series="{escape(s["name"])}" class="pt"><title>'
                             f'{escape(s["name"])} step {_num(x)}: {y:.6g}</title></circle>')
    for m in marks or []:
        x = X(m["x"])
        parts.append(f'<g class="{escape(m.get("cls", "mark"))}" data-step="{_num(m["x"])}">'
                     f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{T}" y2="{T + ph}" '
                     f'stroke="#C44E52" stroke-width="2" stroke-dasharray="4 2"/>'
                     f'<text x="{x + 4:.1f}" y="{T + 30}" class="marklabel">'
                     f'{escape(m.get("label", ""))}</text></g>')
    # legend
    lx = L + 8
    for i, (s, pts) in enumerate(keep):
        colour = s.get("colour") or PALETTE[i % len(PALETTE)]
        label = f'{s["name"]} ({len(pts)})'
        parts.append(f'<rect x="{lx}" y="{T + 6}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{lx + 14}" y="{T + 15}" class="legend">{escape(label)}</text>')
        lx += 24 + 7 * len(label)
    parts.append("</svg>")
    return "".join(parts)


def bar_chart(chart_id: str, groups: list[str], series: list[dict], *, ylabel: str = "bytes",
              width: int = 720, height: int = 260) -> str:
    """Grouped bars: one group per label in ``groups``, one bar per series (``[{"name",
    "values": [v or None per group]}]``); None draws no bar. Each bar is a ``<rect
    class="bar" data-value>`` with a ``<title>``."""
    L, R, T = 70, 16, 12
    rows, lx = 1, 78  # legend rows: wrap at the chart's width
    for s in series:
        step = 30 + 7 * len(s["name"])
        if lx + step > width - 8:
            rows, lx = rows + 1, 78
        lx += step
    B = 30 + 16 * rows
    pw, ph = width - L - R, height - T - B
    vals = [v for s in series for v in s["values"] if v is not None and math.isfinite(v)]
    top = max(vals) if vals else 1.0
    top = top * 1.08 or 1.0
    parts = [f'<svg class="chart" id="{escape(chart_id)}" data-chart="{escape(chart_id)}" '
             f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             'xmlns="http://www.w3.org/2000/svg">',
             f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" class="plot"/>']
    for t in nice_ticks(0, top):
        y = T + ph - t / top * ph
        parts.append(f'<line x1="{L}" x2="{L + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
                     f'{fmt(t)}</text>')
    gw = pw / max(len(groups), 1)
    bw = gw * 0.8 / max(len(series), 1)
    for g, label in enumerate(groups):
        gx = L + g * gw + gw * 0.1
        parts.append(f'<text x="{L + g * gw + gw / 2:.1f}" y="{T + ph + 16}" '
                     f'text-anchor="middle" class="tick">{escape(label)}</text>')
        for i, s in enumerate(series):
            v = s["values"][g]
            if v is None or not math.isfinite(v):
                continue
            h = v / top * ph
            colour = s.get("colour") or PALETTE[i % len(PALETTE)]
            parts.append(f'<rect class="bar" data-series="{escape(s["name"])}" '
                         f'data-value="{v}" x="{gx + i * bw:.1f}" y="{T + ph - h:.1f}" '
                         f'width="{bw * 0.92:.1f}" height="{h:.1f}" fill="{colour}">'
                         f'<title>{escape(s["name"])} {escape(label)}: {v:,.0f}</title></rect>')
    lx, ly = L + 8, T + ph + 26
    for i, s in enumerate(series):
        colour = s.get("colour") or PALETTE[i % len(PALETTE)]
        step = 30 + 7 * len(s["name"])
        if lx + step > width - 8:
            lx, ly = L + 8, ly + 16
        parts.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" '
                     f'fill="{colour}"/><text x="{lx + 14}" y="{ly + 9}" class="legend">'
                     f'{escape(s["name"])}</text>')
        lx += step
    parts.append(f'<text transform="translate(12 {T + ph / 2}) rotate(-90)" '
                 f'text-anchor="middle" class="axis">{escape(ylabel)}</text></svg>')
    return "".join(parts)


TIMELINE_COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#8FD19E", "W": "#DD8452",
                    "RECV_F": "#D0D0D0", "RECV_B": "#A8A8A8", "SEND_F": "#8172B3",
                    "SEND_B": "#937860", "STEP": "#C44E52"}


def timeline_chart(chart_id: str, events: list, p: int, *, width: int = 900) -> str:
    """A pipeline step: one row per pp rank (rank 0 on top), one ``<rect class="ev">`` per
    action ``[rank, kind, microbatch, chunk, start_s, end_s]``, coloured by kind (the colours
    of :mod:`shardwise.viz.timeline`), compute boxes labelled with their micro-batch."""
    row, L, T = 30, 60, 8
    height = T + p * row + 58
    t1 = max((e[5] for e in events), default=1.0) or 1.0
    pw = width - L - 12
    parts = [f'<svg class="chart" id="{escape(chart_id)}" data-chart="{escape(chart_id)}" '
             f'data-points="{len(events)}" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" xmlns="http://www.w3.org/2000/svg">']
    for r in range(p):
        parts.append(f'<text x="{L - 8}" y="{T + r * row + row / 2 + 4}" text-anchor="end" '
                     f'class="tick">pp {r}</text>')
    for rank, kind, mb, chunk, s, e in events:
        x, w = L + s / t1 * pw, max((e - s) / t1 * pw, 0.5)
        y = T + rank * row + 3
        colour = TIMELINE_COLOURS.get(kind, "#999")
        label = f"{mb}" + (f".{chunk}" if chunk else "")
        parts.append(f'<rect class="ev" data-kind="{escape(kind)}" x="{x:.2f}" y="{y}" '
                     f'width="{w:.2f}" height="{row - 6}" fill="{colour}"><title>{escape(kind)}'
                     f' mb {label} on pp {rank}: {s * 1e3:.2f}–{e * 1e3:.2f} ms</title></rect>')
        if kind in ("F", "B", "I", "W") and w > 12:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + row / 2 + 1}" text-anchor="middle" '
                         f'class="evlabel">{escape(label)}</text>')
    for t in nice_ticks(0, t1 * 1e3, 8):
        x = L + t / (t1 * 1e3) * pw
        parts.append(f'<text x="{x:.1f}" y="{T + p * row + 14}" text-anchor="middle" '
                     f'class="tick">{fmt(t)}</text>')
    parts.append(f'<text x="{L + pw / 2}" y="{T + p * row + 32}" text-anchor="middle" '
                 'class="axis">ms from the step\'s first action</text>')
    lx = L
    order = list(TIMELINE_COLOURS)
    for kind in sorted({e[1] for e in events},
                       key=lambda k: (order.index(k) if k in order else len(order), k)):
        parts.append(f'<rect x="{lx}" y="{height - 14}" width="10" height="10" '
                     f'fill="{TIMELINE_COLOURS.get(kind, "#999")}"/><text x="{lx + 13}" '
                     f'y="{height - 5}" class="legend">{escape(kind)}</text>')
        lx += 22 + 8 * len(kind)
    parts.append("</svg>")
    return "".join(parts)


def mesh_chart(chart_id: str, mesh: dict, stages: list | None = None) -> str:
    """The mesh [pp, dp, cp, tp] as boxes: one panel per pipeline stage (left to right), dp
    down, cp × tp across; each rank box names its global rank and coordinates, filled by its
    stage; ``stages`` adds each stage's blocks under its panel."""
    pp, dp, cp, tp = mesh["shape"]
    bw, bh, gap = 74, 40, 6
    cols = cp * tp
    panel_w = cols * (bw + gap) + gap
    panel_h = dp * (bh + gap) + gap
    width = max(pp * (panel_w + 24) + 20, 560)
    height = panel_h + 70
    parts = [f'<svg class="chart" id="{escape(chart_id)}" data-chart="{escape(chart_id)}" '
             f'data-points="{pp * dp * cp * tp}" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">']
    for a in range(pp):
        px = 10 + a * (panel_w + 24)
        parts.append(f'<rect x="{px}" y="22" width="{panel_w}" height="{panel_h}" '
                     f'class="panel"/><text x="{px}" y="16" class="legend">'
                     f'{"pp stage " + str(a) if pp > 1 else "one stage (pp = 1)"}</text>')
        for b in range(dp):
            for c in range(cp):
                for d in range(tp):
                    r = mesh["grid"][a][b][c][d]
                    x = px + gap + (c * tp + d) * (bw + gap)
                    y = 22 + gap + b * (bh + gap)
                    coord = f"dp{b}" + (f" cp{c}" if cp > 1 else "") + f" tp{d}"
                    parts.append(f'<g class="rank" data-rank="{r}"><rect x="{x}" y="{y}" '
                                 f'width="{bw}" height="{bh}" rx="4" '
                                 f'fill="{PALETTE[a % len(PALETTE)]}" fill-opacity="0.25" '
                                 f'stroke="{PALETTE[a % len(PALETTE)]}"/>'
                                 f'<text x="{x + bw / 2}" y="{y + 16}" text-anchor="middle" '
                                 f'class="rlabel">rank {r}</text><text x="{x + bw / 2}" '
                                 f'y="{y + 31}" text-anchor="middle" class="tick">{coord}'
                                 f'</text></g>')
        if stages:
            chunks = stages[a]["chunks"]
            text = "; ".join(f"blocks {lo}–{hi}" if hi >= lo else "no blocks"
                             for lo, hi in chunks)
            extra = (" + embedding" if a == 0 else "") + \
                (" + head" if stages[a].get("head", a == pp - 1) else "")
            parts.append(f'<text x="{px}" y="{panel_h + 40}" class="tick">{escape(text + extra)}'
                         f'</text>')
    parts.append(f'<text x="10" y="{height - 8}" class="tick">rows: dp index; columns: '
                 f'{"cp × " if cp > 1 else ""}tp index (tp innermost: neighbouring ranks); '
                 'fill: pipeline stage</text></svg>')
    return "".join(parts)


def heat_colour(v: float | None, lo: float = 1e-9, hi: float = 1e-4) -> str:
    """A colour for an error ``v`` on a log scale: green at ≤ lo, yellow halfway, red at ≥ hi
    (grey for None/NaN)."""
    if v is None or not math.isfinite(v):
        return "#dddddd"
    if v <= 0:
        return "#1a9850"
    f = (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    f = min(max(f, 0.0), 1.0)
    stops = ((0.0, (26, 152, 80)), (0.5, (254, 224, 139)), (1.0, (215, 48, 39)))
    for (f0, c0), (f1, c1) in zip(stops, stops[1:]):
        if f <= f1:
            t = (f - f0) / (f1 - f0)
            return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(c0, c1))
    return "#d73027"
