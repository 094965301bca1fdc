"""The whole search is exact: on random small instances its chosen configuration has the optimum that
brute-force enumeration of the same cost model finds (every candidate of the space, dominated ones
included, every contiguous partition, every recomputation choice)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from synthetic import make_graph, make_unit

from planner.cost.model import CostOptions
from planner.errors import InfeasibleError
from planner.hardware.load import load_cluster
from planner.search.bounds import lower_bounds
from planner.search.problem import PartitionProblem
from planner.search.reference import brute_force_partition
from planner.search.search import CostTable, search, search_modes
from planner.search.space import SCHEDULE_NAMES, Pins, enumerate_space

unit_st = st.tuples(
    st.integers(10_000_000, 2_000_000_000),  # params
    st.floats(1e11, 5e13),  # fwd flops per sample
    st.integers(10_000_000, 3_000_000_000),  # activation bytes per sample
    st.integers(1_000_000, 200_000_000),  # boundary bytes per sample
)


def full_space(graph, cluster, batch, dp=None, **pinned):
    """Every candidate that breaks no hard rule: the dominance rules are switched off by pinning the
    dimension they prune (schedule, ZeRO stage, sequence parallelism) to each of its values in turn.
    `pinned`: further Pins fields fixed for the whole space."""
    out = set()
    for schedule in SCHEDULE_NAMES:
        for zero in range(4):
            for sp in (False, True):
                pins = Pins(dp=dp, schedule=schedule, zero_stage=zero, sequence_parallel=sp, **pinned)
                try:
                    out |= set(enumerate_space(graph, cluster, batch, pins).candidates)
                except InfeasibleError:  # these pins leave nothing (e.g. sequence parallelism without tp)
                    pass
    return sorted(out, key=repr)


def brute_force(graph, cluster, batch, dp=None, **pinned):
    """The optimum over the whole space, checking on the way that every bound the search may prune with
    is valid: no level of `lower_bounds` exceeds a candidate's optimum or calls a feasible one infeasible."""
    options = CostOptions.for_cluster(cluster)  # what search() costs with
    table = CostTable(graph, cluster, None)
    modes = search_modes(graph)
    best = None
    for cand in full_space(graph, cluster, batch, dp, **pinned):
        cm = tuple(m for m in modes if not (cand.schedule == "zero-bubble" and m == "selective"))
        costs = table.units(cand)
        res = brute_force_partition(PartitionProblem(graph, cluster, cand, costs, cm, options))
        for joint in (False, True):
            b = lower_bounds(PartitionProblem(graph, cluster, cand, costs, cm, options), joint=joint)
            if res is not None:
                assert b.feasible, cand
                assert b.time <= res[0] * (1 + 1e-9), (cand, joint, b.time, res[0])
                assert b.memory <= cluster.gpu.memory_bytes * (1 + 1e-9), cand
        if res is not None and (best is None or res[0] < best[0]):
            best = (res[0], cand)
    return best


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from(["transformer", "any"]),
    pre=unit_st,
    block=unit_st,
    post=unit_st,
    others=st.lists(unit_st, min_size=3, max_size=4),
    n_blocks=st.integers(2, 4),
    gpn=st.sampled_from([2, 4]),
    nodes=st.sampled_from([1, 2]),
    batch=st.sampled_from([2, 4, 8]),
    memory=st.floats(6, 80),
    pin_dp=st.sampled_from([None, 1]),
)
def test_search_equals_brute_force(shape, pre, block, post, others, n_blocks, gpn, nodes, batch, memory, pin_dp):
    """pin_dp=1 (a pinned dimension, as --dp 1 gives) makes pipeline and tensor parallelism win often."""
    if shape == "transformer":
        us = [make_unit("embed", "pre", *pre)]
        us += [make_unit(f"blocks.{i}", "blk", *block) for i in range(n_blocks)]
        us += [make_unit("head", "post", *post)]
    else:
        us = [make_unit(f"u{i}", f"s{i}", *spec) for i, spec in enumerate(others)]
    graph = make_graph(us)
    cl = load_cluster("a100-sxm4-80gb", nodes, gpn)
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory})})
    expected = brute_force(graph, cl, batch, pin_dp)
    pins = Pins(dp=pin_dp)
    if expected is None:
        with pytest.raises(InfeasibleError):
            search(graph, cl, batch, pins=pins, top_k=2, prefer_simulated=False)
        return
    got = search(graph, cl, batch, pins=pins, top_k=2, prefer_simulated=False)
    assert got.status == "optimal"
    assert got.best.objective == pytest.approx(expected[0], rel=1e-9), (got.best.cand, expected[1])
    # the chosen configuration's own optimum (brute force over its partitions) is that objective
    table = CostTable(graph, cl, None)
    modes = tuple(m for m in search_modes(graph) if not (got.best.cand.schedule == "zero-bubble" and m == "selective"))
    pb = PartitionProblem(graph, cl, got.best.cand, table.units(got.best.cand), modes, CostOptions.for_cluster(cl))
    own = brute_force_partition(pb)
    assert own[0] == pytest.approx(got.best.objective, rel=1e-9)
    # the runners-up are in order and none beats the winner
    objs = [e.objective for e in got.ranked]
    assert objs == sorted(objs)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pre=unit_st,
    block=unit_st,
    post=unit_st,
    spare=st.integers(0, 1),
    batch=st.sampled_from([2, 4]),
    memory=st.floats(40, 200),
)
def test_search_takes_more_than_eight_stages_per_rank(pre, block, post, spare, batch, memory):
    """pp 2 x v 9 (above the old cap of 8) over 18-19 units: the search's optimum over the pinned space, its
    micro-batching, ZeRO stage and recomputation free, equals brute force."""
    us = [make_unit("embed", "pre", *pre)]
    us += [make_unit(f"blocks.{i}", "blk", *block) for i in range(16 + spare)]
    us += [make_unit("head", "post", *post)]
    graph = make_graph(us)
    cl = load_cluster("a100-sxm4-80gb", 1, 2)
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory})})
    pinned = {"pp": 2, "virtual_stages": 9}
    expected = brute_force(graph, cl, batch, 1, **pinned)
    pins = Pins(dp=1, **pinned)
    if expected is None:
        with pytest.raises(InfeasibleError):
            search(graph, cl, batch, pins=pins, top_k=2, prefer_simulated=False)
        return
    got = search(graph, cl, batch, pins=pins, top_k=2, prefer_simulated=False)
    assert got.best.cand.virtual_stages == 9
    assert got.best.objective == pytest.approx(expected[0], rel=1e-9), (got.best.cand, expected[1])
