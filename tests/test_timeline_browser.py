"""The timeline as a browser draws it: Chromium (Debian's `chromium` package) renders the SVG of a pp 16 x 192
micro-batch interleaved iteration (49k actions, summarised) headless to a PNG, and the picture is checked: in
every rank's row the share of idle pixels is that rank's idle time, and over all rows it is the bubble the
heading reports. Skipped where no chromium is installed (`apt-get install chromium`)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from planner.cost.simulate import simulate
from planner.report.timeline import _BOX_H, _LEFT, _LEGEND_H, _PLOT_W, _RIGHT, _ROW_H, _TITLE_H, timeline_svg

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs a headless browser: apt-get install chromium")

IDLE = (0xE6, 0xE6, 0xE6)
BUSY = ((0x4C, 0x78, 0xA8), (0xF5, 0x85, 0x18), (0x54, 0xA2, 0x4B))


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rows.append(bytes(v for x in range(width) for v in line[x * channels:x * channels + 3]))
    return width, height, rows


def near(pixel: tuple[int, ...], colour: tuple[int, int, int]) -> bool:
    return all(abs(p - c) <= 8 for p, c in zip(pixel, colour, strict=True))


def test_browser_draws_the_reported_bubble(tmp_path):
    p, m, v = 16, 192, 8
    n = p * v
    # a plan's shape: heavier first and last stages (embedding, head), as the planner's stages are
    fwd = [0.0012 if s in (0, n - 1) else 0.001 for s in range(n)]
    sim = simulate("interleaved-1f1b", p, m, v, fwd, [2 * f for f in fwd], p2p=0.0001)
    svg = tmp_path / "timeline.svg"
    svg.write_text(timeline_svg(sim, f"pp {p} x {m} micro-batches"))
    png = tmp_path / "timeline.png"
    width = _LEFT + _PLOT_W + _RIGHT
    height = _TITLE_H + _LEGEND_H + p * _ROW_H + 60
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
         f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},{height}", f"--screenshot={png}",
         svg.as_uri()],
        check=True, capture_output=True, timeout=180,
    )
    w, h, rows = read_png(png)
    assert (w, h) == (width, height)
    top = _TITLE_H + _LEGEND_H
    idle_total = busy_total = 0
    for r in range(p):
        idle = busy = 0
        for y in range(top + r * _ROW_H + 2, top + r * _ROW_H + 2 + _BOX_H):
            line = rows[y]
            for x in range(_LEFT, _LEFT + _PLOT_W):
                pixel = tuple(line[3 * x:3 * x + 3])
                if near(pixel, IDLE):
                    idle += 1
                elif any(near(pixel, c) for c in BUSY):
                    busy += 1
        assert idle + busy >= 0.99 * _PLOT_W * _BOX_H, f"row {r}: pixels of neither idle nor busy colour"
        expected = 1 - sim.busy[r] / sim.iteration_time
        assert abs(idle / (idle + busy) - expected) < 0.01, (r, idle / (idle + busy), expected)
        idle_total += idle
        busy_total += busy
    assert abs(idle_total / (idle_total + busy_total) - sim.bubble_fraction) < 0.005
