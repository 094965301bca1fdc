"""Mixture of experts with expert parallelism on 4 CPU ranks: planned by `planner plan --dp 4 --ep 2` (and
`--pp 2 --dp 2 --ep 2`: experts sharded over the dp group inside each pipeline stage), the generated
launch.sh shards each MoE layer's experts over 2 ranks (all-to-all dispatch and combine over gloo) and trains
3 steps with the loss and gradient norm of a single-process run of the same micro-batches.

- tiny HF Mixtral: stacked expert weights (MixtralExperts), each rank keeping 2 of the 4 experts;
- tiny HF DeepSeek-V2: the same stacked experts in 3 of its 4 layers (the first is dense), plus a shared expert;
- the DeepSeek-style fixture: experts in an nn.ModuleList plus a shared expert.

With a pipeline each stage's traced graph keeps the experts modules as calls (torch.fx leaves for the
fixture; for Mixtral, which only torch.export traces, an opaque op turned back into the call), so the CPU
ranks run the experts' own CPU code, not the GPU path (int32 histc) a meta trace would inline.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from e2e.plans import ci_cases, reference_of
from e2e.test_train_e2e import STEPS, run, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan

pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
MIXTRAL = (MODELS / "hf_tiny.py", ["--model-arg", "arch=mixtral"])
DEEPSEEK = (MODELS / "deepseek_moe.py", [])
DP4 = ["--dp", "4", "--ep", "2"]
PP2_DP2 = ["--pp", "2", "--dp", "2", "--ep", "2"]
DEEPSEEK_V2 = (MODELS / "hf_tiny.py", ["--model-arg", "arch=deepseek_v2"])
CASES = {
    "mixtral_dp4_ep2": (*MIXTRAL, DP4),
    "deepseek_v2_dp4_ep2": (*DEEPSEEK_V2, DP4),
    "deepseek_style_dp4_ep2": (*DEEPSEEK, DP4),
    "deepseek_style_pp2_dp2_ep2": (*DEEPSEEK, PP2_DP2),
    "mixtral_pp2_dp2_ep2": (*MIXTRAL, PP2_DP2),
}


KEPT = {"deepseek_v2_dp4_ep2", "deepseek_style_pp2_dp2_ep2"}


@pytest.mark.parametrize("case", ci_cases(CASES, KEPT))
def test_expert_parallel_trains_like_one_process(case, tmp_path):
    path, args, degrees = CASES[case]
    if "hf_tiny" in path.name:
        pytest.importorskip("transformers")
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "plan", str(path), *args, "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--dtype", "fp32",
            "--global-batch-size", "8", "--micro-batch-size", "2", *degrees, "--lr", "1e-3",
            "--out", str(out), "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    pp = 2 if "--pp" in degrees else 1
    assert (plan.parallel.dp, plan.parallel.ep, plan.parallel.tp, plan.parallel.pp) == (4 // pp, 2, 1, pp)
    assert plan.experts and all(n == 4 for n in plan.experts.values())
    assert plan.predicted.comm.expert_parallel_s > 0
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["layout"]["ep"] == 2
    expected = train(reference_of(plan), tmp_path / "reference", 1)
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx([s["loss"] for s in expected["steps"]], abs=1e-4), (case, losses)
    norms = [s["grad_norm"] for s in metrics["steps"]]
    assert norms == pytest.approx([s["grad_norm"] for s in expected["steps"]], rel=1e-3)
    # Each rank held half of every experts module's weights.
    ranks = metrics["ranks"]
    assert len(ranks) == 4
