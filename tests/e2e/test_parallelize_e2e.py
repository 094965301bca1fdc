"""`from planner.runtime import parallelize` in a training loop of one's own: a pp2 plan on 2 gloo ranks. The
first step's loss (from the last stage) equals the whole model's over the same micro-batches, and the
optimizer steps the parameters the job hands it."""

from __future__ import annotations

import json
import textwrap

import pytest
from e2e.plans import make_plan
from e2e.test_train_e2e import TORCHRUN, run

pytestmark = pytest.mark.e2e

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from planner.runtime import parallelize
    from planner.runtime.api import read_plan
    from planner.runtime.model import build_model, load_model_file, make_batch, materialise

    job = parallelize(sys.argv[1], device="cpu")
    optimizer = torch.optim.AdamW(job.parameters(), lr=1e-2)
    local = lambda: [p.to_local() if hasattr(p, "to_local") else p for p in job.parameters()]  # DTensors' shards
    before = [p.detach().clone() for p in local()]
    loss = job.step(job.batches(0))
    optimizer.step()
    moved = all(not torch.equal(a, p.detach()) for a, p in zip(before, local()))

    layout, spec, training = read_plan(sys.argv[1])  # the whole model, one process, the same micro-batches
    user = load_model_file(spec.path)
    whole = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(whole, {n for n, _ in whole.named_modules()}, torch.device("cpu"), training.seed)
    with torch.no_grad():
        ref = torch.stack([user.loss_fn(whole(b[0]), *b) for b in
                           (make_batch(user, spec, layout, training.seed, 0, i) for i in range(2))]).mean()
    out = {"rank": dist.get_rank(), "loss": None if loss is None else loss.item(), "reference": ref.item(),
           "moved": moved, "stages": len(job.stages), "schedule": type(job.schedule).__name__}
    with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_parallelize_applies_a_pipeline_plan_in_ones_own_loop(tmp_path):
    plan = make_plan("gpt", pp=2, num_micro_batches=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "my_train.py").write_text(SCRIPT)
    run([TORCHRUN, "--standalone", "--nproc-per-node=2", "my_train.py", str(tmp_path), str(tmp_path)], tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["schedule"] for r in ranks] == ["Schedule1F1B"] * 2 and all(r["moved"] for r in ranks)
    assert ranks[0]["loss"] is None
    assert ranks[1]["loss"] == pytest.approx(ranks[1]["reference"], abs=1e-5)


TP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    from planner.runtime import parallelize
    from planner.runtime.api import read_plan
    from planner.runtime.model import build_model, load_model_file, make_batch, materialise

    job = parallelize(sys.argv[1], device="cpu")
    job.step(job.batches(0))
    grad = job.stages[0].model.get_parameter("blocks.0.scale").grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # (a DTensor over the dp mesh)

    layout, spec, training = read_plan(sys.argv[1])  # the whole model, one process, the same micro-batches
    user = load_model_file(spec.path)
    whole = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(whole, {n for n, _ in whole.named_modules()}, torch.device("cpu"), training.seed)
    batches = [make_batch(user, spec, layout, training.seed, 0, i) for i in range(layout.num_micro_batches)]
    loss = torch.stack([user.loss_fn(whole(*b[:1]), *b) for b in batches]).mean()
    loss.backward()
    out = {"rank": dist.get_rank(), "grad": grad.tolist(), "reference": whole.blocks[0].scale.grad.tolist(),
           "summed": job.summed is not None}
    with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_parallelize_sums_over_tp_the_gradient_of_a_weight_applied_alike_to_every_head(tmp_path):
    """attention_variants' head_scale under tp 2 in one's own loop: after `job.step`, each rank's gradient of
    the vector that scales every head is the whole model's (each rank's heads' share, summed over tp)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from planner.cli.main import app

    model = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "attention_variants.py"
    out = tmp_path / "plan"
    args = ["plan", str(model), "--model-arg", "variant='head_scale'", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--tp", "2", "--out",
            str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (tmp_path / "my_train.py").write_text(TP_SCRIPT)
    run([TORCHRUN, "--standalone", "--nproc-per-node=2", "my_train.py", str(out), str(tmp_path)], tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["summed"]
        assert r["grad"] == pytest.approx(r["reference"], abs=1e-6)
