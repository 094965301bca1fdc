"""nn.Linear subclasses with a forward of their own (Falcon's FalconLinear) and row-parallel outputs the model
changes in place (Falcon's `mlp_output += attention_output`): tensor parallelism pairs the first when they compute
the linear map, and gives the second as a copy (TP_COPIED), only where the model's code writes in place."""

from __future__ import annotations

import json
import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan
from planner.runtime.linears import computes_linear
from planner.runtime.tracers import IN_PLACE, BufferTracer, meta_trace


class XWeightT(nn.Linear):
    """Falcon's FalconLinear, as transformers writes it."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hidden_states = input @ self.weight.T
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias


class Scaled(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight.T * 2.0


class WithAdapter(nn.Linear):
    """A LoRA-style layer: the linear map plus a low-rank update from parameters of its own."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__(fin, fout)
        self.lora_a = nn.Linear(fin, 2, bias=False)
        self.lora_b = nn.Linear(2, fout, bias=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias) + self.lora_b(self.lora_a(input))


class Plain(nn.Linear):
    pass


def test_a_subclass_is_a_linear_only_where_its_forward_computes_the_linear_map():
    assert computes_linear(nn.Linear(4, 3))
    assert computes_linear(XWeightT(4, 3)) and computes_linear(XWeightT(4, 3, bias=False))
    assert computes_linear(XWeightT(4, 3, device="meta"))  # compared on a stand-in, whatever the weight's device
    assert computes_linear(Plain(4, 3))
    assert not computes_linear(Scaled(4, 3))
    assert not computes_linear(WithAdapter(4, 3))
    assert not computes_linear(nn.Conv1d(4, 3, 1))


class Block(nn.Module):
    def __init__(self, linear: type[nn.Linear], in_place: bool) -> None:
        super().__init__()
        self.up = linear(8, 16)
        self.down = linear(16, 8)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        if self.in_place:
            y += x
        else:
            y = y + x
        return y


@pytest.mark.parametrize("tracer", ["fx", "fx-meta"])
def test_linear_subclasses_stay_calls_and_in_place_updates_are_marked(tracer):
    model = Block(XWeightT, in_place=True)
    if tracer == "fx":
        graph = BufferTracer().trace(model)
    else:
        graph = meta_trace(model.to("meta"), (torch.empty(2, 8, device="meta"),))
    calls = [n.target for n in graph.nodes if n.op == "call_module"]
    assert calls == ["up", "down"]
    (add,) = [n for n in graph.nodes if n.target is operator.add]
    assert add.meta.get(IN_PLACE) and add.args[0].target == "down"  # the graph is the same: operator.add
    out_of_place = BufferTracer().trace(Block(XWeightT, in_place=False))
    assert not any(n.meta.get(IN_PLACE) for n in out_of_place.nodes)
    traced_through = BufferTracer().trace(Block(Scaled, in_place=False))
    assert not any(n.op == "call_module" for n in traced_through.nodes)


MODEL = """
import torch
from torch import nn
from HELPER import Block, LINEAR


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.blocks = nn.ModuleList(Block(LINEAR, IN_PLACE) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean()


def build_model():
    return Net()


def example_inputs(batch_size=2):
    return (torch.randint(0, 64, (batch_size, 16)),)
"""


def plan_tp2(tmp_path, linear: str, in_place: bool):
    tmp_path.mkdir(exist_ok=True)
    name = f"linear_subclasses_{linear.lower()}_{int(in_place)}"  # a module of its own: imports are cached
    helper = tmp_path / f"{name}.py"
    helper.write_text(Path(__file__).read_text().split("MODEL = ")[0] + f"\nLINEAR = {linear}\n")
    path = tmp_path / "net.py"
    path.write_text(MODEL.replace("IN_PLACE)", f"{in_place})").replace("HELPER", name))
    out = tmp_path / "out"
    args = ["plan", str(path), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "4",
            "--tp", "2", "--out", str(out), "--quiet"]
    return CliRunner().invoke(app, args), out


def test_an_output_changed_in_place_is_copied_and_only_that(tmp_path):
    """The plan-time check runs the model as written with TP applied: without the copy, `y += x` on the
    row-parallel output fails there (autograd refuses an in-place change of the view RowwiseParallel returns)."""
    result, out = plan_tp2(tmp_path, "XWeightT", True)
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp_plan"]["blocks.0.up"] == "colwise" and plan["tp_plan"]["blocks.1.down"] == "rowwise"
    assert plan["tp_copied"] == ["blocks.0.down", "blocks.1.down"] and plan["schema_minor"] == 6
    assert 'TP_COPIED = ["blocks.0.down", "blocks.1.down"]' in (out / "train.py").read_text()
    assert load_plan(out).tp.copied == ["blocks.0.down", "blocks.1.down"]  # read back
    result, out = plan_tp2(tmp_path / "out_of_place", "XWeightT", False)
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert "tp_copied" not in plan and plan["schema_minor"] < 6  # other plans as they were
    assert "TP_COPIED" not in (out / "train.py").read_text()


def test_a_subclass_that_is_no_linear_map_is_refused_with_its_reason(tmp_path):
    result, out = plan_tp2(tmp_path, "Scaled", False)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "blocks.0.up is not sharded: it is a Scaled, a subclass of nn.Linear with a forward of its own" in message
    assert not out.exists()
