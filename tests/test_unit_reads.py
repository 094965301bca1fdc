"""FSDP units and the weights read outside them (planner.runtime.unit_reads), and the plan-time check wrapping the
model as written as the script wraps it (planner.runtime.check._run_data_parallel): a model with a scalar
parameter (CLIP's logit_scale) and an embedding whose weight is read again as the output matrix (Whisper's
logits) passes the check under every ZeRO stage, as it launches; and where the script's wrapping fails, the
check refuses the layout with the launch's error."""

from __future__ import annotations

import pytest
import torch
from e2e.plans import make_plan
from torch import nn

from planner.codegen.check import check_plan_runs
from planner.errors import LayoutRefusedError
from planner.runtime.stages import ModelStage
from planner.runtime.unit_reads import units_read_outside

# Module names as the mlp sample's (make_plan's stages list them); proj_in is a token embedding here.
MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab=32, width=64, layers=4):
        super().__init__()
        self.proj_in = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))  # 0-dim, as CLIP's

    def forward(self, tokens):
        h = self.proj_in(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        # the embedding's weight read again, outside the embedding, as Whisper's decoder computes its logits
        return (self.norm(h) @ self.proj_in.weight.T) * self.logit_scale.exp()


def build_model(**_):
    return Net()


def example_inputs(batch_size, **_):
    return (torch.randint(0, 32, (batch_size, 8)),)


def loss_fn(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
'''


def _net(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    scope: dict = {}
    exec(compile(MODEL, str(path), "exec"), scope)  # noqa: S102 - the test's own model source
    return path, scope


def _plan(tmp_path, **pins):
    path, _ = _net(tmp_path)
    plan = make_plan("mlp", **pins)
    return plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(path)})})


def test_a_weight_read_outside_its_unit_is_found(tmp_path):
    _, scope = _net(tmp_path)
    with torch.device("meta"):
        model = scope["build_model"]()
    stage = ModelStage(model, ["proj_in", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm"])
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert units_read_outside(model, stage.units(), (tokens,)) == ["proj_in"]
    # the blocks and the norm read their weights inside their own forward only
    plain = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8)).to("meta")
    assert units_read_outside(plain, list(plain), (tokens,)) == []


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_a_scalar_and_an_embedding_read_twice_pass_the_check_as_they_launch(tmp_path, zero_stage):
    assert check_plan_runs(_plan(tmp_path, dp=2, zero_stage=zero_stage)) == "module"


def test_the_check_wraps_the_model_as_the_script_does(tmp_path, monkeypatch):
    """Were the script to give the embedding its own FSDP unit, ZeRO-3 would free its weight before the logits read
    it: the check wraps with the script's own parallelize() and meets that launch error as a refused layout."""
    monkeypatch.setattr(ModelStage, "sharded_units", ModelStage.units)
    with pytest.raises(LayoutRefusedError, match=r"ZeRO-3\).*mixed torch.Tensor and DTensor"):
        check_plan_runs(_plan(tmp_path, dp=2, zero_stage=3))
    assert check_plan_runs(_plan(tmp_path, dp=2, zero_stage=1)) == "module"  # weights kept after forward
