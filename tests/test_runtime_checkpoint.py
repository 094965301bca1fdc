"""The runtime's checkpoint bookkeeping (which folder a run resumes from, the model's own names for a stage's
keys) and the optimizer set-up (the learning-rate schedule, clipping); the saves and loads themselves run in
tests/e2e/test_checkpoint_e2e.py."""

from __future__ import annotations

import math

import pytest
import torch

from planner.runtime.checkpoint import COMPLETE, latest, model_key, optimizer_key, step_dir, write_marker
from planner.runtime.errors import LayoutError, RunError
from planner.runtime.layout import Training
from planner.runtime.optim import clip_gradients, lr_factor


def _checkpoint(folder, step, complete):
    path = step_dir(folder, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"data")
    if complete:
        write_marker(path, {"step": step})
    return path


def test_latest_skips_a_save_that_never_finished_and_says_so(tmp_path):
    _checkpoint(tmp_path, 2, True)
    four = _checkpoint(tmp_path, 4, True)
    six = _checkpoint(tmp_path, 6, False)  # killed half-way: files but no marker
    (tmp_path / "notes").mkdir()
    found = latest(tmp_path)
    assert found.path == four and found.skipped == (six,)
    message = found.skipped_message()
    assert message is not None and str(six) in message and COMPLETE in message
    assert not list(four.glob(".*.tmp"))  # the marker's temporary name is gone


def test_latest_of_a_checkpoint_is_itself_and_an_incomplete_one_is_refused(tmp_path):
    two = _checkpoint(tmp_path, 2, True)
    assert latest(two).path == two and latest(two).skipped_message() is None
    four = _checkpoint(tmp_path, 4, False)
    with pytest.raises(RunError, match="not a complete checkpoint"):
        latest(four)
    assert latest(tmp_path / "missing").path is None


def test_steps_are_ordered_by_number_not_by_name(tmp_path):
    _checkpoint(tmp_path, 99, True)
    (tmp_path / "step-100").mkdir()
    write_marker(tmp_path / "step-100", {"step": 100})
    assert latest(tmp_path).path == tmp_path / "step-100"


def test_stage_keys_become_the_models_names():
    assert model_key("pieces.1.blocks.3.attn.q.weight") == "blocks.3.attn.q.weight"
    assert model_key("model.blocks.3.attn.q.weight") == "blocks.3.attn.q.weight"
    assert model_key("model.model.layers.0.weight") == "model.layers.0.weight"  # only the stage's own prefix
    assert optimizer_key("state.pieces.0.tok_emb.weight.exp_avg") == "state.tok_emb.weight.exp_avg"
    assert optimizer_key("param_groups.model.head.weight.lr") == "param_groups.head.weight.lr"


def test_learning_rate_warms_up_then_decays_to_its_floor():
    cosine = lr_factor(Training(warmup_steps=2, lr_decay="cosine", min_lr_ratio=0.1), total_steps=12)
    assert [cosine(0), cosine(1)] == pytest.approx([1 / 3, 2 / 3])
    assert cosine(2) == pytest.approx(1.0)
    assert cosine(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert cosine(12) == pytest.approx(0.1) and cosine(50) == pytest.approx(0.1)
    linear = lr_factor(Training(lr_decay="linear", min_lr_ratio=0.0), total_steps=10)
    assert [linear(0), linear(5), linear(10)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor(Training(lr_decay="constant"), 10)(9) == 1.0


def test_training_refuses_knobs_out_of_range():
    with pytest.raises(LayoutError, match="LR_DECAY"):
        Training(lr_decay="step")
    with pytest.raises(LayoutError, match="GRAD_CLIP"):
        Training(grad_clip=0.0)
    with pytest.raises(LayoutError, match="MIN_LR_RATIO"):
        Training(min_lr_ratio=2.0)


def test_clipping_scales_gradients_to_the_global_norm():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    total = torch.tensor(10.0)  # the whole model's norm, larger than this rank's share (5)
    clip_gradients([a, b], 1.0, total)
    assert a.grad.tolist() == pytest.approx([0.3, 0.0], rel=1e-5) and b.grad.item() == pytest.approx(0.4, rel=1e-5)
    clip_gradients([a, b], None, total)  # off
    assert b.grad.item() == pytest.approx(0.4, rel=1e-5)
