"""torchtitan's Llama 3 debugmodel (torchtitan:llama3 --flavor debugmodel, blocks in a ModuleDict), planned
by `planner plan` for 4 CPU ranks; the generated launch.sh trains 3 steps and the loss equals a
single-process run of the same micro-batches within 1e-4, for dp4, pp2 x dp2 and tp2 x dp2."""

from __future__ import annotations

import json
import math

import pytest
from e2e.plans import reference_of
from e2e.test_train_e2e import STEPS, run, train
from typer.testing import CliRunner

from cli.main import app
from planner.plan import load_plan

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.e2e

CASES = {
    "dp4": ["--dp", "4"],
    "pp2_dp2": ["--pp", "2", "--dp", "2", "--schedule", "1f1b"],
    "tp2_dp2": ["--tp", "2", "--dp", "2"],
}


def plan_titan(out, *pins: str):
    return CliRunner().invoke(
        app,
        [
            "plan", "torchtitan:llama3", "--flavor", "debugmodel", "-a", "seq=32", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "4", "--global-batch-size", "8", "--micro-batch-size", "2", *pins, "--lr", "1e-3",
            "--out", str(out), "--quiet",
        ],
    )


@pytest.mark.parametrize("case", list(CASES))
def test_titan_llama3_trains_like_one_process(case, tmp_path):
    out = tmp_path / "plan"
    result = plan_titan(out, *CASES[case])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.parallel.world_size == 4
    if plan.parallel.tp > 1:
        # What the cost model split is what the script shards: attention (the fused qkv, its heads kept
        # apart through the complex rotary table), the MLP, the vocabulary-parallel embedding and LM head.
        assert not plan.tp_refused, plan.tp_refused
        for name in ("tok_embeddings", "layers.0.attention.qkv_linear.wqkv", "layers.0.attention.wo", "lm_head"):
            assert name in plan.tp_plan, (name, sorted(plan.tp_plan))
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    expected = train(reference_of(plan), tmp_path / "reference", 1)
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx([s["loss"] for s in expected["steps"]], abs=1e-4), (case, losses)
