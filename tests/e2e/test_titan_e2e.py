"""torchtitan's Llama 3 debugmodel (torchtitan:llama3 --flavor debugmodel, blocks in a ModuleDict), planned
by `planner plan` for 4 CPU ranks; the generated launch.sh trains 3 steps and the loss equals a
single-process run of the same micro-batches within 1e-4."""

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


# Known bug, not yet fixed: the tp2 x dp2 plan is written but its script fails in torchtitan's embedding
# ("aten.embedding.default got mixed torch.Tensor and DTensor"): the runtime's TP leaves a DTensor weight the
# token ids never meet. strict: the test fails once it trains, so the mark is removed then.
KNOWN_FAILING = {"tp2_dp2": "runtime TP: torchtitan Embedding gets a DTensor weight and plain token ids"}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FAILING[c])) if c in KNOWN_FAILING else c
        for c in CASES
    ],
)
def test_titan_llama3_trains_like_one_process(case, tmp_path):
    out = tmp_path / "plan"
    result = plan_titan(out, *CASES[case])
    if result.exit_code == 2:  # refused before writing anything, with the reason
        assert not out.exists(), result.output
        assert "tensor parallel" in result.output or "pipeline" in result.output, result.output
        pytest.xfail(f"{case} refused by the planner: {result.output.strip()[:300]}")
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.parallel.world_size == 4
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    expected = train(reference_of(plan), tmp_path / "reference", 1)
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx([s["loss"] for s in expected["steps"]], abs=1e-4), (case, losses)
