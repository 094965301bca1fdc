"""A plan that the generated script cannot run for its layout gives way to the next runner-up that runs
(planner/cli/plan.py best_that_runs): the chosen plan is the best ranked one that passes the plan-time check, and the
ones before it are listed under the rejected regions with the check's reason. When none runs, `planner plan`
exits 2 and writes nothing. The check itself is replaced here by one that refuses chosen layouts, so the
test sees the fallback and not the check (tests/test_runtime_check.py covers the check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import planner.cli.plan
from planner.cli.main import app
from planner.errors import LayoutRefusedError, PlanError

TINY = Path(__file__).resolve().parent / "fixtures" / "tiny_gpt.py"
ARGS = ["plan", str(TINY), "--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", "8", "-q"]


def _layout(plan) -> tuple:
    p = plan.parallel
    return (p.dp, p.tp, p.pp, p.virtual_stages, p.schedule, p.zero_stage, p.micro_batch_size)


def test_the_best_plan_that_runs_is_chosen_and_the_others_are_listed(tmp_path, monkeypatch):
    free = tmp_path / "free"
    assert CliRunner().invoke(app, [*ARGS, "--out", str(free)]).exit_code == 0
    best = json.loads((free / "plan.json").read_text())
    refused: list[tuple] = []

    def refuse_the_first_two(plan, worker=None, meanwhile=None) -> None:
        if len(refused) < 2:
            if meanwhile is not None:
                meanwhile()  # as while a worker checks it: the refused plan's files rendered ahead, then dropped
            refused.append(_layout(plan))
            raise LayoutRefusedError("The plan cannot run: a weight is held twice on one pp rank (test).")

    monkeypatch.setattr(planner.cli.plan, "check_plan", refuse_the_first_two)
    out = tmp_path / "fallback"
    result = CliRunner().invoke(app, [*ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    alternatives = [a["parallel"] for a in best["alternatives"]]
    assert plan["parallel"] == alternatives[1]  # the third ranked plan of the free search
    assert plan["parallel"] != best["parallel"]
    reasons = [r for r in plan["rejected"] if r["reason"].startswith("fails the plan-time check: a weight")]
    assert len(reasons) == 2 and all(r["count"] == 1 for r in reasons)
    assert plan["predicted"]["iteration_time_s"] >= best["predicted"]["iteration_time_s"]


def test_when_no_ranked_plan_runs_nothing_is_written(tmp_path, monkeypatch):
    def refuse(plan, worker=None, meanwhile=None) -> None:
        raise LayoutRefusedError("The plan cannot run: a stage sends a dict (test).")

    monkeypatch.setattr(planner.cli.plan, "check_plan", refuse)
    out = tmp_path / "none"
    result = CliRunner().invoke(app, [*ARGS, "--top-k", "2", "--out", str(out)])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "The plan cannot run: a stage sends a dict (test)." in message
    assert "The 2 runner-up plans fail the check too." in message and "Traceback" not in message
    assert not out.exists() or not any(out.iterdir())


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch):
    monkeypatch.setenv("PLANNER_NO_CACHE", "1")


def test_a_failure_of_the_model_itself_is_raised_at_once(tmp_path, monkeypatch):
    """A loss that fails, or model code that fails on meta, fails in every layout: no fallback, one check."""
    calls = []

    def refuse(plan, worker=None, meanwhile=None) -> None:
        calls.append(plan)
        raise PlanError("The plan cannot run: the loss returns a vector (test).")

    monkeypatch.setattr(planner.cli.plan, "check_plan", refuse)
    result = CliRunner().invoke(app, [*ARGS, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "the loss returns a vector (test)" in result.output
    assert len(calls) == 1
