"""planner.runtime.schedule: the plan's schedule name picks torch's schedule class, with this rank's stages."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from planner.runtime import Layout, stage_rank
from planner.runtime.names import SCHEDULES
from planner.runtime.schedule import SCHEDULE_CLASSES, MicroBatchLoss, build_schedule


class _Recorder:
    """Stands in for a torch schedule class: records how build_schedule constructs it."""

    def __init__(self, stages, n_microbatches, loss_fn):
        self.stages, self.n, self.loss_fn = stages, n_microbatches, loss_fn


def test_every_schedule_name_has_a_torch_class():
    assert set(SCHEDULE_CLASSES) == set(SCHEDULES)
    assert SCHEDULE_CLASSES["gpipe"] == (ScheduleGPipe, False)
    assert SCHEDULE_CLASSES["1f1b"] == (Schedule1F1B, False)
    assert SCHEDULE_CLASSES["interleaved-1f1b"] == (ScheduleInterleaved1F1B, True)
    assert SCHEDULE_CLASSES["zero-bubble"] == (ScheduleZBVZeroBubble, True)


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_build_schedule_passes_one_or_all_local_stages(schedule, v, monkeypatch):
    stages = [(stage_rank(schedule, 2, s), [f"m{s}"], "none") for s in range(2 * v)]
    layout = Layout(pp=2, dp=1, tp=1, micro_batch_size=1, num_micro_batches=4, virtual_stages=v,
                    schedule=schedule, stages=stages)
    cls, multi = SCHEDULE_CLASSES[schedule]
    monkeypatch.setitem(SCHEDULE_CLASSES, schedule, (_Recorder, multi))
    local = ["stage a", "stage b"][:v]
    loss = MicroBatchLoss(lambda out, *inputs: out)
    made = build_schedule(layout, local, loss)
    assert made.stages == (local if v == 2 else local[0]) and made.n == 4 and made.loss_fn is loss


def test_the_loss_sees_every_input_of_its_micro_batch():
    loss = MicroBatchLoss(lambda out, x, y: (out * x + y).sum())
    loss.batches = [(torch.tensor(1.0), torch.tensor(0.0)), (torch.tensor(2.0), torch.tensor(10.0))]
    assert loss(torch.tensor(3.0), torch.tensor(1)).item() == 16.0
