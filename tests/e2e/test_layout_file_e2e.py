"""A plan whose module lists are too long for train.py's constants: they go to layout.json beside it, train.py
stays under 120 lines, checks the file's sha256 and trains like one process."""

from __future__ import annotations

import json
import math
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
WIDE = Path(__file__).with_name("wide_model.py")


def test_long_module_lists_train_from_layout_json(tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "plan", str(WIDE), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--dp", "2",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-2", "--out", str(out), "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert sum(len(s.modules) for s in plan.stages) == 240
    train_py = (out / "train.py").read_text()
    assert len(train_py.splitlines()) < 140 and 'LAYOUT_FILE = "layout.json"' in train_py
    assert "proj_aa" not in train_py and "proj_aa" in (out / "layout.json").read_text()
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    losses = [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]
    expected = [s["loss"] for s in train(reference_of(plan), tmp_path / "reference", 1)["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(expected, abs=1e-4)

    # An edited layout.json is refused at start, naming the file and the fix.
    (out / "layout.json").write_text((out / "layout.json").read_text().replace("proj_aa", "proj_zz"))
    edited = subprocess.run(
        [sys.executable, str(out / "train.py"), "--steps", "1", "--device", "cpu"], cwd=tmp_path, capture_output=True,
        text=True,
    )
    assert edited.returncode != 0
    assert "layout.json differs from the one this train.py was generated with" in edited.stderr
    assert "planner emit" in edited.stderr and "Traceback" not in edited.stderr
