"""fp16 trains with dynamic loss scaling: scaled by a power of two and unscaled before the norm, so on CPU
(where the run computes in fp32) an fp16 run equals an fp32 one exactly, with and without a pipeline; an
overflowing step is skipped on every rank (no update, the schedule not advanced) and the scale halves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.plans import make_plan

from planner.codegen.render import write_scripts
from planner.plan import Plan

pytestmark = pytest.mark.e2e
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _fp16(plan: Plan) -> Plan:
    return plan.model_copy(update={"training": plan.training.model_copy(update={"dtype": "fp16"})})


def _train(plan: Plan, folder: Path, edit: tuple[str, str] | None = None) -> list[dict]:
    write_scripts(plan, folder)
    if edit is not None:
        text = (folder / "train.py").read_text()
        assert edit[0] in text
        (folder / "train.py").write_text(text.replace(edit[0], edit[1]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    world = plan.parallel.world_size
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={world}", "train.py"] if world > 1 else [sys.executable,
                                                                                                "train.py"]
    result = subprocess.run([*cmd, "--device", "cpu", "--steps", "3"], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layout", ["dp2", pytest.param("pp2", marks=pytest.mark.corpus)])
def test_fp16_with_loss_scaling_trains_like_fp32(layout, tmp_path):
    plan = make_plan("gpt", dp=2) if layout == "dp2" else make_plan("gpt", pp=2, num_micro_batches=4)
    fp32 = _train(plan, tmp_path / "fp32")
    fp16 = _train(_fp16(plan), tmp_path / "fp16")
    assert [r["loss_scale"] for r in fp16] == [2.0**16] * 3 and not any(r["skipped"] for r in fp16)
    assert "loss_scale" not in fp32[0]
    for a, b in zip(fp32, fp16, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]


def test_an_overflowing_step_is_skipped_and_the_scale_halves(tmp_path):
    """train_step edited to force an overflow on the first step: that step is skipped on both pipeline ranks (no update,
    the schedule not advanced) and the scale halves; training then goes on."""
    plan = _fp16(make_plan("gpt", pp=2, num_micro_batches=4))  # the pipeline's scaled losses
    edit = ("    loss = step.forward_backward()\n",
            "    if step.number == 0:\n        step.loss_scale.scale = 2.0**140  # overflows fp32\n"
            "    if step.number == 1:\n        assert step.loss_scale.scale == 2.0**139, step.loss_scale.scale\n"
            "        step.loss_scale.scale = 2.0**16\n"
            "    loss = step.forward_backward()\n")
    steps = _train(plan, tmp_path, edit)
    assert [r["skipped"] for r in steps] == [True, False, False]
    assert [r["loss_scale"] for r in steps] == [2.0**140, 2.0**16, 2.0**16]
    # the skipped step left the schedule at step 0 (cosine from LR: factor 1), the next one advanced it
    assert steps[0]["lr"] == plan.training.lr and steps[1]["lr"] < plan.training.lr
    assert all(isinstance(r["loss"], float) for r in steps), steps  # the skipped step's loss is the unscaled one
    assert steps[0]["grad_norm"] is None  # an overflow's norm is not a number: null in strict JSON
