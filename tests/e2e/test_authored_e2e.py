"""Models as their authors write them, launched (issue 27), on 4 CPU ranks against one process over the same
micro-batches: CLIP's 0-dim `logit_scale` is refused by FSDP2's fully_shard, so the script keeps scalar
parameters whole on every rank and averages their gradients over dp (dp4, ZeRO-1); Whisper reads its token
embedding's weight outside the embedding (its logits), which ZeRO-3 and a vocab-parallel split must both allow
for; transformers' Mamba, Mamba-2 and Jamba (state-space mixers, Jamba's mixture of experts) in a pipeline
(pp2 x dp2); nn.TransformerEncoder's MultiheadAttention sharded by heads (tp2 x dp2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e.hf_plans import corpus_plan_args
from e2e.plans import reference_of
from e2e.test_train_e2e import STEPS, assert_same_training, plan_and_train, run, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan

pytestmark = pytest.mark.e2e
CLIP = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "authored" / "clip_two_tower.py"


def test_scalar_parameter_launches_and_trains_like_one_process(tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, [
        "plan", str(CLIP), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8",
        "--dp", "4", "--zero-stage", "1", "--micro-batch-size", "2", "--lr", "1e-2", "--out", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    losses = [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]
    expected = [s["loss"] for s in train(reference_of(plan), tmp_path / "reference", 1)["steps"]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, abs=2e-5)
    assert losses[-1] < losses[0]


# 90 s each on 4 CPU ranks: under -m corpus and in bench/corpus_train.py --authored; CI checks the causes
# (tests/test_runtime_init.py: a stage's Mamba init; tests/test_moe.py: experts kept as calls on meta)
@pytest.mark.corpus
@pytest.mark.parametrize("model", ["hf_mamba", "hf_mamba2", "hf_jamba"])
def test_state_space_model_trains_in_a_pipeline_like_one_process(model, tmp_path):
    """hf_mamba: Mamba's `_init_weights` draws its dt_proj bias with torch.rand, which each stage drew from a
    different point of the generator (2.6e-4 off after 3 steps) until each module's init got a seed of its own
    name. hf_jamba: its experts' code cannot run on meta (grouped_mm), which sent the trace to torch.export,
    whose graph inlines the Mamba mixers (a constant made in their scan); the trace with meta values now keeps
    the experts as calls of their input's shape, and the mixers as calls. hf_mamba2: its mixers planned as the
    SSD kernels (planner.model.kernels) and run as written (the torch SSD scan on the CPU)."""
    plan_args = corpus_plan_args(model, "pp2xdp2", tmp_path / "plan")[1:-3]  # (plan_and_train adds --out, --quiet)
    plan, metrics, expected = plan_and_train(tmp_path, plan_args)
    assert plan.parallel.pp == 2 and plan.parallel.dp == 2
    assert_same_training(metrics, expected)


ENCODER = CLIP.with_name("transformer_encoder_lm.py")


@pytest.mark.parametrize(
    "pins",
    [pytest.param(["--dp", "2"], marks=pytest.mark.corpus, id="tp2xdp2"),
     pytest.param(["--pp", "2", "--schedule", "1f1b"], marks=pytest.mark.corpus, id="tp2xpp2")],
)
def test_multihead_attention_sharded_by_heads_trains_like_one_process(pins, tmp_path):
    """nn.TransformerEncoder's nn.MultiheadAttention under tp2 x dp2 (and, under corpus, in the traced stages of
    tp2 x pp2): its packed in_proj sharded chunk by chunk (q, k, v each by heads, 2 of 4 heads per rank) with
    out_proj row-parallel (parallel.ShardedMultiheadAttention), and linear1 / linear2 as their pair."""
    plan, metrics, expected = plan_and_train(tmp_path, [
        str(ENCODER), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8",
        "--tp", "2", *pins, "--micro-batch-size", "2", "--lr", "1e-3",
    ])
    assert plan.parallel.tp == 2 and plan.parallel.world_size == 4
    assert plan.tp.fused == {f"encoder.layers.{i}.self_attn": 3 for i in range(4)}
    assert plan.tp.styles["encoder.layers.0.self_attn.out_proj"] == "rowwise"


WHISPER = CLIP.with_name("whisper_style.py")


def _whisper_args(*pins: str) -> list[str]:
    return [
        str(WHISPER), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "1e-3", *pins,
    ]


@pytest.mark.corpus  # 78 s; CI: the check wraps it as the launch does (tests/test_unit_reads.py)
def test_an_embedding_read_outside_its_forward_trains_under_zero3(tmp_path):
    """Whisper's decoder reads its token embedding's weight again as the logits' matrix, after its blocks: ZeRO-3
    had freed the embedding's own FSDP unit by then ("mixed torch.Tensor and DTensor" at the first step). The run
    leaves that module to the stage's unit (planner.runtime.unit_reads)."""
    plan, metrics, expected = plan_and_train(tmp_path, _whisper_args("--dp", "4", "--zero-stage", "3"))
    assert plan.parallel.zero_stage == 3 and plan.parallel.pp == 1
    assert_same_training(metrics, expected)


@pytest.mark.corpus  # 77 s; CI checks the rule at plan level (tests/test_authored_models.py)
def test_an_embedding_read_outside_its_lookup_stays_replicated_under_tp(tmp_path):
    """The same embedding under tp 2 x dp 2: a vocab-parallel split would hand the logits' matmul a shard of a
    weight the code multiplies whole, so it stays replicated (the plan says why), and trains as one process."""
    plan, metrics, expected = plan_and_train(tmp_path, _whisper_args("--tp", "2", "--dp", "2"))
    assert "decoder.token_embedding" not in plan.tp.styles
    assert any(r.startswith("decoder.token_embedding is not sharded") for r in plan.tp.refused)
    assert plan.tp.styles  # the blocks' attention and MLPs are still split
    assert_same_training(metrics, expected)
