"""Pipeline layouts of real runs, planned by `planner plan` and trained on 2 CPU ranks (gloo): interleaving with
stages of unequal size (the embedding and the head take a stage's place, as in Llama 3 405B's 126 layers on 16
stages) and more than 8 stages per rank (Megatron-LM's tuned GPT-3 175B recipe runs 12). Each matches one
process doing gradient accumulation over the same micro-batches within 2e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e.test_train_e2e import assert_same_training
from e2e.test_train_e2e import plan_and_train as planned_and_trained

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def plan_and_train(tmp_path: Path, layers: int, v: int) -> tuple[object, dict, dict]:
    return planned_and_trained(tmp_path, [
        str(ROOT / "sample_models" / "gpt.py"), "--model-arg", f"layers={layers}",
        "--model-arg", "hidden=32", "--model-arg", "heads=2", "--model-arg", "seq=16", "--model-arg", "vocab=64",
        "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "8", "--pp", "2",
        "--virtual-stages", str(v), "--micro-batch-size", "2", "--schedule", "interleaved-1f1b", "--lr", "3e-3",
    ])


def test_uneven_interleaved_pp2_v3_trains_like_one_process(tmp_path):
    """5 blocks between an embedding and a head: 7 units on 2 x 3 stages, one stage holds two units."""
    plan, metrics, expected = plan_and_train(tmp_path, layers=5, v=3)
    p = plan.parallel
    assert (p.pp, p.virtual_stages, p.schedule, p.num_micro_batches) == (2, 3, "interleaved-1f1b", 4)
    sizes = [len(s.units) for s in plan.stages]
    assert len(sizes) == 6 and len(set(sizes)) > 1, sizes
    assert_same_training(metrics, expected)


def test_nine_stages_per_rank_train_like_one_process(tmp_path):
    """16 blocks: 18 units on 2 x 9 stages (above the old cap of 8 per rank)."""
    plan, metrics, expected = plan_and_train(tmp_path, layers=16, v=9)
    assert (plan.parallel.virtual_stages, len(plan.stages)) == (9, 18)
    assert [s.pp_rank for s in plan.stages] == [0, 1] * 9
    assert_same_training(metrics, expected)
