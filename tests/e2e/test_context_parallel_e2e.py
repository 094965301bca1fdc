"""Context parallelism planned by `planner plan --cp 2` and trained on 4 CPU ranks (gloo): each sample's sequence
sharded over 2 ranks in torch's head-tail order, attention all-gathering keys and values, learned positions taken
at the rank's global positions, gradients averaged over dp x cp. Each matches one process doing gradient
accumulation over the same micro-batches within 2e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e.test_train_e2e import assert_same_training
from e2e.test_train_e2e import plan_and_train as planned_and_trained

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def plan_and_train(tmp_path: Path, model: str, pins: list[str]) -> tuple[object, dict, dict]:
    return planned_and_trained(tmp_path, [
        str(model), "--model-arg", "layers=2", "--model-arg", "hidden=32", "--model-arg", "heads=2",
        "--model-arg", "seq=16", "--model-arg", "vocab=64", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node",
        "4", "--global-batch-size", "8", "--micro-batch-size", "2", "--cp", "2", *pins, "--lr", "3e-3",
        "--dtype", "fp32",
    ])


def test_cp2_dp2_trains_like_one_process(tmp_path):
    """GPT (learned positions from torch.arange over the sequence, its own next-token loss_fn), ZeRO-1 over
    dp x cp = 4 ranks."""
    plan, metrics, expected = plan_and_train(
        tmp_path, ROOT / "sample_models" / "gpt.py", ["--dp", "2", "--zero-stage", "1"]
    )
    p = plan.parallel
    assert (p.dp, p.cp, p.tp, p.pp, p.mesh_dims) == (2, 2, 1, 1, ["pp", "dp", "cp", "tp"])
    assert plan.predicted.comm.context_parallel_s > 0
    assert_same_training(metrics, expected)
    assert {r.get("cp") for r in metrics["ranks"]} == {0, 1}


@pytest.mark.corpus
def test_cp2_pp2_trains_like_one_process(tmp_path):
    """Llama (rotary table read as a buffer of seq rows, grouped-query attention) cut into 2 pipeline stages, each
    stage's 2 cp ranks exchanging keys and values inside the traced graph's attention."""
    plan, metrics, expected = plan_and_train(
        tmp_path, ROOT / "sample_models" / "llama.py", ["--pp", "2", "--schedule", "1f1b"]
    )
    p = plan.parallel
    assert (p.dp, p.cp, p.pp) == (1, 2, 2)
    assert_same_training(metrics, expected)


@pytest.mark.corpus
def test_cp2_tp2_trains_like_one_process(tmp_path):
    """GPT with tensor parallelism over its heads (the model as written, head count divided), each tp rank's heads
    all-gathering their keys and values over the cp ranks."""
    plan, metrics, expected = plan_and_train(
        tmp_path, ROOT / "sample_models" / "gpt.py", ["--tp", "2", "--no-sequence-parallel"]
    )
    p = plan.parallel
    assert (p.dp, p.cp, p.tp, p.sequence_parallel) == (1, 2, 2, False)
    assert_same_training(metrics, expected)


@pytest.mark.corpus
def test_cp2_tp2_with_sequence_parallelism_trains_like_one_process(tmp_path):
    """cp first, then sp: each cp rank holds half of every sequence (head-tail order), and sequence parallelism
    splits that half over the tp ranks in the traced graph's norms and residual adds, gathering it (over tp) where
    attention and the MLP begin; attention all-gathers its keys and values over cp as without sp."""
    plan, metrics, expected = plan_and_train(
        tmp_path, ROOT / "sample_models" / "gpt.py", ["--tp", "2", "--sequence-parallel"]
    )
    p = plan.parallel
    assert (p.dp, p.cp, p.tp, p.sequence_parallel) == (1, 2, 2, True)
    assert plan.predicted.comm.context_parallel_s > 0 and plan.predicted.comm.tensor_parallel_s > 0
    assert_same_training(metrics, expected)
    assert {(r.get("cp"), r.get("tp")) for r in metrics["ranks"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}


@pytest.mark.corpus
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_cp2_dp2_with_recomputation_trains_like_one_process(tmp_path, mode):
    """The backward's recomputation runs the attention again, all-gathering keys and values inside backward (the
    autograd engine does not carry the step's ContextParallel mode there: `context.recomputed` enters it)."""
    plan, metrics, expected = plan_and_train(
        tmp_path, ROOT / "sample_models" / "gpt.py", ["--dp", "2", "--zero-stage", "3", "--recompute", mode]
    )
    assert {s.recompute for s in plan.stages} == {mode} and plan.parallel.cp == 2
    assert_same_training(metrics, expected)
