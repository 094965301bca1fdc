"""planner.runtime.parallel without a process group: the TP plan's checks, head-count attributes divided by
tp, and the model-as-written stage whose planned modules are the checkpoint / FSDP units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.runtime import Layout, RunError
from planner.runtime.parallel import Recompute, apply_ac, apply_head_attrs, check_tp
from planner.runtime.stages import ModelStage


class Attention(nn.Module):
    """Reshapes by an absolute head count, as torchtitan's and many hand-written models do."""

    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _layout(tp, tp_plan=None, heads=None):
    return Layout(pp=1, dp=1, tp=tp, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["attn", "head"])],
                  tp_plan=tp_plan or {}, tp_head_attrs=heads or {})


def test_head_attributes_are_divided_by_tp():
    net = Net()
    layout = _layout(2, {"attn.qkv": "colwise", "attn.o": "rowwise"}, {"attn": ["heads"]})
    check_tp([net], layout)
    apply_head_attrs([net], layout)
    assert net.attn.heads == 2


@pytest.mark.parametrize(
    ("tp", "plan", "heads", "message"),
    [
        (3, {"attn.o": "rowwise"}, {}, r"splits attn.o \(rowwise, size 8\) over tp=3"),
        (2, {}, {"attn": ["heads", "missing"]}, r"attn.missing, which is NoneType, not a head count"),
        (8, {}, {"attn": ["heads"]}, r"attn.heads = 4 heads cannot be split over tp=8"),
        (2, {"attn": "colwise"}, {}, r"shards attn, a Attention \(colwise\), but torch's ColwiseParallel"),
    ],
)
def test_tp_decisions_that_cannot_apply_are_refused(tp, plan, heads, message):
    with pytest.raises(RunError, match=message):
        check_tp([Net()], _layout(tp, plan, heads))


def test_a_model_stage_runs_the_model_and_checkpoints_its_planned_modules():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 5, 8)
    want = net(x)
    stage = ModelStage(net, ["attn", "head", "not-a-module"])
    assert stage.names == ["attn", "head"]
    apply_ac(stage, "full", "1f1b")
    assert isinstance(net.attn, Recompute) and isinstance(net.head, Recompute)
    got = stage(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert net.attn.inner.qkv.weight.grad is not None
