"""TPPlan: the one home of "which modules TP shards, and how", merged once from the analysis' units and carried
by the Plan, whose plan.json keeps the five flat keys (tp_plan, tp_head_attrs, tp_fused, tp_transposed,
tp_refused) it always had."""

from __future__ import annotations

import dataclasses
import json

import pytest
from e2e.plans import make_plan
from pydantic import ValidationError

from planner.model.graph import TPPlan, Unit
from planner.plan import Plan, load_plan
from planner.runtime.layout import TP_KEYS


def _unit(name: str, **tp: object) -> Unit:
    return Unit.model_construct(name=name, **tp)  # only its TP decisions are read


def test_the_units_decisions_merge_into_one_plan_sorted_with_each_refusal_once():
    units = [
        _unit("b1", tp_styles={"b1.o": "rowwise", "b1.qkv": "colwise"}, tp_fused={"b1.qkv": 3},
              tp_refused=["b1.x is not sharded"]),
        _unit("b0", tp_styles={"b0.qkv": "colwise"}, tp_head_attrs={"b0": ["heads"]}, tp_transposed=["b0.qkv"],
              tp_refused=["b1.x is not sharded", "b0.y is not sharded"]),
    ]
    tp = TPPlan.of(units)
    assert list(tp.styles) == ["b0.qkv", "b1.o", "b1.qkv"]
    assert (tp.head_attrs, tp.fused, tp.transposed) == ({"b0": ["heads"]}, {"b1.qkv": 3}, ["b0.qkv"])
    assert tp.refused == ["b1.x is not sharded", "b0.y is not sharded"]
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen: one decision, not edited on the way
        tp.styles = {}  # type: ignore[misc]


def test_plan_json_keeps_the_flat_keys_and_reads_back_the_same_plan(tmp_path):
    plan = make_plan("gpt", tp=2, pp=2)
    assert plan.tp.styles
    data = json.loads(plan.to_json())
    # every key, but tp_copied only where some row-parallel output is copied (schema minor 6), tp_summed only
    # where some weight held whole has its gradient summed over tp (minor 7)
    assert "tp" not in data and set(TP_KEYS) - {"tp_copied", "tp_summed"} <= set(data)
    assert "tp_copied" not in data and "tp_summed" not in data
    assert data["tp_plan"] == plan.tp.styles
    (tmp_path / "plan.json").write_text(plan.to_json())
    again = load_plan(tmp_path)
    assert again.tp == plan.tp and again.to_json() == plan.to_json()


def test_a_plan_giving_tp_twice_is_refused():
    data = json.loads(make_plan("gpt", tp=2).to_json())
    with pytest.raises(ValidationError, match="not both"):
        Plan.model_validate({**data, "tp": {}})


def test_a_tp_key_of_the_wrong_type_is_refused_naming_the_key(tmp_path):
    from planner.errors import PlanError

    data = json.loads(make_plan("gpt", tp=2).to_json())
    data["tp_fused"] = {"blocks.0.attn.qkv": "3"}  # a string where plan.json holds a number
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"tp_fused\.blocks\.0\.attn\.qkv: a number of equal chunks or a list"):
        load_plan(tmp_path)
