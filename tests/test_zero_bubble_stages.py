"""Zero-bubble's weight step and the stages after the first (`planner.search.problem.zero_bubble_stages`): a
trained weight whose values meet nothing an earlier stage computed before its stage ends gets no gradient
(torch's split backward groups a stage's weights with its inputs), so the search leaves such stages out."""

from __future__ import annotations

import json
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from synthetic import make_graph, make_unit
from test_ranks_bb import MODES, assert_bounds_below_every_plan, unit_st
from typer.testing import CliRunner

from planner.cli.main import app
from planner.codegen.check import check_plan_runs
from planner.cost.model import Candidate, CostOptions
from planner.errors import PlannerError
from planner.hardware.load import load_cluster
from planner.model.analysis import analyse_model
from planner.model.load import load_model_file
from planner.plan import load_plan
from planner.search.bounds import lower_bounds
from planner.search.ilp import ranks
from planner.search.problem import PartitionProblem, zero_bubble_stages
from planner.search.reference import brute_force_partition
from planner.search.search import BB_NODES_MAX, CostTable, evaluate

ROOT = Path(__file__).resolve().parents[1]
TWO_TOWER = ROOT / "tests" / "fixtures" / "models" / "authored" / "clip_two_tower.py"


@pytest.fixture(scope="module")
def two_tower():
    return analyse_model(load_model_file(TWO_TOWER, dtype="fp32"))


def test_a_tower_whose_embedding_meets_the_other_only_at_the_logits(two_tower):
    """CLIP-like: the unit holding the token embedding (and the image projection) starts the text tower, which
    meets the image tower's values only in the last unit (the logits). A stage after the first that holds the
    text tower's start must reach that unit; one that starts after it reads the tower's values as its inputs."""
    names = [u.name for u in two_tower.units]
    start = next(i for i, n in enumerate(names) if "token" in n)
    U = len(names)
    ok = zero_bubble_stages(two_tower)
    assert ok is not None
    for i in range(1, start + 1):
        assert not ok[i, start + 1 : U].any()  # the text tower's start without the logits
        assert ok[i, U]
    for i in range(start + 1, U):
        assert ok[i, i + 1 : U + 1].all()  # the tower's values cross the stage boundary
    assert ok[1 : start + 1, 2 : start + 1].all()  # stages of the image tower alone


def test_a_chain_model_needs_no_rule():
    graph = analyse_model(load_model_file(ROOT / "sample_models" / "gpt.py", dtype="fp32"))
    assert zero_bubble_stages(graph) is None


