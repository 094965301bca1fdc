"""The pipeline schedule: torch.distributed.pipelining's schedule object for the plan's schedule name, and the
loss it calls on the last stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from .layout import Layout

# Schedule name -> (torch class, whether it runs several stages per rank).
SCHEDULE_CLASSES: dict[str, tuple[type, bool]] = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, True),
    "zero-bubble": (ScheduleZBVZeroBubble, True),
}


class PlannedStage(PipelineStage):
    """torch's PipelineStage, whose dynamic metadata run (the stage's forward on the first micro-batch's input
    shapes, before the schedule's first step) gets integer inputs of zeros: torch makes them with
    torch.empty, whose memory can hold any value, and a later stage's embedding (T5's and BART's decoder,
    which receive the token ids) indexed with it out of range at random."""

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        out: torch.Tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and not (out.is_floating_point() or out.is_complex()):
            with torch.no_grad():
                out.zero_()
        return out


class MicroBatchLoss:
    """The loss a pipeline schedule calls on the last stage.

    A schedule hands the loss one chunk of `target` per micro-batch; we make the target the micro-batch
    numbers (0 .. NUM_MICRO_BATCHES - 1), so the user's loss sees all inputs of that micro-batch.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.batches: list[tuple[torch.Tensor, ...]] = []
        self.scale = 1.0  # fp16's loss scale (the schedule's backward starts from the scaled loss)
        # id of each loss handed to the schedule -> (it, the loss before the scale): the schedule reports the
        # tensors it was given (and calls the loss once more for its shape inference on the first step)
        self.unscaled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, *self.batches[int(index)])
        scaled = loss * self.scale if self.scale != 1.0 else loss
        self.unscaled[id(scaled)] = (scaled, loss.detach())
        return scaled

    def before_scale(self, losses: list[torch.Tensor]) -> list[torch.Tensor]:
        """The losses the schedule reported, as they were before fp16's scale."""
        return [self.unscaled[id(x)][1] if id(x) in self.unscaled else x.detach() / self.scale for x in losses]


def build_schedule(layout: Layout, stages: Sequence[PipelineStage], loss: MicroBatchLoss) -> Any:
    """The schedule object running this rank's `stages` (one, or several for the multi-stage schedules)."""
    if layout.schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"Unknown schedule {layout.schedule!r}: expected one of {', '.join(SCHEDULE_CLASSES)}.")
    cls, multi = SCHEDULE_CLASSES[layout.schedule]
    return cls(stages if multi else stages[0], layout.num_micro_batches, loss_fn=loss)
