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


def test_huge_schedule_is_capped():
    n = 64
    sim = simulate("1f1b", 64, 512, 1, [0.001] * n, [0.002] * n)
    svg = timeline_svg(sim, "big")
    boxes = [el for el in ET.fromstring(svg).iter(f"{NS}title") if re.match(r"[FB] stage", el.text or "")]
    assert 0 < len(boxes) <= MAX_BOXES
    assert any("drawing micro-batches 0-" in t and "of 512 only" in t for t in _texts(svg))


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
