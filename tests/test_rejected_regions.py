"""Rejected regions name what was rejected: no region covers a plan the search ranked (issue 11: Mixtral on
64 H100s listed "dp=64 tp=1 pp=1 ep=2: out of memory" next to a runner-up dp 64 ep 2 pp 1 with ZeRO-2)."""

from __future__ import annotations

from pathlib import Path

from planner.pipeline import PlanRequest, analyse, plan_model
from planner.search.search import _region

GPT = str(Path(__file__).resolve().parents[1] / "sample_models" / "gpt.py")


def test_no_rejected_region_covers_a_ranked_plan():
    # GPT-3 6.7B on 8 A100 40GB: dp 8 is out of memory under ZeRO-0/1 and ranked under ZeRO-2/3
    req = PlanRequest(
        model_path=GPT, model_args={"preset": "gpt3-6.7b"}, gpu="a100-sxm4-40gb", nodes=1, global_batch_size=64
    )
    plan, _, result = plan_model(req, analyse(req))
    ranked = {(_region(ev.cand), ev.cand.micro_batch_size) for ev in result.ranked}
    memory = [(region, why) for region, why in result.rejected if "memory" in why]
    assert memory
    for region, _ in result.rejected:
        if " mbs=" not in region:
            continue  # a rule of the space (space.py), not a searched candidate
        head, sizes = region.rsplit(" mbs=", 1)
        assert not any((head, int(b)) in ranked for b in sizes.split(",")), region
    # the case the coarse label got wrong: a region of the same degrees both rejected and ranked
    degrees = {ev.cand.dp for ev in result.ranked if ev.cand.tp == ev.cand.pp == 1}
    assert any(r.startswith(f"dp={dp} tp=1 pp=1 zero=") for r, _ in memory for dp in degrees)
    # what plan.json and the report list
    assert {(r.region, r.reason) for r in plan.rejected} >= set(memory)
