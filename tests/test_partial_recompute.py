"""Block recomputation (issue 26; Megatron-LM's --recompute-granularity full --recompute-method block
--recompute-num-layers N): a stage's first k blocks recomputed fully, the rest at the stage's mode.

Costs (memory falls and time rises with k, by one block's kept activations and forward each), the search (k > 0
only where the stage does not fit at k = 0, and then the smallest k that fits), the --recompute-blocks pin and its
refusals (exit 2), plan.json's fields, the exports (Megatron's block flags; torchtitan refuses), and the runtime
(the named blocks checkpointed fully; gradients equal to no checkpointing; a pp2 run equal to one process).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from e2e.plans import make_plan, reference_of
from pydantic import ValidationError
from synthetic import make_graph, make_unit
from typer.testing import CliRunner

from planner.cli.main import app
from planner.cost.model import Candidate, CostOptions, full_block_units
from planner.cost.terms import rank_capacity
from planner.errors import ConfigError, ExportError
from planner.export import megatron, torchtitan
from planner.hardware.load import load_cluster
from planner.plan import Plan, StagePlan, load_plan
from planner.runtime.recompute import apply_ac
from planner.runtime.stages import ModelStage, StageModule
from planner.search.blocks import even_partition, with_full_blocks
from planner.search.evaluate import evaluate
from planner.search.problem import PartitionProblem
from planner.search.search import CostTable, search
from planner.search.space import Pins

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "sample_models" / "gpt.py"
GiB = 2**30
TINY_GPT_ARGS = ["--model-arg", "layers=4", "--model-arg", "hidden=64", "--model-arg", "seq=32",
                 "--model-arg", "vocab=256"]
CPU2 = ["--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]


# ------------------------------------------------------------------------------------------ costs


def graph(blocks: int = 8):
    """Embedding, `blocks` identical blocks (their activations dominate), head."""
    units = [make_unit("embed", "pre", 50_000_000, 1e11, 200_000_000, 8_000_000)]
    units += [make_unit(f"blocks.{i}", "blk", 200_000_000, 2e12, 2_000_000_000, 8_000_000) for i in range(blocks)]
    units += [make_unit("head", "post", 50_000_000, 1e11, 400_000_000, 8_000_000)]
    return make_graph(units)


def problem(g, cand: Candidate, memory_gib: float = 80.0) -> PartitionProblem:
    cl = load_cluster("a100-sxm4-80gb", 1, 2)
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory_gib})})
    return PartitionProblem(g, cl, cand, CostTable(g, cl, None).units(cand), ("none", "selective", "full"),
                            CostOptions.for_cluster(cl))


PP2 = Candidate(dp=1, tp=1, pp=2, virtual_stages=1, micro_batch_size=1, num_micro_batches=4, schedule="1f1b",
                zero_stage=0,
                sequence_parallel=False)


def test_full_block_units_are_a_stages_first_blocks():
    g = graph(4)
    assert full_block_units(g, [0, 1, 2], 1) == [1]  # the embedding is not a block
    assert full_block_units(g, [3, 4, 5], 2) == [3, 4]
    assert full_block_units(g, [3, 4, 5], 0) == []
    with pytest.raises(ValueError, match="holding 2 block"):
        full_block_units(g, [3, 4, 5], 3)


@pytest.mark.parametrize("base", ["none", "selective"])
def test_memory_falls_and_time_rises_with_each_block_recomputed(base):
    g = graph(8)
    pb = problem(g, PP2)
    part = [list(range(0, 5)), list(range(5, 10))]  # 4 blocks in each stage
    evs = [evaluate(pb, part, [base, base], [k, k]) for k in range(5)]
    block = pb.costs[1]
    for s in range(2):
        acts = [ev.stages[s].activations for ev in evs]
        bwds = [ev.stages[s].bwd for ev in evs]
        assert all(a > b for a, b in zip(acts, acts[1:])), acts
        assert all(a < b for a, b in zip(bwds, bwds[1:])), bwds
        inflight = evs[0].stages[s].activations / sum(pb.costs[u].act[base] for u in part[s])
        for k in range(1, 5):  # each block keeps only its input, and re-runs its forward (less what base re-ran)
            assert acts[0] - acts[k] == pytest.approx(k * inflight * (block.act[base] - block.act["full"]))
            assert bwds[k] - bwds[0] == pytest.approx(k * (block.bwd["full"] - block.bwd[base]))
        assert evs[0].stages[s].full_blocks == 0 and evs[3].stages[s].full_blocks == 3
    # k = all blocks: as full recomputation but for the embedding and head, which keep the base mode
    full = evaluate(pb, part, ["full", "full"])
    assert evs[4].stages[1].activations > full.stages[1].activations
    assert evs[4].stages[1].bwd < full.stages[1].bwd
    assert evs[0].full_blocks == [] and evs[2].full_blocks == [2, 2]


def _capacity_between(g, cand: Candidate, part: list[list[int]]) -> float:
    """A GPU memory (GiB) at which `part` fits under full recomputation and not under none."""
    pb = problem(g, cand)
    need_none = max(evaluate(pb, part, ["none"] * len(part)).rank_memory.values())
    need_full = max(evaluate(pb, part, ["full"] * len(part)).rank_memory.values())
    spare = 80 * GiB - rank_capacity(pb.cluster, cand)  # what the reserve takes off the GPU's memory
    return (need_full + 0.4 * (need_none - need_full) + spare) / GiB


def _smallest_fitting(pb: PartitionProblem, ev) -> None:
    """Each stage with blocks recomputed: one block fewer at the same mode does not fit its rank."""
    cap = rank_capacity(pb.cluster, pb.cand)
    assert max(ev.rank_memory.values()) <= cap
    for s, k in enumerate(ev.full_blocks):
        if k:
            fewer = list(ev.full_blocks)
            fewer[s] -= 1
            tried = evaluate(pb, ev.partition, ev.recompute, fewer)
            assert tried.rank_memory[ev.stages[s].rank] > cap, (s, k)


def test_search_recomputes_the_fewest_blocks_that_fit_and_only_where_needed():
    g = graph(8)
    pins = Pins(dp=1, tp=1, pp=2, micro_batch_size=1, schedule="1f1b", zero_stage=0, sequence_parallel=False)
    memory = _capacity_between(g, PP2, [list(range(0, 5)), list(range(5, 10))])
    cl = load_cluster("a100-sxm4-80gb", 1, 2)
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory})})
    plain = search(g, cl, 4, pins, top_k=1)
    assert "full" in plain.best.recompute and not plain.best.full_blocks  # all or nothing: full somewhere
    got = search(g, cl, 4, pins, top_k=1, block_recompute=True)
    best = got.best
    assert any(best.full_blocks) and "full" not in best.recompute
    assert best.reported < plain.best.reported
    pb = PartitionProblem(g, cl, best.cand, CostTable(g, cl, None).units(best.cand), ("none", "selective", "full"),
                          CostOptions.for_cluster(cl))
    _smallest_fitting(pb, best)
    # where every stage fits without recomputation, none is chosen
    roomy = search(g, load_cluster("a100-sxm4-80gb", 1, 2), 4, pins, top_k=1, block_recompute=True)
    assert set(roomy.best.recompute) == {"none"} and not roomy.best.full_blocks


def test_with_full_blocks_leaves_a_plan_that_fits_as_it_is():
    g = graph(8)
    pb = problem(g, PP2)
    ev = evaluate(pb, [list(range(0, 5)), list(range(5, 10))], ["none", "none"])
    assert with_full_blocks(pb, ev) is ev


def test_pinned_blocks_recompute_that_many_in_every_stage():
    g = graph(8)
    pins = Pins(dp=1, tp=1, pp=2, micro_batch_size=1, schedule="1f1b", zero_stage=0, sequence_parallel=False,
                recompute_blocks=3)
    got = search(g, load_cluster("a100-sxm4-80gb", 1, 2), 4, pins, top_k=1)
    assert got.best.full_blocks == [3, 3]
    assert all(s.full_blocks == 3 and s.recompute != "full" for s in got.best.stages)


def test_pinned_blocks_refusals_name_the_rule():
    g = graph(8)
    cl = load_cluster("a100-sxm4-80gb", 1, 2)
    base = dict(dp=1, tp=1, pp=2, micro_batch_size=1, schedule="1f1b", zero_stage=0, sequence_parallel=False)
    with pytest.raises(ConfigError, match="cannot hold 5"):
        search(g, cl, 4, Pins(**base, recompute_blocks=5), top_k=1)
    with pytest.raises(ConfigError, match="recomputes every block already"):
        search(g, cl, 4, Pins(**base, recompute="full", recompute_blocks=1), top_k=1)
    with pytest.raises(ConfigError, match="1 or more"):
        search(g, cl, 4, Pins(**base, recompute_blocks=0), top_k=1)


def test_even_partition_is_megatrons():
    g = graph(7)
    assert even_partition(g, 3) == [[0, 1, 2, 3], [4, 5], [6, 7, 8]]
    assert even_partition(make_graph([make_unit(f"u{i}", f"s{i}", 1, 1.0, 1, 1) for i in range(3)]), 2) is None


# ------------------------------------------------------------------------------------------ CLI and plan.json


def invoke(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "220"})


def test_cli_refuses_pins_it_cannot_meet_with_exit_2(tmp_path):
    plan = ["plan", GPT, *TINY_GPT_ARGS, *CPU2, "--pp", "2", "--out", tmp_path / "p"]
    result = invoke(*plan, "--recompute", "full", "--recompute-blocks", "1")
    assert result.exit_code == 2 and "recomputes every block already" in result.output, result.output
    result = invoke(*plan, "--recompute-blocks", "3")  # 4 blocks over 2 stages
    assert result.exit_code == 2 and "cannot hold 3" in result.output, result.output
    result = invoke(*plan, "--recompute-blocks", "0")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / "p").exists()


def test_plan_json_names_each_stages_blocks_and_the_report_shows_them(tmp_path):
    out = tmp_path / "p"
    result = invoke("plan", GPT, *TINY_GPT_ARGS, *CPU2, "--pp", "2", "--schedule", "1f1b", "--recompute-blocks", "1",
                    "--out", out, "--quiet")
    assert result.exit_code == 0, result.output
    raw = json.loads((out / "plan.json").read_text())
    assert raw["schema_minor"] == 5
    plan = load_plan(out)
    for s in plan.stages:
        blocks = [m for m in s.modules if m.startswith("blocks.")]
        assert s.recompute_full_blocks == 1 and s.recompute_full_modules == blocks[:1]
        assert s.recompute_label == f"full x1 + {s.recompute}"
    assert "STAGES = [" in (out / "train.py").read_text() and '["blocks.0"]' in (out / "train.py").read_text()
    report = invoke("report", out / "plan.json")
    assert report.exit_code == 0 and "full x1 + none" in report.output, report.output
    # a plan without: the fields are not written and the schema stays minor 3
    plain = make_plan("gpt", pp=2)
    text = plain.to_json()
    assert "recompute_full" not in text and json.loads(text)["schema_minor"] == 3


def test_stage_fields_must_agree():
    base = make_plan("gpt", pp=2).stages[1]
    with pytest.raises(ValidationError, match="both be set"):
        StagePlan.model_validate({**base.model_dump(), "recompute_full_blocks": 1})
    with pytest.raises(ValidationError, match="not among the stage's modules"):
        StagePlan.model_validate({**base.model_dump(), "recompute_full_blocks": 1,
                                  "recompute_full_modules": ["blocks.0"]})
    with pytest.raises(ValidationError, match="recompute full"):
        StagePlan.model_validate({**base.model_dump(), "recompute": "full", "recompute_full_blocks": 1,
                                  "recompute_full_modules": ["blocks.2"]})


# ------------------------------------------------------------------------------------------ exports


def gpt(**kw) -> Plan:
    return make_plan("gpt", **kw).model_copy(update={"tokens_per_sample": 32})


def test_megatron_export_takes_the_block_method():
    args = megatron.arguments(gpt(pp=2, full_blocks=1))
    pairs = dict(zip(args, [*args[1:], ""], strict=True))
    assert pairs["--recompute-granularity"] == "full" and pairs["--recompute-method"] == "block"
    assert pairs["--recompute-num-layers"] == "1"
    assert "The plan recomputes" not in megatron.render(gpt(pp=2, full_blocks=1))
    # stages that differ: the largest count, said so
    uneven = gpt(pp=2, full_blocks=2)
    stages = [uneven.stages[0], uneven.stages[1].model_copy(
        update={"recompute_full_blocks": 1, "recompute_full_modules": uneven.stages[1].recompute_full_modules[:1]})]
    uneven = uneven.model_copy(update={"stages": stages})
    pairs = dict(zip(megatron.arguments(uneven), [*megatron.arguments(uneven)[1:], ""], strict=True))
    assert pairs["--recompute-num-layers"] == "2"
    assert "recomputes [2, 1] blocks fully per stage" in megatron.render(uneven)
    with pytest.raises(ExportError, match="full or selective, not both"):
        megatron.arguments(gpt(pp=2, full_blocks=1, recompute="selective"))


def test_torchtitan_export_refuses_block_recomputation():
    with pytest.raises(ExportError, match="no per-stage count"):
        torchtitan.render(gpt(pp=2, full_blocks=1))
    torchtitan.render(gpt(pp=2))  # without it: exported


# ------------------------------------------------------------------------------------------ runtime


def _tiny_gpt() -> torch.nn.Module:
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_test_gpt", GPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.build_model(layers=4, hidden=64, heads=4, vocab=256, seq=32)


def _checkpointed(unit: torch.nn.Module) -> bool:
    return "forward" in unit.__dict__  # checkpoint_in_place sets the instance's forward


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_runtime_checkpoints_the_named_blocks_fully(recompute):
    model = _tiny_gpt()
    names = ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    stage = ModelStage(model, names)
    fully = apply_ac(stage, recompute, "1f1b", {"blocks.0", "blocks.1"})
    assert fully == 2
    wrapped = {n for n, u in stage.owned_units() if _checkpointed(u)}
    held = {n for n, u in stage.owned_units() if any(True for _ in u.parameters())}
    assert wrapped == ({"blocks.0", "blocks.1"} if recompute == "none" else held)


def test_runtime_counts_fully_checkpointed_pieces_per_stage():
    pieces = [torch.nn.Linear(4, 4) for _ in range(3)]
    stage = StageModule(pieces, ["blocks.2", "blocks.3", None])
    assert apply_ac(stage, "none", "1f1b", ("blocks.2",)) == 1
    assert [_checkpointed(p) for p in pieces] == [True, False, False]


def test_block_recomputation_leaves_the_gradients_as_they_were():
    x = torch.randint(0, 256, (2, 32))

    def grads(full: set[str]) -> dict[str, torch.Tensor]:
        model = _tiny_gpt()
        stage = ModelStage(model, [n for n, _ in model.named_children()])
        apply_ac(stage, "none", "1f1b", full)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, blocks = grads(set()), grads({"blocks.0", "blocks.2"})
    for name, g in plain.items():
        torch.testing.assert_close(blocks[name], g, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ a pipelined run


@pytest.mark.e2e
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(pp=2, full_blocks=1), id="pp2_1f1b"),
        pytest.param(dict(pp=2, virtual_stages=2, schedule="zero-bubble", num_micro_batches=4, full_blocks=1),
                     id="pp2_zbv", marks=pytest.mark.corpus),
    ],
)
def test_pipelined_block_recomputation_trains_like_one_process(case, tmp_path):
    from e2e.test_train_e2e import STEPS, train

    plan = make_plan("gpt", **case)
    assert all(s.recompute_full_blocks == 1 for s in plan.stages)
    got = train(plan, tmp_path / "run", 2)["steps"]
    want = train(reference_of(plan), tmp_path / "reference", 1)["steps"]
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want, strict=True):
        assert abs(g["loss"] - w["loss"]) <= 2e-5, (got, want)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 2e-5 * max(1.0, w["grad_norm"]), (got, want)



def test_published_llama3_405b_fits_with_blocks_recomputed():
    """bench/accuracy.py --recompute-blocks: Meta's tp8 pp16 v2 row, refused with selective recomputation alone (the
    REFUSED list of tests/test_accuracy_published.py), plans with 3 blocks per stage recomputed fully."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from accuracy import with_recompute_blocks
    from published_runs import load_runs, plan_run

    run = next(r for r in load_runs().runs if r.id == "llama3-405b-16384")
    plan, _ = plan_run(with_recompute_blocks(run, 3))
    assert {s.recompute for s in plan.stages} == {"selective"}
    assert {s.recompute_full_blocks for s in plan.stages} == {3}
    assert plan.predicted.peak_memory_bytes <= plan.predicted.memory_capacity_bytes


def test_interleaved_stages_take_one_count_that_fits_every_rank():
    g = graph(8)
    cand = dataclasses.replace(PP2, virtual_stages=2, schedule="interleaved-1f1b")
    pins = Pins(dp=1, tp=1, pp=2, virtual_stages=2, micro_batch_size=1, schedule="interleaved-1f1b", zero_stage=0,
                sequence_parallel=False)
    memory = _capacity_between(g, cand, [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]])
    cl = load_cluster("a100-sxm4-80gb", 1, 2)
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory})})
    plain = search(g, cl, 4, pins, top_k=1)
    best = search(g, cl, 4, pins, top_k=1, block_recompute=True).best
    assert any(best.full_blocks) and len(set(best.full_blocks)) == 1 and len(set(best.recompute)) == 1
    assert best.reported < plain.best.reported
    assert max(best.rank_memory.values()) <= rank_capacity(cl, best.cand)
