"""Every way the partition ILP can end is reported: optimal, infeasible, stopped at the node or time
limit (with the gap to the candidate's lower bound), or ruled out by the top-k cutoff."""

from __future__ import annotations

import random

import pytest
from synthetic import make_graph, make_unit

from planner.cost.model import Candidate, CostOptions
from planner.errors import InfeasibleError
from planner.hardware.load import load_cluster
from planner.search.ilp import solve_partition
from planner.search.problem import PartitionProblem
from planner.search.search import CostTable, search
from planner.search.space import Pins

CAND = Candidate(1, 1, 4, 2, 1, 8, "interleaved-1f1b", 0, False)
PINS = Pins(dp=1, tp=1, pp=4, virtual_stages=2, micro_batch_size=1, schedule="interleaved-1f1b", zero_stage=0)
BATCH = 8
MODES = ("none", "full")


def instance(memory_gib: float = 80.0):
    """14 distinct units, interleaved over 4 ranks: seed 0 is not solved at CBC's root node."""
    rnd = random.Random(0)
    units = [
        make_unit(
            f"u{i}",
            f"s{i}",
            rnd.randint(10**7, 2 * 10**9),
            rnd.uniform(1e11, 5e13),
            rnd.randint(10**7, 3 * 10**9),
            rnd.randint(10**6, 2 * 10**8),
        )
        for i in range(14)
    ]
    cl = load_cluster("a100-sxm4-80gb", 1, 4)
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory_gib})})
    # distinct layers, not repeated blocks (Megatron's interleaving rule on block counts does not apply)
    graph = make_graph([u.model_copy(update={"kind": "other"}) for u in units])
    return graph, cl, CostTable(graph, cl, None).units(CAND)


def test_optimal_and_node_limit():
    graph, cl, costs = instance()
    exact = solve_partition(PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions()))
    assert exact.status == "optimal" and exact.form == "ranks"
    # the branch and bound for several stages per rank stopped at once (past the root of each recomputation
    # mode): its plan (the start) and a valid lower bound
    stopped = solve_partition(PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions()), bb_nodes=1)
    assert stopped.status == "node_limit" and stopped.form == "ranks" and stopped.nodes == len(MODES)
    assert stopped.objective >= exact.objective * (1 - 1e-9)
    assert stopped.low is not None and stopped.low <= exact.objective * (1 + 1e-9)
    for form in ("interval", "assign"):
        pb = PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions())
        assert solve_partition(pb, force_form=form).objective == (
            pytest.approx(exact.objective, rel=1e-6)
        )
        stopped = solve_partition(pb, max_nodes=1, force_form=form)
        assert stopped.status == "node_limit" and stopped.form == form
        assert stopped.objective >= exact.objective * (1 - 1e-9)
        assert sorted(u for st in stopped.partition for u in st) == list(range(len(graph.units)))


def test_time_limit_is_named_when_one_was_asked_for():
    graph, cl, costs = instance()
    pb = PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions())
    stopped = solve_partition(pb, time_limit=60.0, max_nodes=1, force_form="interval")
    assert stopped.status == "time_limit"


def test_search_reports_the_limit_and_the_gap():
    graph, cl, _ = instance()
    res = search(graph, cl, BATCH, PINS, max_nodes=1)
    assert res.status == "node_limit"
    assert 0.0 < res.gap < 1.0
    exact = search(graph, cl, BATCH, PINS)
    assert exact.status == "optimal" and exact.gap == 0.0


def test_cutoff():
    graph, cl, costs = instance()
    best = solve_partition(PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions())).objective
    above = solve_partition(PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions()), cutoff=best * 1.01)
    assert above.status == "optimal" and above.objective == pytest.approx(best, rel=1e-9)
    below = solve_partition(PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions()), cutoff=best * 0.99)
    assert below.status == "cutoff" and below.partition is None


def test_infeasible_and_the_shortfall_message():
    graph, cl, costs = instance(memory_gib=4.0)
    assert solve_partition(PartitionProblem(graph, cl, CAND, costs, MODES, CostOptions())).status == "infeasible"
    with pytest.raises(InfeasibleError) as e:
        search(graph, cl, BATCH, PINS)
    msg = str(e.value)
    assert "GiB over" in msg and "ZeRO-3" in msg and "--nodes" in msg
