"""train.py's train_step is the user's to edit: the run calls the edited step, and metrics.jsonl carries the
measured MFU and peak memory beside the plan's prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.plans import make_plan

from planner.codegen.render import write_scripts

pytestmark = pytest.mark.e2e


def _train(folder: Path, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "train.py", "--device", "cpu", *args], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_an_edited_train_step_is_the_one_that_runs(tmp_path):
    plan = make_plan("mlp", lr=1e-3)
    for name in ("as_written", "edited"):
        write_scripts(plan, tmp_path / name)
    train = tmp_path / "edited" / "train.py"
    text = train.read_text()
    default = "    loss = step.forward_backward()\n"
    assert default in text
    # an edit as people make them: a second look at the same batches before the update (loss doubled), and
    # no clipping; the runtime digest is unaffected (train.py is not part of it)
    edited = ("    loss = step.forward_backward()\n"
              "    loss = loss + step.forward_backward(step.batches)  # edited\n")
    train.write_text(text.replace(default, edited).replace("step.clip_gradients()", "step.grad_norm()"))
    written = _train(tmp_path / "as_written", "--steps", "2")
    edited_steps = _train(tmp_path / "edited", "--steps", "2")
    assert edited_steps[0]["loss"] == pytest.approx(2 * written[0]["loss"], rel=1e-6)
    # the doubled gradients show in the norm of the first step (same weights, same batches)
    assert edited_steps[0]["grad_norm"] == pytest.approx(2 * written[0]["grad_norm"], rel=1e-5)
    for record in written:
        assert record["predicted_step_time_s"] == pytest.approx(plan.predicted.iteration_time_s, rel=1e-3)
        assert record["predicted_mfu"] == pytest.approx(plan.predicted.mfu, rel=1e-3)
        assert record["mfu"] == pytest.approx(
            plan.predicted.mfu * record["predicted_step_time_s"] / record["step_time_s"], rel=1e-3
        )
        assert record["peak_memory_bytes"] > 0


def test_a_train_step_that_loses_the_loss_is_named(tmp_path):
    write_scripts(make_plan("mlp"), tmp_path)
    train = tmp_path / "train.py"
    train.write_text(train.read_text().replace("    return loss, grad_norm\n", "    return None, grad_norm\n"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--steps", "1"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "train_step returned no loss" in result.stderr, result.stderr[-3000:]


def test_tensorboard_gets_the_steps_where_it_is_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_scripts(make_plan("mlp"), tmp_path)
    steps = _train(tmp_path, "--steps", "2")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
    assert "train/mfu" in events.Tags()["scalars"]
