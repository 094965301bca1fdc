"""A Gantt chart of a simulated pipeline iteration as a standalone SVG (one row per pipeline rank).

Pure string building, no plotting library: the output is byte-identical for equal input (coordinates
and times are written with fixed precision) so that reports can be diffed and tested.

Up to MAX_BOXES compute actions each is drawn as its own box. Beyond that (a pp 16 x 192 micro-batch
interleaved schedule has 49k) the chart is summarised, never cut: each pixel column of a rank's row is
split by the share of its time spent in F, B and W, stacked, the rest left idle, with the rounding carried
from column to column (error diffusion), so that a row's idle pixels are its idle time to within one pixel
and the idle share of the whole picture is the bubble the heading reports.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from planner.cost.simulate import KIND_NAMES, SimResult

# Most compute boxes drawn one by one; beyond it the chart is summarised per pixel column.
MAX_BOXES = 20000

# Colour per kind; the second shade marks a rank's odd-numbered stages (interleaved chunks, the V's way
# back) so that the stages of one rank can be told apart.
_FILL = {
    "F": ("#4c78a8", "#2f5b8a"),
    "B": ("#f58518", "#c4640a"),
    "W": ("#54a24b", "#3a7d33"),
}
_COMM = "#b279a2"
_IDLE = "#e6e6e6"
_LEGEND = (
    ("forward (F)", _FILL["F"][0]),
    ("backward (B)", _FILL["B"][0]),
    ("weight grad (W)", _FILL["W"][0]),
    ("p2p send", _COMM),
    ("idle", _IDLE),
)

_LEFT = 170  # room for the row labels
_RIGHT = 30
_PLOT_W = 1000
_ROW_H = 30
_BOX_H = 20
_COMM_H = 4
_TITLE_H = 54
_LEGEND_H = 26
_AXIS_H = 40
_CHAR_W = 6.2  # width of one digit at font-size 10, to decide whether a number fits in a box


def _f(x: float) -> str:
    """Fixed-precision coordinate (no '-0.00')."""
    s = f"{x:.2f}"
    return "0.00" if s == "-0.00" else s


def _tick_step(span_ms: float) -> float:
    """A 1-2-5 step giving at most about ten ticks over span_ms."""
    if span_ms <= 0:
        return 1.0
    raw = span_ms / 10
    base = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if base * mult >= raw:
            return float(base * mult)
    return float(base * 10)


def _tick_label(value_ms: float, step_ms: float) -> str:
    decimals = max(0, -math.floor(math.log10(step_ms)))
    return f"{value_ms:.{decimals}f}"


def _stage_text(stages: list[int], stage_labels: list[str] | None) -> str:
    if stage_labels is None:
        text = ("stage " if len(stages) == 1 else "stages ") + ", ".join(str(s) for s in stages)
    else:
        text = ", ".join(stage_labels[s] for s in stages)
    return text if len(text) <= 28 else text[:27] + "\u2026"


def timeline_svg(sim: SimResult, title: str, stage_labels: list[str] | None = None) -> str:
    """Render `sim` as an SVG Gantt chart: rows are pipeline ranks, x is time in milliseconds.

    title: first line of the heading (the schedule, p, m, v, iteration time and bubble follow on the
    second). stage_labels: optional name per pipeline stage (p*v of them) shown next to each rank instead
    of the stage numbers. Times in `sim` are taken to be seconds.
    """
    n_stages = sim.p * sim.v
    if stage_labels is not None and len(stage_labels) != n_stages:
        raise ValueError(f"stage_labels has {len(stage_labels)} entries; expected one per stage ({n_stages})")
    summarised = len(sim.log) > 0 and sum(len(log) for log in sim.log) > MAX_BOXES

    total = sim.iteration_time
    scale = _PLOT_W / total if total > 0 else 0.0
    top = _TITLE_H + _LEGEND_H
    width = _LEFT + _PLOT_W + _RIGHT
    height = top + sim.p * _ROW_H + _AXIS_H

    heading = (
        f"{sim.schedule}, p={sim.p}, m={sim.m}, v={sim.v}: iteration {total * 1e3:.3f} ms, "
        f"bubble {sim.bubble_fraction * 100:.1f}% of the iteration"
    )
    if summarised:
        heading += f"; {sum(len(log) for log in sim.log):,} actions summarised per pixel column"

    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{_LEFT}" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="{_LEFT}" y="40" font-size="12">{escape(heading)}</text>',
    ]

    # Legend.
    x = _LEFT
    y = _TITLE_H + 4
    for label, colour in _LEGEND:
        out.append(
            f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colour}" '
            'stroke="#888888" stroke-width="0.5"/>'
        )
        out.append(f'<text x="{x + 16}" y="{y + 10}">{escape(label)}</text>')
        x += 16 + int(len(label) * _CHAR_W) + 18
    if sim.v > 1:
        out.append(f'<text x="{x}" y="{y + 10}" fill="#555555">darker: the rank\'s 2nd, 4th... stage</text>')

    # Rows: idle background, labels.
    stages_of = [[s for s in range(n_stages) if sim.stage_ranks[s] == r] for r in range(sim.p)]
    for r in range(sim.p):
        y0 = top + r * _ROW_H
        out.append(f'<rect x="{_LEFT}" y="{y0 + 2}" width="{_PLOT_W}" height="{_BOX_H}" fill="{_IDLE}"/>')
        out.append(f'<text x="8" y="{y0 + 11}" font-weight="bold">rank {r}</text>')
        out.append(
            f'<text x="8" y="{y0 + 23}" font-size="9" fill="#444444">'
            f"{escape(_stage_text(stages_of[r], stage_labels))}</text>"
        )

    if summarised:
        out += _summary(sim, top)
    else:
        out += _boxes(sim, top, scale, stages_of)

    # Time axis in milliseconds.
    y_axis = top + sim.p * _ROW_H + 4
    out.append(f'<line x1="{_LEFT}" y1="{y_axis}" x2="{_LEFT + _PLOT_W}" y2="{y_axis}" stroke="#000000"/>')
    span_ms = total * 1e3
    step = _tick_step(span_ms)
    for i in range(int(span_ms / step + 1e-9) + 1):
        value = i * step
        xt = _LEFT + (value / span_ms * _PLOT_W if span_ms > 0 else 0.0)
        out.append(f'<line x1="{_f(xt)}" y1="{y_axis}" x2="{_f(xt)}" y2="{y_axis + 5}" stroke="#000000"/>')
        out.append(
            f'<text x="{_f(xt)}" y="{y_axis + 17}" text-anchor="middle">{_tick_label(value, step)}</text>'
        )
    out.append(f'<text x="{_LEFT + _PLOT_W // 2}" y="{y_axis + 33}" text-anchor="middle">time (ms)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _boxes(sim: SimResult, top: int, scale: float, stages_of: list[list[int]]) -> list[str]:
    """One box per compute action, numbered where the number fits, and one strip per point-to-point send."""
    out: list[str] = []
    # Compute boxes, then the micro-batch numbers that fit inside them (drawn after, so on top).
    chunk_of = {s: i for r in range(sim.p) for i, s in enumerate(stages_of[r])}
    boxes = ['<g stroke="#ffffff" stroke-width="0.5">']
    labels = ['<g font-size="10" fill="#ffffff" text-anchor="middle">']
    for e in sim.events:
        x0 = _LEFT + e.start * scale
        w = (e.end - e.start) * scale
        y0 = top + e.rank * _ROW_H + 2
        fill = _FILL[e.kind][chunk_of[e.stage] % 2]
        tip = f"{e.kind} stage {e.stage} micro-batch {e.microbatch}: {e.start * 1e3:.3f}-{e.end * 1e3:.3f} ms"
        boxes.append(
            f'<rect x="{_f(x0)}" y="{y0}" width="{_f(w)}" height="{_BOX_H}" fill="{fill}">'
            f"<title>{tip}</title></rect>"
        )
        text = str(e.microbatch)
        if w >= len(text) * _CHAR_W + 4:
            labels.append(f'<text x="{_f(x0 + w / 2)}" y="{y0 + 14}">{text}</text>')
    out += boxes + ["</g>"] + labels + ["</g>"]

    # Point-to-point sends: a thin strip under the sender's boxes.
    out.append(f'<g fill="{_COMM}">')
    for t in sim.transfers:
        x0 = _LEFT + t.start * scale
        w = (t.end - t.start) * scale
        y0 = top + t.src_rank * _ROW_H + 2 + _BOX_H + 1
        what = "activation" if t.kind == "F" else "gradient"
        tip = f"send {what} of stage {t.stage} micro-batch {t.microbatch} to rank {t.dst_rank}"
        out.append(
            f'<rect x="{_f(x0)}" y="{y0}" width="{_f(w)}" height="{_COMM_H}"><title>{tip}</title></rect>'
        )
    out.append("</g>")

    return out


def _coverage(intervals: list[tuple[int, float, float]], kinds: int, total: float) -> list[list[float]]:
    """Per pixel column of the plot, the seconds each kind (0..kinds-1) spends in it: [column][kind]."""
    cols = [[0.0] * kinds for _ in range(_PLOT_W)]
    if total <= 0:
        return cols
    width = total / _PLOT_W
    for kind, start, end in intervals:
        c = min(_PLOT_W - 1, max(0, int(start / width)))
        while c < _PLOT_W and start < end:
            stop = min(end, (c + 1) * width)
            cols[c][kind] += max(0.0, stop - start)
            start = stop
            c += 1
    return cols


def _diffused(cols: list[list[float]], total: float, height: int) -> list[tuple[int, ...]]:
    """Pixel heights per column and kind: each column's share of `height`, rounded with the error carried to
    the next column, so that every kind's pixels add up to its time to within one pixel over the row."""
    width = total / _PLOT_W if total > 0 else 1.0
    kinds = len(cols[0]) if cols else 0
    exact = [0.0] * kinds
    drawn = [0] * kinds
    out = []
    for col in cols:
        heights = []
        for k in range(kinds):
            exact[k] += min(1.0, col[k] / width) * height
            h = max(0, round(exact[k]) - drawn[k])
            heights.append(h)
        while sum(heights) > height:  # a full column: take the excess from the kind most ahead of its share
            k = max(range(kinds), key=lambda i: (drawn[i] + heights[i] - exact[i], i))
            heights[k] -= 1
        for k in range(kinds):
            drawn[k] += heights[k]
        out.append(tuple(heights))
    return out


