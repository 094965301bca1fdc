"""planner calibrate: the fit, the written spec, and the whole command on this machine's device.

The CPU path runs everywhere (gloo between two processes); the CUDA path runs where a GPU exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from planner.cli.main import app
from planner.hardware.load import load_cluster, load_spec, specs_dir
from planner.hardware.spec import Efficiencies
from planner.measure.calibrate import (
    Calibration,
    Measurement,
    calibrated_yaml,
    fit_gemm_curve,
    model_gemm_shapes,
)

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_fit_recovers_the_cost_models_gemm_curve():
    matmul, half = 0.8, 300.0
    points = [(d, matmul * d / (d + half)) for d in (256, 512, 1024, 4096)]
    got = fit_gemm_curve(points)
    assert got == pytest.approx((matmul, half), rel=1e-9)


def test_fit_of_a_flat_curve_and_of_one_point():
    assert fit_gemm_curve([(512, 0.6)]) == (0.6, 0.0)
    m, h = fit_gemm_curve([(256, 0.5), (1024, 0.5)])
    assert m == pytest.approx(0.5) and h == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        fit_gemm_curve([])


def _calibration(**eff) -> Calibration:
    spec = load_spec("h100-sxm5-80gb")
    cal = Calibration(spec, "cuda", "NVIDIA H100 80GB HBM3", "bf16", "2.13.0")
    cal.measurements = [Measurement("gemm", "4096x4096x4096", 2e-4, 0.7, 4096.0)]
    cal.efficiency = Efficiencies(**eff)
    cal.notes = {k: f"planner calibrate: how {k} was measured" for k in Efficiencies.model_fields}
    return cal


def test_written_spec_loads_with_the_measured_efficiencies(tmp_path):
    base = (specs_dir() / "h100-sxm5-80gb.yaml").read_text()
    cal = _calibration(matmul=0.71, gemm_half_dim=123.0, attention=0.42, memory=0.9, network=0.66)
    text = calibrated_yaml(cal, base, "my-h100")
    path = tmp_path / "my-h100.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert spec.name == "my-h100" and spec.aliases == []
    assert spec.efficiency == Efficiencies(matmul=0.71, gemm_half_dim=123.0, attention=0.42, memory=0.9, network=0.66)
    # everything else is the base spec's
    assert spec.peak_tflops == load_spec("h100-sxm5-80gb").peak_tflops
    assert spec.memory_reserve == load_spec("h100-sxm5-80gb").memory_reserve
    assert "planner calibrate" in spec.sources["efficiency"]
    block = text.split("\nefficiency:", 1)[1].split("\nsources:")[0]
    assert all("# source: planner calibrate" in line for line in block.strip().splitlines()[1:])
    assert yaml.safe_load(text)["efficiency"]["matmul"] == pytest.approx(0.71)
    # and --gpu FILE plans with it
    assert load_cluster(path, 2).gpu.efficiency.attention == pytest.approx(0.42)


def test_a_tiny_measured_efficiency_is_written_as_a_valid_spec(tmp_path):
    """A slow, loaded CPU measures efficiencies below 0.00005: four decimals would write 0.0000, which no spec
    accepts (efficiencies are > 0); they keep four significant digits instead."""
    base = (specs_dir() / "h100-sxm5-80gb.yaml").read_text()
    cal = _calibration(matmul=4.12e-5, gemm_half_dim=0.0, attention=2e-6, memory=0.9, network=0.66)
    path = tmp_path / "slow.yaml"
    path.write_text(calibrated_yaml(cal, base, "slow"))
    eff = load_spec(path).efficiency
    assert eff.matmul == pytest.approx(4.12e-5) and eff.attention == pytest.approx(2e-6) and eff.memory == 0.9


def test_model_gemm_shapes_are_the_models_linears():
    shapes = model_gemm_shapes([(str(ROOT / "sample_models" / "gpt.py"), {"hidden": 96, "seq": 32})], "bf16")
    # tokens of one sample x (in, out): attention projections, the MLP and the head
    assert (32, 96, 96) in shapes
    assert (32, 96, 384) in shapes and (32, 384, 96) in shapes
    assert (32, 96, 1024) in shapes


def test_a_cluster_preset_is_refused():
    res = invoke("calibrate", "--gpu", "dgx-a100", "--out", "x.yaml")
    assert res.exit_code == 2
    assert "calibrate its GPU instead" in res.output


def test_calibrate_the_cpu_spec_end_to_end(tmp_path):
    out = tmp_path / "cpu-measured.yaml"
    res = invoke("calibrate", "--gpu", "cpu", "--quick", "--repeats", "2", "--warmup", "1", "--out", out, "--json")
    assert res.exit_code == 0, res.output
    spec = load_spec(out)
    assert spec.name == "cpu-calibrated"
    kinds = {m["kind"] for m in __import__("json").loads(res.stdout)["measurements"]}
    assert kinds == {"gemm", "attention", "memory", "all_reduce", "all_gather", "p2p"}
    for key in ("matmul", "attention", "memory", "network"):
        assert 0 < getattr(spec.efficiency, key) <= 1
    # the calibrated spec drives a plan
    model = ROOT / "sample_models" / "mlp.py"
    res = invoke("dry-run", model, "--gpu", out, "--gpus-per-node", "2", "--global-batch-size", "4", "--json")
    assert res.exit_code == 0, res.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibrate_on_cuda(tmp_path):
    from planner.measure.calibrate import calibrate

    name = torch.cuda.get_device_name(0).lower()
    spec = load_spec("h100-sxm5-80gb" if "h100" in name else "a100-sxm4-80gb" if "a100" in name else "h200")
    cal = calibrate(spec, "cuda", "bf16", quick=True, repeats=3, warmup=2)
    assert cal.efficiency is not None
    gemm = [m for m in cal.measurements if m.kind == "gemm"]
    assert gemm and all(0 < m.efficiency < 1.5 for m in gemm)
    if torch.cuda.device_count() >= 2:
        assert any(m.kind == "all_reduce" for m in cal.measurements)
