"""The whole product path: `planner plan` a sample GPT for 4 CPU ranks (pp=2 x dp=2), run the generated
launch.sh with torchrun (gloo), and check the losses equal a single-process run with gradient accumulation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.plans import reference_of
from e2e.test_train_e2e import STEPS, run, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_planned_pp2_dp2_trains_like_one_process(tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "plan", str(ROOT / "sample_models" / "gpt.py"), "--model-arg", "layers=4", "--model-arg", "hidden=64",
            "--model-arg", "seq=32", "--model-arg", "vocab=256", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "4", "--global-batch-size", "8", "--pp", "2", "--dp", "2", "--micro-batch-size", "2",
            "--schedule", "1f1b", "--lr", "3e-3", "--out", str(out), "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    p = plan.parallel
    assert (p.pp, p.dp, p.tp, p.schedule, p.num_micro_batches) == (2, 2, 1, "1f1b", 2)
    assert len(plan.stages) == 2 and all(s.units for s in plan.stages)

    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    expected = train(reference_of(plan), tmp_path / "reference", 1)
    losses = [s["loss"] for s in metrics["steps"]]
    ref_losses = [s["loss"] for s in expected["steps"]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert losses[-1] < losses[0]  # it really trains


def test_gpt3_175b_plans_on_meta_without_allocating_weights(tmp_path):
    """175B parameters (350 GB in bf16) are planned for 1024 A100s in a process that stays small."""
    code = (
        "import json, resource, sys\n"
        "from planner.pipeline import PlanRequest, plan_model\n"
        f"req = PlanRequest(model_path={str(ROOT / 'sample_models' / 'gpt.py')!r}, "
        "model_args={'preset': 'gpt3-175b'}, gpu='a100-sxm-80gb', nodes=128, global_batch_size=1536, "
        "pins={'tp': 8, 'pp': 16, 'micro_batch_size': 1, 'schedule': '1f1b'})\n"
        "plan, graph, _ = plan_model(req)\n"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(json.dumps({'params': graph.total_params, 'rss': rss, 'stages': len(plan.stages),"
        " 'world': plan.parallel.world_size, 'mem': plan.predicted.peak_memory_bytes,"
        " 'cap': plan.predicted.memory_capacity_bytes}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["params"] > 170e9
    assert got["rss"] < 4 * 2**30  # the weights alone would be 350 GB
    assert got["stages"] == 16 and got["world"] == 1024
    assert got["mem"] <= got["cap"]
