"""The branch and bound for several stages per rank (planner/search/ilp/ranks.py): exact against brute force,
a valid lower bound when it stops at its node budget, and a search that reports that gap."""

from __future__ import annotations

import itertools
import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from synthetic import make_graph, make_unit

from planner.cost.model import Candidate, CostOptions
from planner.cost.terms import rank_capacity
from planner.hardware.load import load_cluster
from planner.search import search as search_mod
from planner.search.ilp import ranks, solve_partition
from planner.search.problem import PartitionProblem
from planner.search.reference import brute_force_partition
from planner.search.search import CostTable, evaluate, search
from planner.search.space import Pins

unit_st = st.tuples(
    st.integers(10_000_000, 2_000_000_000),  # params
    st.floats(1e11, 5e13),  # fwd flops per sample
    st.integers(10_000_000, 3_000_000_000),  # activation bytes per sample
    st.integers(1_000_000, 200_000_000),  # boundary bytes per sample
)
MODES = ("none", "full")


def cluster_with(memory_gib: float):
    cl = load_cluster("a100-sxm4-80gb", 2)
    return cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory_gib})})


def instance(units, schedule, v, m_rounds, dp, zero, memory):
    us = [make_unit(f"u{i}", f"s{i}", *spec).model_copy(update={"kind": "other"}) for i, spec in enumerate(units)]
    graph, cluster = make_graph(us), cluster_with(memory)
    cand = Candidate(dp, 1, 2, v, 1, 2 * m_rounds, schedule, zero if dp > 1 else 0, False)
    costs = CostTable(graph, cluster, None).units(cand)
    tables = PartitionProblem(graph, cluster, cand, costs, MODES, CostOptions()).tables
    return graph, cluster, cand, costs, tables


case = dict(
    units=st.lists(unit_st, min_size=4, max_size=7),
    shape=st.sampled_from([("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zero-bubble", 2)]),
    m_rounds=st.integers(1, 4),
    dp=st.sampled_from([1, 2, 4]),
    zero=st.integers(0, 3),
    memory=st.floats(6, 120),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**case, cut=st.sampled_from([None, 0.95, 1 - 1e-6, 1 + 1e-6, 1.05]))
def test_branch_and_bound_equals_brute_force(units, shape, m_rounds, dp, zero, memory, cut):
    """Without a node budget or a start it finds the brute-force optimum of the linear objective (one
    recomputation mode for all stages); below a limit it finds that optimum when it is below the limit, else
    nothing, and says it proved so."""
    schedule, v = shape
    if 2 * v > len(units):
        units = units + units[: 2 * v - len(units)]
    graph, cluster, cand, costs, tables = instance(units, schedule, v, m_rounds, dp, zero, memory)
    options = CostOptions()
    brute = brute_force_partition(PartitionProblem(graph, cluster, cand, costs, MODES, options))
    limit = None if cut is None or brute is None else cut * brute[0]
    got = ranks.solve_ranks(PartitionProblem(graph, cluster, cand, costs, MODES, options), limit, max_nodes=None)
    assert got.proven
    if brute is None or (limit is not None and brute[0] >= limit):
        assert got.partition is None
        return
    assert got.partition is not None and got.recompute is not None
    ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=options), got.partition, got.recompute)
    assert max(ev.rank_memory.values()) <= cluster.gpu.memory_bytes * (1 + 1e-9)
    assert got.objective == pytest.approx(ev.objective, rel=1e-9)
    assert ev.objective == pytest.approx(brute[0], rel=1e-9)


