"""The optimizer set-up, as torchtitan builds it: AdamW per stage (a pipeline rank may hold several stages;
Adam is per parameter, so one optimizer each trains as one over all of them and checkpoints under the model's
own names), a learning rate that warms up linearly and then decays (cosine or linear) to a floor, and the
gradients clipped to a global norm computed over every parallel group (loop.grad_norm)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import Training


def lr_factor(training: Training, total_steps: int) -> Callable[[int], float]:
    """The multiplier of LR at step s (0-based): (s + 1) / (warmup + 1) during warm-up (torchtitan's ramp,
    never 0), then a decay from 1 to MIN_LR_RATIO over the remaining steps."""
    warmup = training.warmup_steps
    decay_steps = max(1, total_steps - warmup)
    floor = training.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / decay_steps)
        if training.lr_decay == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if training.lr_decay == "linear":
            return floor + (1 - floor) * (1 - progress)
        return 1.0

    return factor


def build_optimizers(
    stages: Sequence[nn.Module], training: Training, total_steps: int
) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LambdaLR]]:
    """One AdamW and its LambdaLR schedule per stage."""
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(
            [p for p in stage.parameters() if p.requires_grad], lr=training.lr, betas=training.betas,
            eps=training.eps, weight_decay=training.weight_decay,
        )
        for stage in stages
    ]
    factor = lr_factor(training, total_steps)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]
    return optimizers, schedulers


def clip_gradients(params: Sequence[nn.Parameter], max_norm: float | None, total_norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / total_norm where the global norm exceeds max_norm (torchtitan's
    clip_grad_norm_: the norm is the whole model's, over every stage and shard, so each rank scales alike)."""
    if max_norm is None or max_norm <= 0:
        return
    # One call per layout of the gradients: a foreach over DTensors of different meshes (a TP weight on (dp, tp),
    # a replicated norm on dp) is refused, as grad_norm groups them too.
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)


class LossScale:
    """Dynamic loss scaling for fp16 (torch.amp.GradScaler's rule, as Megatron-LM's DynamicGradScaler): the loss
    is multiplied by `scale` before backward so small fp16 gradients do not flush to zero; the gradients are
    divided by it before the norm and the optimizer. A step whose gradients hold an inf or nan on any rank is
    skipped everywhere (no optimizer or schedule step) and the scale halves; after `growth_interval` good steps
    in a row it doubles. Powers of two, so scaling and unscaling are exact. Disabled (scale 1, never skips)
    for bf16 and fp32."""

    def __init__(
        self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000, min_scale: float = 1.0
    ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.found_inf = False

    def unscale_(self, params: Sequence[nn.Parameter], group: Any = None) -> bool:
        """Divide every gradient by the scale and find infs/nans; the verdict is agreed over `group` (every
        rank: a step is skipped by all or by none). Returns whether this step is skipped."""
        self.found_inf = False
        if not self.enabled:
            return False
        grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params if p.grad is not None]
        bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=group)
        self.found_inf = bool(bad.item())
        return self.found_inf

    def update(self) -> None:
        """After the step: halve on a skipped step, double after growth_interval good ones."""
        if not self.enabled:
            return
        if self.found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= 2
                self.good_steps = 0

    def state(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: dict[str, float] | None) -> None:
        if self.enabled and state:
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
