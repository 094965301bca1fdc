"""Batches of candidates solved side by side in forked processes (planner/search/forked.py): the same results as
one after another, in order; a child that fails has its item solved in the planner's process. `SideSolvers`
keeps its children for every batch and sends the objects they hold already as references."""

from __future__ import annotations

import os
import sys

import pytest

from planner.hardware.load import load_cluster
from planner.pipeline import PlanRequest, analyse
from planner.search import forked
from planner.search.forked import SideSolvers, map_forked
from planner.search.search import search
from planner.search.space import Pins

needs_fork = pytest.mark.skipif(
    sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2, reason="forks on Linux with 2+ CPUs"
)
PARENT = os.getpid()


def _square(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _dies_in_a_child(x: int) -> int:
    if os.getpid() != PARENT:
        os._exit(3)
    return -x


def _fails_on(x: int) -> int:
    if x == 2:
        raise ValueError(f"no plan for {x}")
    return x


@needs_fork
def test_the_results_are_in_order_and_each_but_the_first_comes_from_a_child():
    out = map_forked(_square, [1, 2, 3])
    assert [v for v, _ in out] == [1, 4, 9]
    pids = [pid for _, pid in out]
    assert pids[0] == os.getpid() and len(set(pids)) == 3
    assert map_forked(_square, []) == []


@needs_fork
def test_an_item_whose_child_dies_is_solved_here():
    assert map_forked(_dies_in_a_child, [1, 2, 3]) == [-1, -2, -3]


@needs_fork
def test_an_error_is_raised_here_as_without_the_fork():
    with pytest.raises(ValueError, match="no plan for 2"):
        map_forked(_fails_on, [1, 2, 3])


def test_the_fork_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(forked.FORK_ENV, "0")
    assert not forked.fork_allowed()


@needs_fork
def test_the_search_finds_the_same_with_the_solves_forked_or_threaded(monkeypatch):
    """The sample MLP with blocks of 5 sizes on 8 GPUs: batches of candidates for several stages per rank (the
    branch and bound, stopped by its node counts) and chains; every figure of the result is the same."""
    request = PlanRequest(
        model_path="sample_models/mlp.py", model_args={"layers": 12, "width": 4096, "ffn_cycle": 5},
        gpu="a100-sxm-80gb", nodes=1, global_batch_size=256,
    )
    graph = analyse(request, cache=False)
    cluster = load_cluster("a100-sxm-80gb", 1)
    batches: list[int] = []
    side_map = SideSolvers.map

    def counted(self, fn, items):
        batches.append(len(items))
        return side_map(self, fn, items)

    monkeypatch.setattr(SideSolvers, "map", counted)
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv(forked.FORK_ENV, setting)
        results.append(search(graph, cluster, 256, Pins()))
    a, b = results
    assert batches and all(n == 2 for n in batches)  # forked with the fork on, threads with it off
    assert a.ilps_solved == b.ilps_solved > 2
    assert [(e.cand, e.partition, e.recompute, e.reported) for e in a.ranked] == [
        (e.cand, e.partition, e.recompute, e.reported) for e in b.ranked
    ]
    assert (a.rejected, a.status, a.gap, a.reported_gap, a.pruned_by_bound) == (
        b.rejected, b.status, b.gap, b.reported_gap, b.pruned_by_bound
    )


BIG = {"weights": list(range(100_000))}  # held by the children as it is at their fork


def _shared_and_pid(x: object) -> tuple[bool, int, int]:
    return x is BIG, len(BIG["weights"]), os.getpid()


def _pid(x: int) -> tuple[int, int]:
    return x, os.getpid()


@needs_fork
def test_side_solvers_keep_one_child_per_slot_for_every_batch():
    side = SideSolvers([])
    try:
        first = side.map(_pid, [1, 2, 3])
        second = side.map(_pid, [4, 5, 6])
        assert [v for v, _ in first + second] == [1, 2, 3, 4, 5, 6]
        pids = [pid for _, pid in first], [pid for _, pid in second]
        assert pids[0][0] == pids[1][0] == os.getpid()
        assert pids[0][1:] == pids[1][1:] and len(set(pids[0])) == 3  # the same two children both times
        assert side.map(_pid, []) == []
    finally:
        children = [c.pid for c in side.children]
        side.close()
    for pid in children:  # reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@needs_fork
def test_shared_objects_travel_as_references_to_the_childs_copy():
    side = SideSolvers([BIG])
    try:
        here, there = side.map(_shared_and_pid, [BIG, BIG])
        assert here[:2] == (True, 100_000) and there[:2] == (True, 100_000) and there[2] != os.getpid()
        # without sharing it, the child gets a pickled copy: equal, not its own object
        unshared = SideSolvers([])
        try:
            _, copied = unshared.map(_shared_and_pid, [BIG, BIG])
        finally:
            unshared.close()
        assert copied[:2] == (False, 100_000)
    finally:
        side.close()


@needs_fork
def test_side_solvers_solve_a_dead_childs_item_here_and_raise_errors_here():
    side = SideSolvers([])
    try:
        assert side.map(_dies_in_a_child, [1, 2, 3]) == [-1, -2, -3]
        assert side.failed and not side.children  # later batches fork per batch
        assert side.map(_square, [2, 3])[1][0] == 9
    finally:
        side.close()
    side = SideSolvers([])
    try:
        with pytest.raises(ValueError, match="no plan for 2"):
            side.map(_fails_on, [1, 2, 3])
    finally:
        side.close()