def _runs(heights: list[tuple[int, ...]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first column, column count, heights) for each run of equal columns."""
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for c, h in enumerate(heights):
        if runs and runs[-1][2] == h:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, h)
        else:
            runs.append((c, 1, h))
    return runs


def _summary(sim: SimResult, top: int) -> list[str]:
    """Each rank's row as stacked per-column shares of F, B and W (idle below), and its sends' share."""
    total = sim.iteration_time
    order = ("F", "B", "W")
    out = ['<g shape-rendering="crispEdges">']
    for r in range(sim.p):
        y0 = top + r * _ROW_H + 2
        per_kind = [(order.index(KIND_NAMES[k]), a, b) for k, _, _, a, b in sim.log[r]]
        cols = _coverage(per_kind, len(order), total)
        busy = [sum(c[k] for c in cols) for k in range(len(order))]
        tip = ", ".join(f"{order[k]} {busy[k] / total * 100:.1f}%" for k in range(len(order)) if busy[k] > 0)
        idle = 1 - sum(busy) / total if total > 0 else 0.0
        out.append(f'<rect x="{_LEFT}" y="{y0}" width="{_PLOT_W}" height="{_BOX_H}" fill-opacity="0">'
                   f"<title>rank {r}: {tip}; idle {idle * 100:.1f}% of the iteration</title></rect>")
        for c0, n, heights in _runs(_diffused(cols, total, _BOX_H)):
            y = y0
            for k, h in enumerate(heights):
                if h:
                    fill = _FILL[order[k]][0]
                    out.append(f'<rect x="{_LEFT + c0}" y="{y}" width="{n}" height="{h}" fill="{fill}"/>')
                    y += h
        sends = [(0, t.start, t.end) for t in sim.transfers if t.src_rank == r]
        if sends:
            y_comm = y0 + _BOX_H + 1
            for c0, n, (h,) in _runs(_diffused(_coverage(sends, 1, total), total, _COMM_H)):
                if h:
                    out.append(f'<rect x="{_LEFT + c0}" y="{y_comm}" width="{n}" height="{h}" fill="{_COMM}"/>')
    out.append("</g>")
    return out