def assert_bounds_below_every_plan(pb: PartitionProblem) -> int:
    """Walk every partition that fits (`reference._fitting`) down the branch and bound's tree: the bound of
    each of its prefixes is at most its objective (the bounds are valid for every completion, not only the
    optimum's). Returns how many partitions were walked."""
    from planner.search.reference import _fitting

    plans = list(_fitting(pb))
    if not plans:
        return 0
    bb = ranks._Search(pb)
    bb.integral(pb.costs, min(ev.objective for ev, _, _ in plans) / pb.cand.num_micro_batches)
    for ev, part, rec in plans:
        cuts = [units[0] for units in part] + [len(pb.graph.units)]
        node = bb.root(pb.modes.index(rec[0]))
        for s in range(pb.cand.stages):
            children = bb.expand(node)
            c = int(np.flatnonzero(children.js == cuts[s + 1])[0])
            assert children.lows[c] <= ev.objective * (1 + 1e-9), (part, rec, s)
            if s < pb.cand.stages - 1:
                node = bb.child(children, c)
        assert children.lows[c] == pytest.approx(ev.objective, rel=1e-9)  # a leaf's bound is its objective
    return len(plans)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**case)
def test_every_bound_on_the_way_to_a_plan_is_at_most_its_objective(units, shape, m_rounds, dp, zero, memory):
    """The lower bound of every node on the path to any partition that fits is at most that partition's
    objective: the water levels, the per-rank tables (time, synced time, tail) and the sends."""
    schedule, v = shape
    if 2 * v > len(units):
        units = units + units[: 2 * v - len(units)]
    graph, cluster, cand, costs, tables = instance(units, schedule, v, m_rounds, dp, zero, memory)
    assert_bounds_below_every_plan(PartitionProblem(graph, cluster, cand, costs, MODES, CostOptions()))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**case, budget=st.integers(1, 12))
def test_a_stopped_branch_and_bound_keeps_a_valid_bound(units, shape, m_rounds, dp, zero, memory, budget):
    """Stopped after a few nodes, its plan is at least the optimum and its lower bound at most it."""
    schedule, v = shape
    if 2 * v > len(units):
        units = units + units[: 2 * v - len(units)]
    graph, cluster, cand, costs, tables = instance(units, schedule, v, m_rounds, dp, zero, memory)
    options = CostOptions()
    brute = brute_force_partition(PartitionProblem(graph, cluster, cand, costs, MODES, options))
    got = ranks.solve_ranks(PartitionProblem(graph, cluster, cand, costs, MODES, options), None, max_nodes=budget)
    assert got.nodes <= max(budget, len(MODES))
    if brute is None:
        assert got.partition is None
        return
    assert got.low <= brute[0] * (1 + 1e-9)
    if got.objective is not None:
        assert got.objective >= brute[0] * (1 - 1e-9)
        assert got.proven == (got.low >= got.objective * (1 - 1e-9))
        ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=options), got.partition, got.recompute)
        assert max(ev.rank_memory.values()) <= cluster.gpu.memory_bytes * (1 + 1e-9)
        assert got.objective == pytest.approx(ev.objective, rel=1e-9)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**case, seed=st.integers(0, 10**6))
def test_the_local_search_scores_plans_as_the_cost_model_does(units, shape, m_rounds, dp, zero, memory, seed):
    """The branch and bound's objective of a partition is the cost model's (or INF when a rank does not fit
    memory), and its local search never ends above where it started."""
    schedule, v = shape
    if 2 * v > len(units):
        units = units + units[: 2 * v - len(units)]
    graph, cluster, cand, costs, tables = instance(units, schedule, v, m_rounds, dp, zero, memory)
    options = CostOptions()
    bb = ranks._Search(PartitionProblem(graph, cluster, cand, costs, MODES, options))
    rnd = random.Random(seed)
    U, S = len(units), cand.stages
    cuts = [0, *sorted(rnd.sample(range(1, U), S - 1)), U]
    for q, mode in enumerate(MODES):
        part = [list(range(cuts[t], cuts[t + 1])) for t in range(S)]
        ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=options), part, [mode] * S)
        got = float(bb.objective(q, np.array([cuts]))[0])
        cap = rank_capacity(cluster, cand)
        if max(ev.rank_memory.values()) <= cap * (1 - 1e-9):
            assert got == pytest.approx(ev.objective, rel=1e-9)
        elif max(ev.rank_memory.values()) > cap * (1 + 1e-9):
            assert got == float("inf")
        better, obj = bb.polish(q, cuts)
        assert obj <= got
        if obj < float("inf"):
            part = [list(range(better[t], better[t + 1])) for t in range(S)]
            pb = PartitionProblem(graph, cluster, cand, costs, options=options)
            assert obj == pytest.approx(evaluate(pb, part, [mode] * S).objective)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9), x=st.floats(0.0, 40.0))
