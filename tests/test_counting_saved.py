"""Saved activations counted by planner.model.counting.analyse_callable: each saved storage once, whatever the
allocator does with the storage of a branch whose graph autograd drops on the way (its address may go to a later
storage, and the count keys storages by address). T5's decoder counted one of its saved tensors or two, from run
to run, before; here the allocator's reuse is played by a key that a storage gives back when it dies."""

from __future__ import annotations

import itertools
import weakref

import torch

from planner.model import counting
from planner.model.counting import analyse_callable


def _dropped_branches(x: torch.Tensor) -> torch.Tensor:
    for _ in range(8):
        y = x * 2
        dropped = y * y  # saves y (twice): when its graph goes, on the next line, nothing holds y any more
        del y, dropped
    return x.exp()


def test_a_storage_freed_on_the_way_does_not_merge_with_a_later_one(monkeypatch):
    live: dict[int, int] = {}
    free: list[int] = []
    fresh = itertools.count()

    def reused_address(t: torch.Tensor) -> int:  # an allocator that hands a freed address to the next storage
        storage = t.untyped_storage()._cdata
        if storage not in live:
            live[storage] = free.pop() if free else next(fresh)
            weakref.finalize(t, lambda: free.append(live.pop(storage)))
        return live[storage]

    monkeypatch.setattr(counting, "_storage_key", reused_address)
    x = torch.empty(4, 8, device="meta")
    counts = analyse_callable(_dropped_branches, (x,), [], None)
    assert len(counts.saved) == 9 and set(counts.saved.values()) == {4 * 8 * 4}  # eight y, the exp output (fp32)