def test_a_pinned_zero_bubble_two_tower_plan_is_found_and_passes_the_check(tmp_path):
    """Before the rule, every zero-bubble plan the search ranked split the text tower from the logits and the
    plan-time check refused all six (exit 2); now the search finds one that runs."""
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "plan", str(TWO_TOWER), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8",
            "--pp", "2", "--schedule", "zero-bubble", "--out", str(out), "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["parallel"]["schedule"] == "zero-bubble"
    stages = [s["units"] for s in plan["stages"]]
    text = next(i for i, units in enumerate(stages) if any("token" in u for u in units))
    assert text == 0 or stages[text][-1] == stages[-1][-1]

    # The layout the rule leaves out, written by hand: the check (torch's own split backward) refuses it.
    loaded = load_plan(out)
    units = [u for st in loaded.stages for u in st.units]
    start = next(i for i, u in enumerate(units) if "token" in u)
    cuts = [0, 1, start, start + 1, len(units)]  # the text tower's start alone in stage 2, the logits in stage 3
    bad = loaded.model_copy(update={"stages": [
        st.model_copy(update={"units": units[a:b], "modules": [m for u in units[a:b] for m in u.split("+")]})
        for st, a, b in zip(loaded.stages, cuts[:-1], cuts[1:], strict=True)
    ]})
    with pytest.raises(PlannerError, match="weight step would compute no gradient for token.weight"):
        check_plan_runs(bad)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    units=st.lists(unit_st, min_size=4, max_size=7),
    meets=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 7)), min_size=7, max_size=7),
    m_rounds=st.integers(1, 3),
    dp=st.sampled_from([1, 2]),
    memory=st.floats(20, 120),
)
def test_the_branch_and_bound_and_brute_force_agree_under_the_rule(units, meets, m_rounds, dp, memory):
    """Random rules (each unit's weights meet an earlier unit's values from some stage end on): the branch and
    bound finds the brute-force optimum over the partitions the rule allows, both leave the others out, and the
    bounds stay below it."""
    U = len(units)
    us = []
    for i, spec in enumerate(units):
        has, first, late = meets[i]
        row: list[int] = []
        if i and has:  # a stage ending before unit j (j = i+1..U): `first` until `late` units on, then 0
            row = [min(first, U) if k < late else 0 for k in range(U - i)]
        us.append(make_unit(f"u{i}", f"s{i}", *spec).model_copy(update={"kind": "other", "grad_meet": row}))
    cl = load_cluster("a100-sxm4-80gb", 2)
    cluster = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory})})
    graph = make_graph(us)
    cand = Candidate(dp, 1, 2, 2, 1, 2 * m_rounds, "zero-bubble", 1 if dp > 1 else 0, False)
    costs = CostTable(graph, cluster, None).units(cand)

    def problem() -> PartitionProblem:
        return PartitionProblem(graph, cluster, cand, costs, MODES, CostOptions())

    brute = brute_force_partition(problem())
    assert_bounds_below_every_plan(problem())  # the tables read the rule for every stage after the first
    got = ranks.solve_ranks(problem(), None, max_nodes=None)
    assert got.proven
    if brute is None:
        assert got.partition is None
        return
    assert problem().stages_ok(brute[1])
    assert got.partition is not None and got.recompute is not None
    assert problem().stages_ok(got.partition)
    ev = evaluate(problem(), got.partition, got.recompute)
    assert ev.objective == pytest.approx(brute[0], rel=1e-9)
    assert lower_bounds(problem()).time <= brute[0] * (1 + 1e-9)


def test_the_branch_and_bound_reads_the_rule_for_the_stages_of_other_ranks():
    """CLIP-shaped at full size: 24 image layers, then a 12-layer text tower whose first unit meets the image
    tower only at the logits, so under zero-bubble the last stage holds the whole text tower. The per-rank
    tables of the branch and bound see that for every stage, not only the rank's own (the rank that gets the
    last stage carries the tower's time and gradient sync, the others cannot take a share of it): below 90%
    of the optimum of dp8 x pp8x2 it proves that no plan exists within the search's budget for one candidate
    (BB_NODES_MAX; 18,976 nodes when other ranks' stages ignored the rule and the rank's tail had no table)."""
    n_img, n_txt = 24, 12
    us = [make_unit("patch", "p", 10**6, 1e11, 10**7, 10**7)]
    us += [make_unit(f"img{i}", "img", 300_000_000, 2e13, 10**9, 5 * 10**7) for i in range(n_img)]
    start = len(us)
    us += [make_unit("tok", "tok", 40_000_000, 5e11, 10**8, 10**7)]
    us += [make_unit(f"txt{i}", "txt", 85_000_000, 3e12, 3 * 10**8, 10**7) for i in range(n_txt)]
    us += [make_unit("logits", "lg", 10**6, 1e10, 10**7, 10**6)]
    U = len(us)
    rows: list[list[int]] = [[] for _ in us]
    rows[start] = [U] * (U - 1 - start) + [0]  # meets an earlier unit's values only once the stage ends at U
    graph = make_graph([u.model_copy(update={"kind": "other", "grad_meet": r}) for u, r in zip(us, rows, strict=True)])
    cluster = load_cluster("h100-sxm-80gb", 8)
    cand = Candidate(8, 1, 8, 2, 1, 16, "zero-bubble", 1, False)
    costs = CostTable(graph, cluster, None).units(cand)

    def problem() -> PartitionProblem:
        return PartitionProblem(graph, cluster, cand, costs, MODES, CostOptions())

    best = ranks.solve_ranks(problem(), None, max_nodes=None)
    assert best.proven and best.partition is not None
    assert best.partition[-1] == list(range(start, U))
    below = ranks.solve_ranks(problem(), 0.9 * best.objective, max_nodes=BB_NODES_MAX)
    assert below.partition is None and below.proven
