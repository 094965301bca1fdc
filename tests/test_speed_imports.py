"""Planning on the meta device does not import torch._dynamo (nor torch.distributed.pipelining, DTensor or
FSDP): the meta kernels' lazy dynamo import is answered by planner.runtime.meta, the runtime's loop imports the
pipeline code only when it trains, and the plan-time check takes the TP rules and checkpointing from modules
that do not import torch.distributed's. The `planner` process runs no full garbage collection while it plans (cli.main's
GC_THRESHOLDS). Pins the behaviour, not the time (the time is bench/search_speed.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Modules planning and checking on meta do without: the compiler stack, the pipeline schedules, DTensor and FSDP.
HEAVY = ("torch._dynamo", "torch.distributed.pipelining", "torch.distributed.tensor", "torch.distributed.fsdp")
PLAN = """
import json, sys
from planner.pipeline import PlanRequest, plan_model
from planner.codegen.check import check_plan_runs
for model, args, pins in json.loads(sys.argv[1]):
    request = PlanRequest(model_path=model, model_args=args, gpu="a100-sxm-80gb", nodes=1, global_batch_size=8,
                          pins=pins)
    check_plan_runs(plan_model(request)[0])
print(json.dumps({m: m in sys.modules for m in json.loads(sys.argv[2])}))
"""


def test_planning_and_checking_on_meta_imports_no_dynamo():
    # A GPT pipeline (pp 2: the check traces and runs the stages on meta, as for full-size models) and a
    # non-transformer, planned and checked in one process.
    cases = [
        [str(ROOT / "sample_models" / "gpt.py"), {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128},
         {"pp": 2}],
        [str(ROOT / "sample_models" / "mlp.py"), {"layers": 4, "width": 64}, {}],
    ]
    env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PLAN, json.dumps(cases), json.dumps(HEAVY)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == dict.fromkeys(HEAVY, False)


def test_the_patched_kernels_go_through_dynamo_disable_once_dynamo_is_imported():
    """Exactly torch's behaviour after torch._dynamo is imported: the meta kernel runs under its disable."""
    code = """
import sys, torch
from planner.runtime.meta import meta_without_dynamo
assert meta_without_dynamo() > 0
a = torch.empty(2, 3, device="meta")
assert (a + a).shape == (2, 3) and "torch._dynamo" not in sys.modules
import torch._dynamo
calls = []
real = torch._dynamo.disable
def spy(fn, recursive=True, wrapping=True):
    calls.append(fn)
    return real(fn, recursive, wrapping=wrapping)
torch._dynamo.disable = spy
assert torch.nn.functional.gelu(a * 2).shape == (2, 3)
assert calls, "after torch._dynamo is imported the kernels are wrapped by torch._dynamo.disable"
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_meta_results_are_unchanged_by_the_patch():
    from planner.runtime.meta import meta_without_dynamo

    meta_without_dynamo()
    x = torch.empty(4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = torch.nn.functional.layer_norm(torch.nn.functional.gelu(x) + x.float(), (8,)).softmax(-1)
    assert y.shape == (4, 8) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (4, 8) and x.grad.dtype == torch.bfloat16


GC_COUNT = """
import atexit, gc, sys
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
atexit.register(lambda: print("full collections", len(full)))
sys.argv = ["planner", *sys.argv[1:]]
from cli.main import main
main()
"""


def test_the_planner_process_runs_no_full_garbage_collection(tmp_path):
    """With Python's default thresholds this plan (imports included) runs about five full collections."""
    args = ["plan", str(ROOT / "sample_models" / "gpt.py"), "--gpu", "a100-sxm-80gb", "--nodes", "1",
            "--global-batch-size", "8", "--out", str(tmp_path / "out"), "--quiet"]
    for arg in ("layers=2", "hidden=64", "heads=4", "seq=32", "vocab=128"):
        args += ["--model-arg", arg]
    env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", GC_COUNT, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "plan.json").exists()
    assert done.stdout.strip().splitlines()[-1] == "full collections 0"
