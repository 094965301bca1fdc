"""`planner sweep`: node ranges, prices (spec's or --price), the Pareto front, the table, JSON and plot."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import ConfigError
from planner.hardware.load import load_cluster
from planner.report.sweep import SweepPoint, pareto, parse_nodes, parse_prices

ROOT = Path(__file__).resolve().parent.parent


def test_parse_nodes():
    assert parse_nodes("4..128") == [4, 8, 16, 32, 64, 128]
    assert parse_nodes("3..10") == [3, 4, 8, 10]
    assert parse_nodes("12,4, 8") == [4, 8, 12]
    assert parse_nodes("16") == [16]
    for bad in ("0..4", "8..4", "x", "4,-1", ""):
        with pytest.raises(ConfigError, match="--nodes"):
            parse_nodes(bad)


def test_parse_prices():
    assert parse_prices(["h100=2.49", "a100 = 1"]) == {"h100": 2.49, "a100": 1.0}
    for bad in ("h100", "h100=cheap", "=2", "h100=-1", "h100=inf", "h100=nan"):
        with pytest.raises(ConfigError, match="--price"):
            parse_prices([bad])


def test_prices_live_in_the_specs_with_source_and_date_and_leave_plans_unchanged():
    gpu = load_cluster("h100-sxm-80gb", 1).gpu
    assert gpu.price is not None and gpu.price.usd_per_gpu_hour > 0 and gpu.price.source and gpu.price.date
    # not in the dump that plans' input digests hash: a price change re-plans nothing
    assert "price" not in load_cluster("h100-sxm-80gb", 1).model_dump()["gpu"]


def test_pareto_marks_the_undominated():
    def pt(gpu, t, c):
        return SweepPoint(gpu, 1, gpus=8, iteration_s=1.0, time_to_train_s=t, cost_usd=c)

    points = pareto([pt("a", 10, 100), pt("b", 5, 200), pt("c", 10, 150), pt("d", 4, 300), pt("e", 5, 200),
                     SweepPoint("f", 1, error="does not fit")])
    assert [p.pareto for p in points] == [True, True, False, True, True, False]


def test_sweep_command(tmp_path):
    out = tmp_path / "sw"
    args = ["sweep", str(ROOT / "sample_models" / "gpt.py"), "--gpu", "a100,h100", "--nodes", "1,2",
            "--global-batch-size", "8", "--tokens", "1e9", "--price", "h100=2", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    points = doc["points"]
    assert [(p["gpu"], p["nodes"]) for p in points] == [("a100", 1), ("a100", 2), ("h100", 1), ("h100", 2)]
    spec_price = load_cluster("a100", 1).gpu.price
    assert spec_price is not None
    for p in points:
        assert not p["error"] and p["gpus"] == 8 * p["nodes"]
        assert p["usd_per_gpu_hour"] == (2.0 if p["gpu"] == "h100" else spec_price.usd_per_gpu_hour)
        assert p["time_to_train_s"] == pytest.approx(1e9 / p["tokens_per_s"])
        assert p["cost_usd"] == pytest.approx(p["time_to_train_s"] / 3600 * p["gpus"] * p["usd_per_gpu_hour"])
    front = [p for p in points if p["pareto"]]
    assert front
    for p in front:
        assert not any(q["time_to_train_s"] < p["time_to_train_s"] and q["cost_usd"] < p["cost_usd"] for q in points)
    assert json.loads((out / "sweep.json").read_text()) == doc
    svg = ET.fromstring((out / "sweep.svg").read_text())
    circles = [c for c in svg.iter("{http://www.w3.org/2000/svg}circle") if c.find("{http://www.w3.org/2000/svg}title")
               is not None]
    assert len(circles) == 4
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "Pareto front" in table.stdout and "a100" in table.stdout


def test_sweep_unknown_gpu_is_a_clear_error():
    result = CliRunner().invoke(app, ["sweep", str(ROOT / "sample_models" / "gpt.py"), "--gpu", "a100,nosuchgpu",
                                      "--nodes", "1", "--global-batch-size", "8"])
    assert result.exit_code == 2 and "nosuchgpu" in result.output
