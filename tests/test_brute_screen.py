"""The brute force's memory screen (`reference._may_fit`) says of every partition and recomputation what
`evaluate_fitting` says (fits or not), except within its margin of the capacity, where it leaves the partition
to be evaluated: never one that fits screened out. And the brute force's result is that of simulating every
fitting partition in order, the first of the least figure kept.

On random small instances (reported_exact's, MoE experts under ep and frozen weights added at random), every
candidate of the whole space with several stages, every schedule."""

from __future__ import annotations

import random

import pytest
from test_reported_exact import instance
from test_search_exact import full_space

from planner.cost.model import CostOptions
from planner.search.evaluate import evaluate_fitting
from planner.search.problem import PartitionProblem
from planner.search.reference import SCREEN_MARGIN, _bounds, _choices, _may_fit, _partitions, brute_force_reported
from planner.search.search import CostTable, search_modes

INSTANCES = 24


def _with_experts_and_frozen(graph, seed: int):
    """Some units get MoE experts (a share of their parameters, 8 experts) and some frozen weights."""
    rnd = random.Random(seed)
    units = []
    for u in graph.units:
        update = {}
        if rnd.random() < 0.5:
            update |= {"expert_params": u.params // 2, "experts": {f"{u.name}.experts": 8}, "ep_granularity": 8}
        if rnd.random() < 0.3:
            update["frozen_params"] = u.params // 3
        units.append(u.model_copy(update=update))
    return graph.model_copy(update={"units": units})


def _problems(seed: int):
    graph, cluster, batch, pin_dp = instance(seed)
    if seed % 2:
        graph = _with_experts_and_frozen(graph, seed)
    table = CostTable(graph, cluster, None)
    modes = search_modes(graph)
    options = CostOptions.for_cluster(cluster)
    for cand in full_space(graph, cluster, batch, pin_dp):
        if cand.stages < 2:
            continue
        cm = tuple(m for m in modes if not (cand.schedule == "zero-bubble" and m in ("selective", "op"))) or modes
        yield PartitionProblem(graph, cluster, cand, table.units(cand), cm, options)


@pytest.mark.parametrize("chunk", range(2))
def test_the_screen_says_what_the_evaluation_says(chunk):
    seen = {"fit": 0, "over": 0}
    for seed in range(chunk, INSTANCES, 2):
        for pb in _problems(seed):
            n_units, n_stages = len(pb.graph.units), pb.cand.stages
            choices = _choices(pb.cand, pb.modes)
            mask = _may_fit(pb, _bounds(n_units, n_stages), choices)
            for i, part in enumerate(_partitions(n_units, n_stages)):
                for j, rec in enumerate(choices):
                    ev = evaluate_fitting(pb, part, list(rec), None)
                    peak = max(ev.rank_memory.values())
                    if peak <= pb.capacity:
                        seen["fit"] += 1
                        assert mask[i, j], (seed, pb.cand.label(), part, rec)
                    elif peak > pb.capacity * (1 + 2 * SCREEN_MARGIN):
                        seen["over"] += 1
                        assert not mask[i, j], (seed, pb.cand.label(), part, rec, peak, pb.capacity)
    assert seen["fit"] > 100 and seen["over"] > 100, seen  # both sides of the capacity were met


def test_the_brute_force_keeps_the_first_partition_of_the_least_figure():
    """brute_force_reported simulates in the order of its bound and stops early; its result is the first
    partition, in the order of the cuts, of the least reported figure over all that fit."""
    checked = 0
    for seed in range(0, INSTANCES, 3):
        for pb in _problems(seed):
            n_units, n_stages = len(pb.graph.units), pb.cand.stages
            fitting = [
                ev
                for part in _partitions(n_units, n_stages)
                if pb.stages_ok(part)
                for rec in _choices(pb.cand, pb.modes)
                if (ev := evaluate_fitting(pb, part, list(rec), pb.capacity)) is not None
            ]
            got = brute_force_reported(pb)
            if not fitting:
                assert got is None
                continue
            assert got is not None
            best = min(range(len(fitting)), key=lambda i: (fitting[i].reported, i))
            ev, least_linear = got
            assert (ev.partition, ev.recompute) == (fitting[best].partition, fitting[best].recompute)
            assert ev.reported == fitting[best].reported
            assert least_linear == min(e.objective for e in fitting)
            checked += 1
    assert checked > 20
