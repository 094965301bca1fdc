"""bench/gpu_check.py: its CPU path end to end (cheap settings), and the CUDA paths it needs (skipped without a GPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["-a", "layers=2", "-a", "hidden=64", "-a", "seq=32", "-a", "vocab=256"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_check():
    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "out"
    doc = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), "--json", str(doc), *args],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(doc.read_text())


def _check_whole(text: str, doc: dict, runs: int) -> None:
    for head in ("device:", "driver:", "torch:"):
        assert head in text
    steps = {row["step"] for row in doc["rows"]}
    assert {"1 unit times", "2 calibrate", "3 validate", "4 quality grid", "4 quality"} <= steps
    assert doc["profile_from_cache"], "the unit table must show the profile `plan --measure` used"
    assert all(u["measured_s"] > 0 and u["spec_s"] > 0 and u["calibrated_s"] > 0 for u in doc["units"])
    validate = doc["validate"]
    assert validate["measured"]["iteration_time_s"] > 0 and validate["predicted"]["iteration_time_s"] > 0
    measured = [e for e in doc["grid"] if "measured_s" in e]
    assert len(measured) == runs
    assert all(e["measured_s"] > 0 and e["measured_bytes"] > 0 for e in measured)
    # every chooser's pick was among the runs, its gap to the measured best is >= 0
    assert set(doc["choices"]) == {"spec", "calibrated", "measured profile"}
    assert all(c["gap"] >= 0 for c in doc["choices"].values())


def test_cpu_path(tmp_path):
    """The four steps against the CPU spec on a tiny Llama; 2 micro-batch sizes x 1 recomputation mode run."""
    text, doc = _run(tmp_path, "--device", "cpu", *SMALL, "--global-batch-size", "2", "--recompute", "none",
                     "--validate-steps", "2", "--quality-steps", "2")
    _check_whole(text, doc, runs=2)
    assert doc["header"]["spec"] == "cpu"
    assert doc["validate"]["measured"]["memory_kind"] == "cpu_max_rss"


def test_render_aligns_columns():
    gc = _gpu_check()
    report = gc.Report(header={"device": "x"})
    report.add("1 unit times", "a fwd", "1.00 ms", "2.00 ms", "-50.0%", "note")
    report.add("3 validate", "step time (long label)", "3.00 ms", "3.00 ms", "+0.0%")
    lines = gc.render(report).splitlines()
    assert lines[0] == "device: x"
    head, rule, first, second = lines[2:]
    assert head.split()[:3] == ["step", "item", "planner"]
    column = head.index("planner")
    assert first[column:].startswith("1.00 ms") and second[column:].startswith("3.00 ms")
    assert set(rule.replace(" ", "")) == {"-"}


def test_local_spec_cpu():
    assert _gpu_check().local_spec("cpu") == "cpu"


@needs_cuda
def test_local_spec_matches_the_gpu():
    from planner.hardware.load import load_cluster

    spec = _gpu_check().local_spec("cuda")
    assert load_cluster(spec, 1).gpu.memory_bytes > 0


@needs_cuda
def test_profile_on_cuda_records_memory(tmp_path):
    """The CUDA side of `plan --measure`: positive times per unit and size, the allocator's peak recorded."""
    from planner.measure.profile import profile_model
    from planner.pipeline import PlanRequest, load_request_model

    request = PlanRequest(model_path=str(ROOT / "sample_models" / "llama.py"), model_args={"layers": 2},
                          gpu="h100", global_batch_size=2, dtype="bf16")
    result = profile_model(load_request_model(request), [1, 2], "cuda", repeats=3, warmup=1, cache_dir=tmp_path)
    assert result.device == "cuda" and result.dtype == "bf16"
    assert {u.micro_batch_size for u in result.units} == {1, 2}
    assert all(u.fwd_s > 0 and u.bwd_s > 0 and (u.peak_memory_bytes or 0) > 0 for u in result.units)


@needs_cuda
def test_cuda_path_small_model(tmp_path):
    """The whole script on the GPU with a small Llama: plan --measure, calibrate, validate (reserved memory
    recorded by train.py), the grid."""
    text, doc = _run(tmp_path, "--device", "cuda", *SMALL, "--global-batch-size", "2", "--recompute", "none,full",
                     "--validate-steps", "3", "--quality-steps", "2", "--quick-calibration")
    _check_whole(text, doc, runs=4)
    validate = doc["validate"]
    assert validate["measured"]["memory_kind"] == "cuda_max_memory_allocated"
    allocated = max(validate["measured"]["peak_memory_bytes"].values())
    assert validate["peak_reserved_bytes"] >= allocated > 0
