"""planner.runtime.layout: the Layout validates the plan's constants with messages that state the rule, the
values and the fix, and derives the facts the runtime uses."""

from __future__ import annotations

import json

import pytest
from e2e.plans import make_plan, stage_ranks

from planner.codegen.render import runtime_objects
from planner.cost.schedules import stage_rank as cost_stage_rank
from planner.runtime import Layout, LayoutError, Stage, TPPlan, stage_rank


def _layout(**changes):
    base = dict(
        pp=2, dp=2, tp=1, micro_batch_size=2, num_micro_batches=4,
        stages=[(0, ["embed", "blocks.0"], "none"), (1, ["blocks.1", "head"], "full")],
    )
    return Layout(**{**base, **changes})


def test_derived_facts():
    layout = _layout(tp=2, sequence_parallel=True, mesh_dims=["pp", "dp", "tp"])
    assert layout.world_size == 8 and layout.num_stages == 2 and layout.samples_per_step == 16
    assert layout.pp_enabled and layout.tp_enabled and layout.sp_enabled
    assert layout.stages[1] == Stage(1, ("blocks.1", "head"), "full")
    assert layout.stage_of_module == {"embed": 0, "blocks.0": 0, "blocks.1": 1, "head": 1}
    assert layout.stages_on(1) == [1] and layout.mesh_shape == (2, 2, 2)
    assert not _layout(sequence_parallel=True).sp_enabled  # sequence parallelism needs tp > 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dp": 0}, "DP must be a positive integer, got 0"),
        ({"mesh_dims": ("pp", "tp")}, "MESH_DIMS must order 'pp', 'dp' and 'tp', got \\['pp', 'tp'\\]"),
        ({"schedule": "2f2b"}, "Unknown schedule '2f2b'"),
        ({"zero_stage": 4}, "ZERO_STAGE must be 0, 1, 2 or 3, got 4"),
        ({"global_batch_size": 10}, r"GLOBAL_BATCH_SIZE \(10\) must equal DP \(2\) x NUM_MICRO_BATCHES \(4\)"),
        ({"virtual_stages": 2}, r"2 stage\(s\), but PP \(2\) x VIRTUAL_STAGES \(2\) = 4"),
        ({"stages": [(0, ["a"], "none"), (0, ["b"], "none")]}, "Stage 1 is on pp rank 0, but schedule 1f1b runs it"),
        ({"stages": [(0, ["a"], "none"), (1, [], "none")]}, "Stage 1 owns no modules"),
        ({"stages": [(0, ["a"], "none"), (1, ["a"], "none")]}, "Module 'a' is in stages 0 and 1"),
        ({"stages": [(0, ["a"], "some"), (1, ["b"], "none")]}, "Stage 0 has recompute 'some'"),
        ({"tp_plan": {"head": "colwise"}}, "TP_PLAN must come as a TPPlan, got dict"),
        ({"pp": 1, "virtual_stages": 2, "stages": [(0, ["a"], "none")] * 2}, "VIRTUAL_STAGES must be 1"),
    ],
)
def test_broken_layouts_are_refused_with_the_fix(changes, message):
    with pytest.raises(LayoutError, match=message) as info:
        _layout(**changes)
    assert "Re-plan" in str(info.value)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
def test_stage_placement_is_the_cost_models(schedule):
    for pp in (1, 2, 3, 4):
        v = 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1
        for s in range(pp * v):
            assert stage_rank(schedule, pp, s) == cost_stage_rank(schedule, pp, v, s)
        assert [stage_rank(schedule, pp, s) for s in range(pp * v)] == stage_ranks(schedule, pp, pp * v)


def test_zero_bubble_places_stages_in_a_v():
    assert [stage_rank("zero-bubble", 3, s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [stage_rank("interleaved-1f1b", 3, s) for s in range(6)] == [0, 1, 2, 0, 1, 2]


def test_runtime_objects_of_a_plan():
    plan = make_plan("gpt", pp=2, dp=2, tp=2, zero_stage=1, num_micro_batches=4, recompute="full")
    layout, model, training = runtime_objects(plan)
    assert (layout.pp, layout.dp, layout.tp, layout.zero_stage, layout.num_micro_batches) == (2, 2, 2, 1, 4)
    assert [list(s.modules) for s in layout.stages] == [s.modules for s in plan.stages]
    assert layout.tp_plan == plan.tp and layout.global_batch_size == plan.parallel.global_batch_size
    assert model.path == plan.model.path and model.loss_fn == "loss_fn" and model.model_args == plan.model.model_args
    assert (training.seed, training.lr, training.steps, training.dtype) == (0, 0.01, 3, "fp32")


def test_the_tp_decision_travels_as_one_tpplan_from_plan_json_to_the_layout():
    """The analysis' TPPlan (plan.tp) is what the Layout holds: rebuilt from plan.json's flat keys as the
    runtime reads them (`TPPlan.from_keys`), or from train.py's constants with runs of numbered names."""
    plan = make_plan("gpt", pp=2, dp=2, tp=2, num_micro_batches=4)
    assert plan.tp.styles
    again = TPPlan.from_keys(json.loads(plan.to_json()))
    assert again == plan.tp
    layout = _layout(tp=2, tp_plan=again)
    assert layout.tp_plan is again and layout.tp_plan.styles == plan.tp.styles
    compressed = TPPlan(styles={"blocks.{0-1}.attn.qkv": "colwise"}, head_attrs={"blocks.{0-1}.attn": ["heads"]},
                        fused={"blocks.{0-1}.attn.qkv": 3}, transposed=["blocks.{0-1}.attn.qkv"])
    assert compressed.styles == {"blocks.0.attn.qkv": "colwise", "blocks.1.attn.qkv": "colwise"}
    assert compressed.head_attrs == {"blocks.0.attn": ["heads"], "blocks.1.attn": ["heads"]}
    assert compressed.fused == {"blocks.0.attn.qkv": 3, "blocks.1.attn.qkv": 3}
    assert compressed.transposed == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]


def test_an_unknown_tp_style_is_refused_with_the_fix():
    with pytest.raises(LayoutError, match="TP_PLAN gives head the style 'diagonal'") as info:
        TPPlan(styles={"head": "diagonal"})  # type: ignore[dict-item]
    assert "Re-plan" in str(info.value)
