"""The ILP's partition is optimal: equal to a dynamic program and to brute force on random instances."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from synthetic import make_graph, make_unit

from planner.cost.model import Candidate, CostOptions
from planner.hardware.load import load_cluster
from planner.search.ilp import block_run, solve_partition
from planner.search.ilp.chain import solve_chain
from planner.search.problem import PartitionProblem
from planner.search.reference import brute_force_partition, dp_partition
from planner.search.search import CostTable, evaluate

GiB = 2**30


unit_st = st.tuples(
    st.integers(10_000_000, 2_000_000_000),  # params
    st.floats(1e11, 5e13),  # fwd flops per sample
    st.integers(10_000_000, 3_000_000_000),  # activation bytes per sample
    st.integers(1_000_000, 200_000_000),  # boundary bytes per sample
    st.integers(0, 1_000_000_000),  # attention-map bytes
)


def cluster_with(memory_gib: float, nodes: int = 2):
    cl = load_cluster("a100-sxm4-80gb", nodes)
    return cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory_gib})})


def _check(graph, cluster, cand, modes, with_dp: bool, form: str | None = None):
    options = CostOptions()
    costs = CostTable(graph, cluster, None).units(cand)
    ilp = solve_partition(PartitionProblem(graph, cluster, cand, costs, modes, options), force_form=form)
    ref = dp_partition(PartitionProblem(graph, cluster, cand, costs, modes, options)) if with_dp else None
    brute = brute_force_partition(PartitionProblem(graph, cluster, cand, costs, modes, options))
    if brute is None:
        assert ilp.status == "infeasible"
        assert ref is None
        return
    assert ilp.status == "optimal", ilp
    ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=options), ilp.partition, ilp.recompute)
    assert max(ev.rank_memory.values()) <= cluster.gpu.memory_bytes * (1 + 1e-9)
    # the ILP's own objective and the cost model's evaluation of its partition agree
    assert ev.objective == pytest.approx(ilp.objective, rel=1e-6)
    assert ev.objective == pytest.approx(brute[0], rel=1e-9)
    if ref is not None:
        assert ref[0] == pytest.approx(brute[0], rel=1e-9)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    units=st.lists(unit_st, min_size=3, max_size=6),
    stages=st.integers(2, 3),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    extra_m=st.integers(0, 6),
    dp=st.sampled_from([1, 2, 4]),
    zero=st.integers(0, 3),
    memory=st.floats(8, 120),
    form=st.sampled_from(["interval", "assign"]),
)
def test_ilp_equals_dp_and_brute_force_one_stage_per_rank(units, stages, schedule, extra_m, dp, zero, memory, form):
    us = [make_unit(f"u{i}", f"s{i}", *spec) for i, spec in enumerate(units)]
    if stages > len(us):
        stages = len(us)
    graph = make_graph(us)
    cand = Candidate(dp, 1, stages, 1, 1, stages + extra_m, schedule, zero if dp > 1 else 0, False)
    _check(graph, cluster_with(memory), cand, ("none", "selective", "full"), with_dp=True, form=form)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    units=st.lists(unit_st, min_size=4, max_size=6),
    schedule=st.sampled_from(["interleaved-1f1b", "zero-bubble"]),
    m_rounds=st.integers(1, 3),
    memory=st.floats(8, 120),
    form=st.sampled_from(["interval", "assign"]),
)
def test_ilp_equals_brute_force_two_stages_per_rank(units, schedule, m_rounds, memory, form):
    us = [make_unit(f"u{i}", f"s{i}", *spec) for i, spec in enumerate(units)]
    graph = make_graph(us)
    cand = Candidate(1, 1, 2, 2, 1, 2 * m_rounds, schedule, 0, False)
    _check(graph, cluster_with(memory), cand, ("none", "full"), with_dp=False, form=form)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pre=unit_st,
    block=unit_st,
    post=unit_st,
    n_blocks=st.integers(2, 6),
    stages=st.integers(2, 4),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    memory=st.floats(8, 120),
    tp=st.sampled_from([1, 2]),
)
def test_count_form_equals_brute_force_on_transformer_shape(pre, block, post, n_blocks, stages, schedule, memory, tp):
    """Identical blocks between an embedding and a head: the count encoding is exact."""
    us = [make_unit("embed", "pre", *pre)]
    us += [make_unit(f"blocks.{i}", "blk", *block) for i in range(n_blocks)]
    us += [make_unit("head", "post", *post)]
    graph = make_graph(us)
    assert block_run(graph) is not None
    cand = Candidate(2, tp, stages, 1, 1, stages + 2, schedule, 1, tp > 1)
    _check(graph, cluster_with(memory), cand, ("none", "full"), with_dp=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pre=unit_st,
    block=unit_st,
    post=unit_st,
    n_blocks=st.integers(4, 7),
    schedule=st.sampled_from(["interleaved-1f1b", "zero-bubble"]),
    m_rounds=st.integers(1, 3),
    memory=st.floats(8, 120),
    zero=st.integers(0, 3),
)
def test_count_form_two_stages_per_rank_equals_brute_force(
    pre, block, post, n_blocks, schedule, m_rounds, memory, zero
):
    """Several stages per rank in the count form, with the bound cuts on the rank and stage maxima."""
    us = [make_unit("embed", "pre", *pre)]
    us += [make_unit(f"blocks.{i}", "blk", *block) for i in range(n_blocks)]
    us += [make_unit("head", "post", *post)]
    graph = make_graph(us)
    cand = Candidate(2, 1, 2, 2, 1, 2 * m_rounds, schedule, zero, False)
    _check(graph, cluster_with(memory), cand, ("none", "full"), with_dp=False)


def test_a_model_of_different_blocks_is_planned_in_the_interval_form():
    """The sample MLP with ffn_cycle > 1 has blocks of three sizes: no single run of identical blocks,
    so the ILP uses the interval form, and its partition balances the uneven blocks exactly."""
    from pathlib import Path

    from planner.pipeline import PlanRequest, analyse, plan_model

    mlp = str(Path(__file__).resolve().parents[1] / "sample_models" / "mlp.py")
    req = PlanRequest(
        model_path=mlp,
        model_args={"layers": 9, "width": 1024, "ffn_cycle": 3},
        gpu="a100-sxm4-80gb",
        nodes=1,
        global_batch_size=32,
        pins={"pp": 4, "dp": 2, "schedule": "1f1b", "micro_batch_size": 1},
    )
    graph = analyse(req)
    assert block_run(graph) is None
    assert len({u.signature for u in graph.units if u.kind == "block"}) == 3
    plan, _, result = plan_model(req, graph)
    assert result.status == "optimal"
    cl = load_cluster("a100-sxm4-80gb", 1)
    best = result.best
    costs = CostTable(graph, cl, None).units(best.cand)
    pb = PartitionProblem(graph, cl, best.cand, costs, ("none", "full"), CostOptions.for_cluster(cl))
    assert solve_partition(pb).form == "interval"
    brute = brute_force_partition(pb)
    assert best.objective == pytest.approx(brute[0], rel=1e-9)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    units=st.lists(unit_st, min_size=3, max_size=6),
    stages=st.integers(2, 4),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    extra_m=st.integers(0, 6),
    dp=st.sampled_from([1, 2, 4]),
    zero=st.integers(0, 3),
    memory=st.floats(8, 120),
    cut=st.sampled_from([None, 0.9, 1 - 1e-6, 1 + 1e-6, 1.1]),
)
def test_chain_dp_equals_brute_force(units, stages, schedule, extra_m, dp, zero, memory, cut):
    """One stage per rank on any unit sequence: the branch and bound over (largest stage, largest tail)
    caps with its shortest paths (ilp/chain.py) finds the brute-force optimum on its own (no incumbent),
    and below a limit it finds the optimum when it is below the limit, else nothing."""
    us = [make_unit(f"u{i}", f"s{i}", *spec) for i, spec in enumerate(units)]
    stages = min(stages, len(us))
    graph, cluster, options = make_graph(us), cluster_with(memory), CostOptions()
    cand = Candidate(dp, 1, stages, 1, 1, stages + extra_m, schedule, zero if dp > 1 else 0, False)
    modes = ("none", "selective", "full")
    costs = CostTable(graph, cluster, None).units(cand)
    brute = brute_force_partition(PartitionProblem(graph, cluster, cand, costs, modes, options))
    limit = None if cut is None or brute is None else cut * brute[0]
    got = solve_chain(PartitionProblem(graph, cluster, cand, costs, modes, options), limit)
    assert got is not None
    if brute is None or (limit is not None and brute[0] >= limit):
        assert got.partition is None
        return
    assert got.partition is not None and got.recompute is not None
    ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=options), got.partition, got.recompute)
    assert max(ev.rank_memory.values()) <= cluster.gpu.memory_bytes * (1 + 1e-9)
    assert got.objective == pytest.approx(ev.objective, rel=1e-12)
    assert ev.objective == pytest.approx(brute[0], rel=1e-9)
    # and through solve_partition, which picks the dynamic program for these candidates
    pb = PartitionProblem(graph, cluster, cand, costs, modes, options)
    assert solve_partition(pb).objective == pytest.approx(brute[0], rel=1e-9)


def test_chain_gives_up_after_its_path_budget_and_cbc_solves(monkeypatch):
    """With no shortest paths allowed the dynamic program gives up (None) and solve_partition falls back to
    CBC, whose optimum is the brute-force one."""
    from planner.search.ilp import chain

    sizes = [(4e8, 3e12), (1e8, 9e12), (7e8, 2e12), (2e8, 6e12), (5e8, 4e12), (3e8, 5e12)]
    us = [make_unit(f"u{i}", f"s{i}", int(p), f, 500_000_000, 20_000_000) for i, (p, f) in enumerate(sizes)]
    graph, cluster, options = make_graph(us), cluster_with(80), CostOptions()
    cand = Candidate(2, 1, 3, 1, 1, 8, "1f1b", 1, False)
    costs = CostTable(graph, cluster, None).units(cand)
    modes = ("none", "full")
    brute = brute_force_partition(PartitionProblem(graph, cluster, cand, costs, modes, options))
    assert brute is not None
    assert chain.solve_chain(PartitionProblem(graph, cluster, cand, costs, modes, options), None) is not None
    monkeypatch.setattr(chain, "MAX_PATHS", 0)
    assert chain.solve_chain(PartitionProblem(graph, cluster, cand, costs, modes, options), None) is None
    res = solve_partition(PartitionProblem(graph, cluster, cand, costs, modes, options), cuts=False)
    assert res.form != "chain" and res.objective == pytest.approx(brute[0], rel=1e-6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pre=unit_st,
    block=unit_st,
    post=unit_st,
    v=st.sampled_from([9, 10]),
    spare=st.integers(0, 2),
    m_rounds=st.integers(1, 2),
    memory=st.floats(8, 120),
    zero=st.integers(0, 3),
)
def test_more_than_eight_stages_per_rank_equals_brute_force(pre, block, post, v, spare, m_rounds, memory, zero):
    """v > 8 (Megatron-LM's tuned GPT-3 175B recipe runs 12): 2 ranks x v stages over 2v + spare units, the
    stages uneven in blocks (the embedding and the head each take a stage's place), exact against brute force."""
    n_blocks = 2 * v - 2 + spare
    us = [make_unit("embed", "pre", *pre)]
    us += [make_unit(f"blocks.{i}", "blk", *block) for i in range(n_blocks)]
    us += [make_unit("head", "post", *post)]
    graph = make_graph(us)
    cand = Candidate(2, 1, 2, v, 1, 2 * m_rounds, "interleaved-1f1b", zero, False)
    _check(graph, cluster_with(memory), cand, ("none", "full"), with_dp=False)


def test_searched_virtual_stages_take_real_runs_layouts():
    """The free search's v: GPT-3 175B's 96 layers on 8 ranks reach 12 (one layer per stage), Llama 3 405B's
    126 layers on 8 ranks take 2 (the embedding and the head counted as blocks); a pin takes any v that leaves
    every stage a unit, and a pin beyond that is rejected with the reason."""
    from planner.search.space import Pins, enumerate_space, max_virtual_stages, searched_virtual_stages

    assert searched_virtual_stages(8, 98, 96) == [2, 3, 4, 6, 12]
    assert 2 in searched_virtual_stages(8, 128, 126) and 12 not in searched_virtual_stages(8, 128, 126)
    assert searched_virtual_stages(2, 40, 0) == list(range(2, 9))
    assert max_virtual_stages(8, 98) == 12
    us = [make_unit("embed", "pre", 10**7, 1e11, 10**7, 10**6)]
    us += [make_unit(f"blocks.{i}", "blk", 10**7, 1e11, 10**7, 10**6) for i in range(17)]
    us += [make_unit("head", "post", 10**7, 1e11, 10**7, 10**6)]
    graph = make_graph(us)  # 19 units
    cl = load_cluster("a100-sxm4-80gb", 1, 2)
    pins = Pins(pp=2, virtual_stages=9, schedule="interleaved-1f1b")
    assert {c.virtual_stages for c in enumerate_space(graph, cl, 4, pins).candidates} == {9}
    space = enumerate_space(graph, cl, 4, Pins(pp=2, virtual_stages=10, schedule="interleaved-1f1b"))
    assert not space.candidates and any("more stages than" in why for _, why in space.rejected)
