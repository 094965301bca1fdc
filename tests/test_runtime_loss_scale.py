"""fp16's dynamic loss scaling (planner.runtime.optim.LossScale): exact unscaling, overflow skips and halves,
growth after a run of good steps, the state a checkpoint keeps; bf16/fp32 leave everything alone."""

from __future__ import annotations

import torch
from torch import nn

from planner.runtime.optim import LossScale


def _params(*grads: torch.Tensor) -> list[nn.Parameter]:
    out = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def test_unscale_is_exact_and_finite_steps_are_kept():
    s = LossScale(True)
    grads = [torch.tensor([3.0, -1.5]) * 2.0**16, torch.tensor([0.25]) * 2.0**16]
    params = _params(*grads)
    assert s.unscale_(params) is False
    assert torch.equal(params[0].grad, torch.tensor([3.0, -1.5])) and torch.equal(params[1].grad, torch.tensor([0.25]))
    s.update()
    assert s.scale == 2.0**16 and s.good_steps == 1


def test_an_overflow_skips_and_halves_then_growth_doubles():
    s = LossScale(True, init_scale=8.0, growth_interval=3)
    assert s.unscale_(_params(torch.tensor([1.0, float("inf")]))) is True
    s.update()
    assert s.scale == 4.0 and s.good_steps == 0
    assert s.unscale_(_params(torch.tensor([float("nan")]))) is True
    s.update()
    assert s.scale == 2.0
    for _ in range(3):
        assert s.unscale_(_params(torch.tensor([1.0]))) is False
        s.update()
    assert s.scale == 4.0 and s.good_steps == 0
    s.found_inf = True
    for _ in range(10):
        s.update()
    assert s.scale == 1.0  # never below min_scale


def test_state_round_trips_and_disabled_scaling_touches_nothing():
    s = LossScale(True, init_scale=1024.0)
    s.good_steps = 7
    t = LossScale(True)
    t.load(s.state())
    assert (t.scale, t.good_steps) == (1024.0, 7)
    off = LossScale(False)
    params = _params(torch.tensor([float("inf"), 2.0]))
    assert off.scale == 1.0 and off.unscale_(params) is False
    assert params[0].grad[1] == 2.0
    off.load({"scale": 8.0, "good_steps": 1})
    assert off.scale == 1.0 and off.state() == {"scale": 1.0, "good_steps": 0}
