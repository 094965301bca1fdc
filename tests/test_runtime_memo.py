"""MetaMemo (planner.runtime.memo): repeated identical ops on meta run once, with results whose metadata,
gradients and failures are those of running every op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.runtime.memo import MetaMemo


class Blocks(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w2))
            for w, w2 in zip(widths, widths[1:] + widths[-1:])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) if block[-1].out_features == x.shape[-1] else block(x)
        return x.softmax(-1)


def _described(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device.type, t.requires_grad)


def _run(model: nn.Module, memo: MetaMemo | None) -> tuple[object, ...]:
    x = torch.empty(2, 8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    if memo is None:
        out = model(x)
        out.float().sum().backward()
    else:
        with memo:
            out = model(x)
            out.float().sum().backward()
    assert x.grad is not None
    grads = tuple(_described(p.grad) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return _described(out), _described(x.grad), grads


def test_repeated_blocks_give_what_running_every_op_gives():
    with torch.device("meta"):
        model = Blocks([16] * 6).to(torch.bfloat16)
    memo = MetaMemo()
    assert _run(model, memo) == _run(model, None)
    # Forward and backward of blocks 2..6 are repeats of block 1's ops.
    assert memo.hits > 5 * 4


def test_a_repeat_is_a_fresh_tensor_and_views_and_in_place_ops_stay_the_ops_own():
    a = torch.empty(4, 6, device="meta")
    with MetaMemo() as memo:
        first, second = a * 2, a * 2
        view = first.transpose(0, 1)
        same = second.add_(1)
    assert memo.hits == 1
    assert first is not second and _described(first) == _described(second)
    assert view._base is first and view.stride() == (1, 6)
    assert same is second


def test_a_failing_op_fails_every_time():
    a, b = torch.empty(4, 6, device="meta"), torch.empty(5, 6, device="meta")
    with MetaMemo():
        for _ in range(2):
            with pytest.raises(RuntimeError):
                a @ b
            with pytest.raises(RuntimeError, match="meta"):
                a.sum().item()


def test_a_block_that_differs_from_the_ones_before_still_fails():
    """The last block's first Linear takes 12 features, not 16: the memo must not answer its matmul with the
    earlier blocks' result."""
    with torch.device("meta"):
        model = Blocks([16] * 4)
        model.blocks[-1][1] = nn.Linear(12, 64)
    with MetaMemo(), pytest.raises(RuntimeError, match="same reduction dim"):
        model(torch.empty(2, 8, 16, device="meta"))


def test_tensors_off_meta_run_as_they_are():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    with MetaMemo() as memo:
        assert (a + a).tolist() == [2.0, 4.0]
        assert (b + b).tolist() == [6.0, 10.0]
    assert memo.hits == 0


def test_arguments_are_keyed_exactly():
    a = torch.empty(4, 6, device="meta")
    with MetaMemo() as memo:
        assert (a * 2).dtype == torch.float32
        assert (a * 2.0).dtype == torch.float32
        assert a.sum(0).shape == (6,) and a.sum(1).shape == (4,)
        assert a.t().contiguous().stride() == (4, 1)
        assert a.to(torch.bfloat16).dtype == torch.bfloat16 and a.to(torch.float16).dtype == torch.float16
    assert memo.hits == 0


def test_under_a_fake_mode_repeats_are_fresh_fake_tensors_with_the_same_gradients():
    """The check's run of a model that branches on values unless traced runs under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with torch.device("meta"):
        model = Blocks([16] * 6).to(torch.bfloat16)

    def run(memo: bool) -> tuple[object, ...]:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            m = MetaMemo() if memo else None
            if m is not None:
                m.__enter__()
            x = torch.empty(2, 8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
            out = model(x)
            out.float().sum().backward()
            if m is not None:
                m.__exit__(None, None, None)
                assert m.hits > 5 * 4
            assert isinstance(out, FakeTensor) and out.fake_mode is fake
            grads = tuple(_described(p.grad) for p in model.parameters())
        model.zero_grad(set_to_none=True)
        return _described(out), grads

    assert run(True) == run(False)


def test_fake_constants_keep_their_values():
    """A fake mode computes with one-element constants' values (so .item() works on them): not memoised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), MetaMemo() as memo:
        for value in (3.0, 4.0):
            assert (torch.tensor(value) * 2).item() == 2 * value
    assert memo.hits == 0


def test_a_factory_op_follows_the_default_dtype():
    before = torch.get_default_dtype()
    try:
        with MetaMemo():
            torch.set_default_dtype(torch.float32)
            assert torch.ones(3, device="meta").dtype == torch.float32
            torch.set_default_dtype(torch.float64)
            assert torch.ones(3, device="meta").dtype == torch.float64
    finally:
        torch.set_default_dtype(before)
