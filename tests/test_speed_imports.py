"""Planning on the meta device does not import torch._dynamo (nor torch.distributed.pipelining, DTensor or
FSDP): the meta kernels' lazy dynamo import is answered by planner.runtime.meta, the runtime's loop imports the
pipeline code only when it trains, and the plan-time check takes the TP rules and checkpointing from modules
that do not import torch.distributed's. The `planner` process runs no full garbage collection while it plans
(planner.cli.main's GC_THRESHOLDS). Pins the behaviour, not the time (the time is bench/search_speed.py's)."""

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
        # zero-bubble: the check splits each stage's backward with torch's own functions, loaded from their file
        # (runtime/check.py::_split_backward_functions), not through torch.distributed.pipelining's __init__
        [str(ROOT / "sample_models" / "gpt.py"), {"layers": 4, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128},
         {"pp": 2, "schedule": "zero-bubble"}],
    ]
    env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PLAN, json.dumps(cases), json.dumps(HEAVY)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == dict.fromkeys(HEAVY, False)


def test_a_model_without_a_mamba_mixer_never_loads_the_fused_kernels():
    """planner.model.kernels defines custom ops when imported: only a model with a Mamba mixer loads it (the
    analysis, the count and the check reach it through planner.model.fused)."""
    cases = [
        [str(ROOT / "sample_models" / "gpt.py"), {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128},
         {"pp": 2}],
        [str(ROOT / "sample_models" / "mlp.py"), {"layers": 4, "width": 64}, {}],
    ]
    env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    watched = ["planner.model.kernels", "planner.model.fused", "planner.runtime.stages"]
    done = subprocess.run([sys.executable, "-c", PLAN, json.dumps(cases), json.dumps(watched)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == {"planner.model.kernels": False, "planner.model.fused": True, "planner.runtime.stages": True}


def test_a_tensor_parallel_plan_is_checked_without_dynamo():
    """The TP check shards the stages with DTensor over a fake process group on meta: DTensor is imported, the
    compiler stack is not (planner.runtime.meta.dtensor_on_meta; 0.3 s of GPT-3 175B's plan)."""
    gpt = str(ROOT / "sample_models" / "gpt.py")
    cases = [
        [gpt, {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128}, {"tp": 2, "pp": 1}],  # the model
        [gpt, {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128},
         {"tp": 2, "pp": 2, "sequence_parallel": True}],  # traced stages, rewritten for SP
    ]
    env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PLAN, json.dumps(cases), json.dumps(HEAVY)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported["torch.distributed.tensor"], "the check did not shard anything: the test tests nothing"
    assert not imported["torch._dynamo"]


DTENSOR_META = """
import json, sys, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from planner.runtime.meta import dtensor_on_meta

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (4,))
prop = DTensor._op_dispatcher.sharding_propagator
seen = []
real = prop.propagate_op_sharding_non_cached  # calls the (patched) _propagate_tensor_meta_non_cached
def spy(schema):
    out = real(schema)
    seen.append((str(schema.op), repr(out.output_spec)))  # placements and the global TensorMeta
    return out
prop.propagate_op_sharding_non_cached = spy

def ops():
    x = distribute_tensor(torch.empty(8, 16, 12, device="meta"), mesh, [Shard(1)])
    w = distribute_tensor(torch.empty(12, 20, device="meta", dtype=torch.bfloat16), mesh, [Replicate()])
    y = (x.to(torch.bfloat16) @ w).view(8, 16, 4, 5).transpose(1, 2)
    z = torch.nn.functional.softmax(y.float(), -1).split(2, dim=-1)
    return [tuple(t.shape) for t in z] + [tuple(y.stride())]

inside = sys.argv[1] == "meta"
if inside:
    with dtensor_on_meta():
        shapes = ops()
else:
    shapes = ops()
print(json.dumps({"shapes": shapes, "props": seen, "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_dtensor_shape_propagation_on_meta_matches_torchs_fake_tensor_mode():
    """dtensor_on_meta derives each op's global output metadata on meta: the same shapes, strides and dtypes
    as torch's FakeTensorMode path, op by op, and no torch._dynamo import."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {}
    for how in ("meta", "torch"):
        done = subprocess.run([sys.executable, "-c", DTENSOR_META, how], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[how] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["meta"]["props"], "no op's metadata was propagated: the test tests nothing"
    assert runs["meta"]["shapes"] == runs["torch"]["shapes"]
    assert runs["meta"]["props"] == runs["torch"]["props"]
    assert not runs["meta"]["dynamo"] and runs["torch"]["dynamo"]


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
from planner.cli.main import main
main()
"""


def _plan_small_gpt(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    """`planner plan` of a small GPT into `out`, run by `script` (which calls planner.cli.main's main)."""
    args = ["plan", str(ROOT / "sample_models" / "gpt.py"), "--gpu", "a100-sxm-80gb", "--nodes", "1",
            "--global-batch-size", "8", "--out", str(out), "--quiet"]
    for arg in ("layers=2", "hidden=64", "heads=4", "seq=32", "vocab=128"):
        args += ["--model-arg", arg]
    env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_the_planner_process_runs_no_full_garbage_collection(tmp_path):
    """With Python's default thresholds this plan (imports included) runs about five full collections."""
    done = _plan_small_gpt(GC_COUNT, tmp_path / "out")
    assert (tmp_path / "out" / "plan.json").exists()
    assert done.stdout.strip().splitlines()[-1] == "full collections 0"


GC_LOAD = """
import atexit, gc, json, sys
stops = []
gc.callbacks.append(lambda phase, info: stops.append(1) if phase == "stop" else None)
import planner.processes as processes
seen = {}
loaded = processes.model_loaded
def model_loaded():
    seen.setdefault("before", [len(stops) - seen["start"], gc.isenabled()])
    loaded()
    seen.setdefault("after", [gc.isenabled(), gc.get_freeze_count() > 0])
processes.model_loaded = model_loaded
atexit.register(lambda: print(json.dumps(seen)))
sys.argv = ["planner", *sys.argv[1:]]
from planner.cli.main import main
seen["start"] = len(stops)
main()
"""


def test_no_collection_runs_while_the_model_is_imported_and_built_and_then_the_collector_is_back(tmp_path):
    """planner.processes.defer_collection: the `planner` process collects nothing until the model is loaded and
    built; then what it holds is frozen and the collector runs again (the analysis and search make garbage)."""
    seen = json.loads(_plan_small_gpt(GC_LOAD, tmp_path / "out").stdout.strip().splitlines()[-1])
    assert seen["before"] == [0, False]  # no collection from the command's start to the model's load
    assert seen["after"] == [True, True]  # then frozen, and collecting again
