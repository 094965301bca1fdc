"""Fine-tuning: the sample GPT with frozen embeddings, and with peft's LoRA adapters on q and v (base frozen),
planned by `planner plan` (plan.json's gradient and optimizer memory count the trainable parameters only)
and trained on CPU ranks like one process: FSDP, tensor parallelism and pipeline stages with frozen weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e.plans import TINY, ci_cases, make_plan, reference_of
from e2e.test_train_e2e import STEPS, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import Plan, load_plan

pytestmark = pytest.mark.e2e

FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "models" / "finetune_gpt.py")


def finetuned(plan: Plan, mode: str) -> Plan:
    model = plan.model.model_copy(update={"path": FIXTURE, "model_args": {**TINY["gpt"], "mode": mode}})
    return plan.model_copy(update={"model": model})


def lora_planned_tp2_dp2(out: Path) -> Plan:
    """`planner plan` shards the adapted projections' base_layer and lora_B column-wise (lora_A replicated)."""
    args = [f"{k}={v!r}" for k, v in {**TINY["gpt"], "mode": "lora"}.items()]
    result = CliRunner().invoke(
        app,
        ["plan", FIXTURE, *[x for a in args for x in ("--model-arg", a)], "--gpu", "cpu", "--nodes", "1",
         "--gpus-per-node", "4", "--global-batch-size", "8", "--micro-batch-size", "2", "--dtype", "fp32", "--tp",
         "2", "--dp", "2", "--lr", "1e-2", "--out", str(out), "--quiet"],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.tp.styles["blocks.0.attn.q.lora_B.default"] == "colwise", plan.tp.styles
    return plan


# (frozen weights under TP: LoRA's base_layer, column-sharded; under FSDP ZeRO-3: LoRA's base model)
CASES = {
    "frozen_embeddings_pp2_dp2": (lambda out: finetuned(make_plan("gpt", pp=2, dp=2), "frozen"), 4),
    "lora_dp2_zero3": (lambda out: finetuned(make_plan("gpt", dp=2, zero_stage=3), "lora"), 2),
    # a traced stage calls the adapters, not the LoRA layer: each rank's adapters start as peft's (B zero)
    "lora_pp2_dp2": (lambda out: finetuned(make_plan("gpt", pp=2, dp=2), "lora"), 4),
    "lora_planned_tp2_dp2": (lora_planned_tp2_dp2, 4),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One single-process run per distinct reference (the LoRA layouts share one)."""
    cache: dict[str, list] = {}

    def get(plan: Plan) -> list:
        ref = reference_of(plan)
        if ref.to_json() not in cache:
            cache[ref.to_json()] = train(ref, tmp_path_factory.mktemp("reference"), 1)["steps"]
        return cache[ref.to_json()]

    return get


KEPT = {"frozen_embeddings_pp2_dp2", "lora_planned_tp2_dp2"}


@pytest.mark.parametrize("case", ci_cases(CASES, KEPT))
def test_fine_tune_trains_like_one_process(case, tmp_path, reference):
    if case.startswith("lora"):
        pytest.importorskip("peft")
    make, processes = CASES[case]
    plan = make(tmp_path / "planned")
    steps = train(plan, tmp_path / "run", processes)["steps"]
    expected = reference(plan)
    tol = 1e-3 if plan.parallel.tp > 1 else 1e-4
    assert len(steps) == STEPS
    for got, want in zip(steps, expected, strict=True):
        assert abs(got["loss"] - want["loss"]) <= tol, (case, steps, expected)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= tol * want["grad_norm"], (case, steps, expected)


@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_plan_counts_gradients_and_optimizer_state_of_trainable_parameters_only(mode, tmp_path):
    if mode == "lora":
        pytest.importorskip("peft")
    args = [f"{k}={v!r}" for k, v in {**TINY["gpt"], "mode": mode}.items()]
    result = CliRunner().invoke(
        app,
        ["plan", FIXTURE, *[x for a in args for x in ("--model-arg", a)], "--gpu", "cpu", "--nodes", "1",
         "--gpus-per-node", "2", "--global-batch-size", "8", "--dtype", "fp32", "--dp", "2", "--zero-stage", "3",
         "--out", str(tmp_path / "p"), "--quiet"],
    )
    assert result.exit_code == 0, result.output
    memory = json.loads((tmp_path / "p" / "plan.json").read_text())["stages"][0]["memory"]
    import torch

    from planner.runtime.model import load_model_file

    with torch.device("meta"):
        model = load_model_file(FIXTURE).build_model(mode=mode, **TINY["gpt"])
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < total
    # fp32: 4 bytes of weights and of gradients, 8 of Adam's moments; ZeRO-3 over dp 2 shards each
    assert memory["weights"] == pytest.approx(total * 4 / 2, rel=1e-6)
    assert memory["gradients"] == pytest.approx(trainable * 4 / 2, rel=1e-6)
    assert memory["optimizer"] == pytest.approx(trainable * 8 / 2, rel=1e-6)
