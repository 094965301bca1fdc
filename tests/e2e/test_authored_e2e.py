"""A model as its author writes it, launched (issue 27): CLIP's 0-dim `logit_scale` is refused by FSDP2's
fully_shard, so the script keeps scalar parameters whole on every rank and averages their gradients over dp.
One small layout (dp4, ZeRO-1) on 4 CPU ranks, against one process over the same micro-batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e.plans import reference_of
from e2e.test_train_e2e import STEPS, run, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan

pytestmark = pytest.mark.e2e
CLIP = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "authored" / "clip_two_tower.py"


def test_scalar_parameter_launches_and_trains_like_one_process(tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, [
        "plan", str(CLIP), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8",
        "--dp", "4", "--zero-stage", "1", "--micro-batch-size", "2", "--lr", "1e-2", "--out", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    losses = [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]
    expected = [s["loss"] for s in train(reference_of(plan), tmp_path / "reference", 1)["steps"]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, abs=2e-5)
    assert losses[-1] < losses[0]
