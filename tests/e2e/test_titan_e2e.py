"""torchtitan models planned by `planner plan` for 4 CPU ranks; the generated launch.sh trains 3 steps and the
loss equals a single-process run of the same micro-batches within 1e-4:

- Llama 3 debugmodel (torchtitan:llama3 --flavor debugmodel, blocks in a ModuleDict): dp4, pp2 x dp2 and
  tp2 x dp2;
- DeepSeek-V3 debugmodel (torchtitan's MoE: 8 grouped experts, top-3, a shared expert, in 5 of its 6 layers):
  dp4, pp2 x dp2, tp2 x dp2 (the shared expert and the MLP of the dense first layer sharded; the latent
  attention, the router and the routed experts replicated), and with expert parallelism dp4 ep2 and
  pp2 x dp2 ep2 (each rank keeps 4 of the 8 experts of every MoE layer; tokens travel by all-to-all over
  gloo)."""

from __future__ import annotations

import json
import math

import pytest
from e2e.plans import reference_of
from e2e.test_train_e2e import STEPS, run, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.e2e

CASES = {
    "dp4": ["--dp", "4"],
    "pp2_dp2": ["--pp", "2", "--dp", "2", "--schedule", "1f1b"],
    "tp2_dp2": ["--tp", "2", "--dp", "2"],
}


DEEPSEEK_CASES = {
    "dp4": ["--dp", "4", "--ep", "1"],
    "pp2_dp2": ["--pp", "2", "--dp", "2", "--ep", "1", "--schedule", "1f1b"],
    "tp2_dp2": ["--tp", "2", "--dp", "2"],
    "dp4_ep2": ["--dp", "4", "--ep", "2"],
    "pp2_dp2_ep2": ["--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "1f1b"],
}


def plan_titan(out, *pins: str, model: str = "llama3"):
    return CliRunner().invoke(
        app,
        [
            "plan", f"torchtitan:{model}", "--flavor", "debugmodel", "-a", "seq=32", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "4", "--global-batch-size", "8", "--micro-batch-size", "2", *pins, "--lr", "1e-3",
            "--out", str(out), "--quiet",
        ],
    )


@pytest.mark.parametrize("case", list(CASES))
def test_titan_llama3_trains_like_one_process(case, tmp_path):
    out = tmp_path / "plan"
    result = plan_titan(out, *CASES[case])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.parallel.world_size == 4
    if plan.parallel.tp > 1:
        # What the cost model split is what the script shards: attention (the fused qkv, its heads kept
        # apart through the complex rotary table), the MLP, the vocabulary-parallel embedding and LM head.
        assert not plan.tp.refused, plan.tp.refused
        for name in ("tok_embeddings", "layers.0.attention.qkv_linear.wqkv", "layers.0.attention.wo", "lm_head"):
            assert name in plan.tp.styles, (name, sorted(plan.tp.styles))
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    expected = train(reference_of(plan), tmp_path / "reference", 1)
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx([s["loss"] for s in expected["steps"]], abs=1e-4), (case, losses)


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_titan_deepseek_v3_trains_like_one_process(case, tmp_path):
    out = tmp_path / "plan"
    result = plan_titan(out, *DEEPSEEK_CASES[case], model="deepseek_v3")
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    ep = 2 if case.endswith("ep2") else 1
    assert (plan.parallel.world_size, plan.parallel.ep) == (4, ep)
    # The routed experts are named whenever they are sharded or a traced graph must keep them as calls.
    moe = {f"layers.{i}.moe.routed_experts": 8 for i in range(1, 6)}
    assert plan.experts == (moe if ep > 1 or plan.parallel.pp > 1 else {})
    assert (plan.predicted.comm.expert_parallel_s > 0) == (ep > 1)
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["layout"]["ep"] == ep
    expected = train(reference_of(plan), tmp_path / "reference", 1)
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx([s["loss"] for s in expected["steps"]], abs=1e-4), (case, losses)
    norms = [s["grad_norm"] for s in metrics["steps"]]
    assert norms == pytest.approx([s["grad_norm"] for s in expected["steps"]], rel=1e-3), (case, norms)
