"""The Gantt-chart SVG: well-formed, one row per rank, a legend, capped, byte-identical for equal input."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.cost.schedules import schedule_violation
from planner.cost.simulate import simulate
from planner.report.timeline import MAX_BOXES, timeline_svg
from planner.report.trace import chrome_trace

NS = "{http://www.w3.org/2000/svg}"


def _texts(svg: str) -> list[str]:
    return [el.text or "" for el in ET.fromstring(svg).iter(f"{NS}text")]


def _sim(schedule="1f1b", p=4, m=8, v=1, p2p=0.0):
    n = p * v
    return simulate(schedule, p, m, v, [0.001 * (1 + s % 3) for s in range(n)], [0.002] * n, p2p=p2p)


def test_valid_svg_with_rows_legend_and_axis():
    sim = _sim(p2p=0.0002)
    svg = timeline_svg(sim, "GPT-2 small on 4 GPUs")
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg"
    texts = _texts(svg)
    assert [t for t in texts if t.startswith("rank ")] == [f"rank {r}" for r in range(4)]
    for entry in ("forward (F)", "backward (B)", "weight grad (W)", "p2p send", "idle"):
        assert entry in texts
    assert "time (ms)" in texts
    heading = next(t for t in texts if t.startswith("1f1b"))
    assert "p=4, m=8, v=1" in heading
    assert f"iteration {sim.iteration_time * 1e3:.3f} ms" in heading
    assert "GPT-2 small on 4 GPUs" in texts


def test_one_box_per_event_and_transfer():
    sim = _sim("interleaved-1f1b", 2, 4, 2, p2p=0.0001)
    svg = timeline_svg(sim, "t")
    tips = [el.text for el in ET.fromstring(svg).iter(f"{NS}title")]
    assert sum(1 for t in tips if re.match(r"[FBW] stage \d+ micro-batch \d+:", t)) == len(sim.events)
    assert sum(1 for t in tips if t.startswith("send ")) == len(sim.transfers) > 0
    # Boxes are wide enough here to carry their micro-batch number.
    assert {str(j) for j in range(4)} <= set(_texts(svg))


def test_byte_identical_for_equal_input():
    a = timeline_svg(_sim("zero-bubble", 3, 6, 2, p2p=0.0001), "zbv", [f"L{i}" for i in range(6)])
    b = timeline_svg(_sim("zero-bubble", 3, 6, 2, p2p=0.0001), "zbv", [f"L{i}" for i in range(6)])
    assert a == b


def test_stage_labels_and_escaping():
    sim = _sim("interleaved-1f1b", 2, 4, 2)
    svg = timeline_svg(sim, "a <b> & c", ["embed", "blocks 0-3", "blocks 4-7", "head"])
    texts = _texts(svg)
    assert "a <b> & c" in texts
    assert "embed, blocks 4-7" in texts  # rank 0 holds stages 0 and 2
    assert "stages 0, 2" in _texts(timeline_svg(sim, "x"))
    with pytest.raises(ValueError, match="one per stage"):
        timeline_svg(sim, "x", ["only one"])


def _summary_pixels(svg: str, p: int) -> list[tuple[int, int]]:
    """(busy pixels, row pixels) per rank's row of a summarised chart, counted from its rectangles."""
    from planner.report.timeline import _BOX_H, _LEFT, _LEGEND_H, _PLOT_W, _ROW_H, _TITLE_H

    top = _TITLE_H + _LEGEND_H
    busy = [0] * p
    for el in ET.fromstring(svg).iter(f"{NS}rect"):
        fill, y = el.get("fill"), float(el.get("y", 0))
        if fill in {"#4c78a8", "#f58518", "#54a24b"} and float(el.get("x", 0)) >= _LEFT and y >= top:
            r = int((y - top) // _ROW_H)
            if y + float(el.get("height")) <= top + r * _ROW_H + 2 + _BOX_H:
                busy[r] += int(float(el.get("width"))) * int(float(el.get("height")))
    return [(b, _PLOT_W * _BOX_H) for b in busy]


def test_huge_schedule_is_summarised_not_cut():
    """pp 16 x 192 micro-batches, 8 stages per rank: 49k actions. Every rank's row is drawn to the end, and its
    idle pixels are its idle time: their share over the picture is the bubble the heading states."""
    p, m, v = 16, 192, 8
    n = p * v
    sim = simulate("interleaved-1f1b", p, m, v, [0.001 * (1 + s % 3) for s in range(n)], [0.002] * n, p2p=0.0001)
    assert len(sim.events) > MAX_BOXES
    svg = timeline_svg(sim, "big")
    assert any("summarised per pixel column" in t for t in _texts(svg))
    rows = _summary_pixels(svg, p)
    for r, (busy, area) in enumerate(rows):
        assert abs(busy / area - sim.busy[r] / sim.iteration_time) <= 3 / area, r  # within a pixel per kind
    idle = 1 - sum(b for b, _ in rows) / sum(a for _, a in rows)
    assert abs(idle - sim.bubble_fraction) < 1e-3


def test_zero_time_schedule_renders():
    sim = simulate("gpipe", 2, 2, 1, [0.0, 0.0], [0.0, 0.0])
    ET.fromstring(timeline_svg(sim, "empty"))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]),
    st.integers(1, 6),
    st.integers(1, 12),
    st.integers(2, 3),
    st.floats(0.0, 0.001),
)
def test_any_schedule_renders_deterministically(schedule, p, m, v, p2p):
    v = {"gpipe": 1, "1f1b": 1, "zero-bubble": 2}.get(schedule, v)
    assume(schedule_violation(schedule, p, m, v) is None)
    svg = timeline_svg(_sim(schedule, p, m, v, p2p), f"{schedule} test")
    ET.fromstring(svg)
    assert svg == timeline_svg(_sim(schedule, p, m, v, p2p), f"{schedule} test")
    assert [t for t in _texts(svg) if t.startswith("rank ")] == [f"rank {r}" for r in range(p)]


def test_chrome_trace_one_process_per_rank_with_compute_and_comm_tracks():
    import json

    sim = _sim("interleaved-1f1b", 2, 4, 2, p2p=0.0001)
    doc = json.loads(chrome_trace(sim, "t", ["embed", "blocks 0-3", "blocks 4-7", "head"]))
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["bubble_fraction"] == round(sim.bubble_fraction, 6)
    events = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {(0, 0): "compute (embed, blocks 4-7)", (0, 1): "p2p send",
                     (1, 0): "compute (blocks 0-3, head)", (1, 1): "p2p send"}
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    sends = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(compute) == len(sim.events) and len(sends) == len(sim.transfers) > 0
    for r in range(2):  # a rank's compute track holds its busy time, in microseconds
        got = sum(e["dur"] for e in compute if e["pid"] == r)
        assert abs(got - sim.busy[r] * 1e6) < 1e-2
    assert chrome_trace(sim, "t") == chrome_trace(_sim("interleaved-1f1b", 2, 4, 2, p2p=0.0001), "t")