def test_rounding_up_to_a_subset_sum_never_passes_one(values, x):
    """The subset-sum table rounds a water level up to at most the least true subset sum at or above it."""
    hi = 50.0
    sums = ranks._subset_sums(values, hi)
    assert sums is not None
    true = sorted({sum(c) for k in range(len(values) + 1) for c in itertools.combinations(values, k)})
    above = [t for t in true if t >= x * (1 - 1e-9) and t <= hi]
    up = float(ranks._round_up(np.array([x]), sums)[0])
    assert up >= x
    if above:
        assert up <= max(x, above[0])  # x itself within the 1e-9 tolerance


def test_the_search_reports_the_gap_of_a_stopped_branch_and_bound(monkeypatch):
    """A search whose branch-and-bound budget runs out reports node_limit with a gap in (0, 1), the same on
    every run (a count, not time), and the exact search on the same instance reports gap 0."""
    rnd = random.Random(0)  # the instance of tests/test_solver_status.py
    us = [
        make_unit(
            f"u{i}", f"s{i}", rnd.randint(10**7, 2 * 10**9), rnd.uniform(1e11, 5e13), rnd.randint(10**7, 3 * 10**9),
            rnd.randint(10**6, 2 * 10**8),
        ).model_copy(update={"kind": "other"})
        for i in range(14)
    ]
    graph = make_graph(us)
    cl = load_cluster("a100-sxm4-80gb", 1, 4)
    pins = Pins(dp=1, tp=1, pp=4, virtual_stages=2, micro_batch_size=1, schedule="interleaved-1f1b", zero_stage=0)
    exact = search(graph, cl, 8, pins, max_nodes=None)
    assert exact.status == "optimal" and exact.gap == 0.0
    monkeypatch.setattr(search_mod, "BB_NODES_MIN", 1)
    runs = [search(graph, cl, 8, pins, max_nodes=2) for _ in range(2)]
    assert runs[0].status == "node_limit" and 0.0 < runs[0].gap < 1.0
    assert (runs[0].gap, runs[0].best.objective) == (runs[1].gap, runs[1].best.objective)
    assert runs[0].best.objective >= exact.best.objective * (1 - 1e-9)


def test_solve_partition_uses_it_for_several_stages_per_rank():
    """solve_partition picks the branch and bound for interleaved and zero-bubble candidates of a model that
    is not one run of identical blocks, and its optimum is CBC's."""
    sizes = [(4e8, 3e12), (1e8, 9e12), (7e8, 2e12), (2e8, 6e12), (5e8, 4e12), (3e8, 5e12), (6e8, 1e12)]
    us = [make_unit(f"u{i}", f"s{i}", int(p), f, 500_000_000, 20_000_000) for i, (p, f) in enumerate(sizes)]
    graph, cluster, options = make_graph(us), cluster_with(80), CostOptions()
    for schedule in ("interleaved-1f1b", "zero-bubble"):
        cand = Candidate(2, 1, 2, 2, 1, 4, schedule, 1, False)
        costs = CostTable(graph, cluster, None).units(cand)
        res = solve_partition(PartitionProblem(graph, cluster, cand, costs, MODES, options))
        cbc = solve_partition(PartitionProblem(graph, cluster, cand, costs, MODES, options), force_form="interval")
        assert res.form == "ranks" and res.status == "optimal"
        assert res.objective == pytest.approx(cbc.objective, rel=1e-6)
