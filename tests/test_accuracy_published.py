"""bench/published_runs.yaml: every run loads with a source, and plans on meta at its real size with its
published layout pinned (or, for the runs listed below, is refused by the cost model for a stated reason)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from accuracy import ROWS, RunResult, distribution, percentile, print_misses, run_published  # noqa: E402
from published_runs import (  # noqa: E402
    RUNS_FILE,
    NotExpressible,
    PublishedRuns,
    graph_key,
    load_runs,
    plan_run,
    planner_has_cp,
    rank0_memory_gib,
)

from planner.errors import InfeasibleError  # noqa: E402

RUNS = load_runs()

# The cost model refuses these published layouts; each is a known limitation reported by bench/accuracy.py.
# If one starts to plan (or another stops), this list and the README's accuracy section need updating.
REFUSED = {
    # Llama 3 405B at tp8 pp16 with selective recomputation (the attention core alone, Korthikanti's): the sample
    # Llama's blocks keep 52 sbh in eager (fp32 RMSNorm, SwiGLU), and nothing drops under flash attention
    "llama3-405b-8192": "does not fit",
    "llama3-405b-16384": "does not fit",
    # Meta's cp16 x tp8 + sp row at seq 131,072: cp and sp combine, and the layout is refused for memory. Each
    # layer keeps its own activations (1/cp of the tokens, split over tp by sp) plus the other cp ranks' keys and
    # values gathered for the backward, and the sample Llama repeats its 8 kv heads to 128 before SDPA, so the
    # gathered K/V are 16x what a GQA-aware exchange keeps; with the capacity lifted, rank 0 holds ~330 GiB
    **({"llama3-405b-16384-cp16": "does not fit"} if planner_has_cp() else {}),
}
# Layouts the planner cannot express yet: listed by bench/accuracy.py as misses with this cause.
NOT_EXPRESSIBLE = {} if planner_has_cp() else {"llama3-405b-16384-cp16": "context parallelism"}


def test_enough_runs_from_enough_sources():
    assert len(RUNS.runs) >= 60 and len({r.source for r in RUNS.runs}) >= 8
    # the H100 fit took the Megatron README's 9 rows out of validation (issue 11, item 4 leftovers)
    validation = [r for r in RUNS.runs if r.role == "validation"]
    assert len(validation) >= 20
    assert len({r.source for r in validation}) >= 4
    assert {r.gpu for r in validation} >= {"dgx-a100", "dgx-h100"}
    # FSDP / ZeRO-3 at small scale (8-64 GPUs) on both GPUs, interleaving, and a context-parallel row
    small_fsdp = {r.gpu for r in validation if r.layout.zero == 3 and r.gpus <= 64}
    assert small_fsdp >= {"dgx-a100", "dgx-h100"}
    assert any(r.layout.v > 1 for r in validation) and any(r.layout.cp > 1 for r in validation)


def test_calibration_and_validation_are_split_by_source_per_gpu():
    assert set(RUNS.splits) == {"a100", "h100"}
    assert RUNS.splits["a100"].calibration == ["sc21"]
    assert RUNS.splits["h100"].calibration == ["megatron-readme"]
    calibration = {s for sp in RUNS.splits.values() for s in sp.calibration}
    for sp in RUNS.splits.values():
        assert not set(sp.validation) & calibration and sp.reasoning
    for run in RUNS.runs:
        assert (run.role == "fit") == (run.source in calibration), run.id
    # the schema refuses a source on both sides, and a row whose role disagrees with its split
    data = yaml.safe_load(RUNS_FILE.read_text())
    data["splits"]["h100"]["validation"].append("megatron-readme")
    with pytest.raises(ValidationError, match="both calibration and validation"):
        PublishedRuns.model_validate(data)
    data = yaml.safe_load(RUNS_FILE.read_text())
    row = next(r for r in data["runs"] if r["id"] == "mpt-h100-7b-128")
    row.update(role="fit", miss_cause=None)  # (a fit row may not carry a miss_cause either)
    with pytest.raises(ValidationError, match="puts source 'llm-foundry' in validation"):
        PublishedRuns.model_validate(data)


def test_h100_efficiencies_say_they_were_fitted_on_the_calibration_rows_only():
    from planner.hardware.load import load_spec

    spec = load_spec("h100-sxm5-80gb")
    assert "fit_published.py" in spec.sources["efficiency"] and "Megatron-LM README" in spec.sources["efficiency"]
    assert spec.efficiency.matmul < 1.0
    text = (ROOT / "hardware_specs" / "h100-sxm5-80gb.yaml").read_text()
    after = text.split("\nefficiency:", 1)[1].splitlines()[1:]
    block = []  # the efficiency mapping's own lines: indented, up to the next top-level key
    for line in after:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    keys = [line for line in block if line.strip() and not line.strip().startswith("#")]
    assert {line.split(":")[0].strip() for line in keys} >= {"matmul", "attention", "memory", "network"}
    assert all("# source:" in line for line in keys)
    # each fitted efficiency names its calibration rows (all of them, and only fit rows of an H100 split);
    # the others are held, and none sits at (or above) its physical bound
    from planner.measure.refit import PHYSICAL_MAX

    h100 = RUNS.splits["h100"]
    fit_ids = {r.id for r in RUNS.runs if r.gpu in h100.gpus and r.role == "fit"}
    val_ids = {r.id for r in RUNS.runs if r.role == "validation"}
    for line in keys:
        name = line.split(":")[0].strip()
        if name == "gemm_half_dim":
            continue
        why = line.split("# source:", 1)[1]
        if "fitted" in why:
            sizes = set(re.findall(r"-([\d.]+b)\b", why))  # "megatron-h100-1.7b, -7.1b, ..." names each row
            assert {i.removeprefix("megatron-h100-") for i in fit_ids} <= sizes, line
            assert not any(v in why for v in val_ids), line
        else:
            assert "held" in why, line
        assert getattr(spec.efficiency, name) < PHYSICAL_MAX[name], name


def test_every_run_has_a_cited_source():
    for run in RUNS.runs:
        src = RUNS.sources[run.source]
        assert src.title and src.where and run.cite, run.id


def test_sc21_fit_rows_match_the_table_in_accuracy_py():
    fit = {r.id: r for r in RUNS.runs if r.role == "fit" and r.source == "sc21"}
    assert len(fit) == len(ROWS)
    for row in ROWS:
        run = fit[f"sc21-{row.name.lower()}"]
        c = run.dense_config
        assert (c.layers, c.hidden, c.heads) == (row.layers, row.hidden, row.heads)
        assert (run.layout.tp, run.layout.pp, run.gpus, run.layout.global_batch) == (row.t, row.p, row.gpus, row.batch)
        assert (run.layout.mbs, run.layout.v, run.published.value) == (row.mbs, row.v, row.published)
        assert run.layout.overlap_dp_comm == (row.ddp == "torch")


def test_schema_rejects_a_layout_that_does_not_divide():
    data = yaml.safe_load(RUNS_FILE.read_text())
    data["runs"][0]["gpus"] = 33
    with pytest.raises(ValidationError, match="not a multiple"):
        PublishedRuns.model_validate(data)
    data = yaml.safe_load(RUNS_FILE.read_text())
    data["runs"][0]["source"] = "nowhere"
    with pytest.raises(ValidationError, match="unknown source"):
        PublishedRuns.model_validate(data)


def test_published_figures_become_iteration_times():
    by_id = {r.id: r for r in RUNS.runs}
    # BLOOM publishes the iteration time itself
    assert by_id["bloom-176b-384"].published_iteration_s == pytest.approx(104.70)
    # MPT 70b on 512 H100: 4096 x 2048 tokens at 515,636 tokens/s
    assert by_id["mpt-h100-70b-512"].published_iteration_s == pytest.approx(4096 * 2048 / 515636)
    # SC21 1T: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs at 163 TFLOP/s on 3072 GPUs is about 102.6 s
    assert by_id["sc21-1t"].published_iteration_s == pytest.approx(102.63, rel=1e-3)


_GRAPHS: dict = {}


DENSE = [r for r in RUNS.runs if r.hf is None]  # the MoE (hf) rows: test_moe_* below, one planned


@pytest.mark.parametrize("run", DENSE, ids=[r.id for r in DENSE])
def test_run_plans_at_its_layout(run):
    if run.id in NOT_EXPRESSIBLE:
        with pytest.raises(NotExpressible, match=NOT_EXPRESSIBLE[run.id]):
            plan_run(run, _GRAPHS)
        return
    if run.id in REFUSED:
        with pytest.raises(InfeasibleError, match=REFUSED[run.id]):
            plan_run(run, _GRAPHS)
        return
    plan, cluster = plan_run(run, _GRAPHS)
    par = plan.parallel
    lay = run.layout
    assert (par.dp, par.tp, par.pp, par.virtual_stages) == (run.dp, lay.tp, lay.pp, lay.v)
    assert (par.micro_batch_size, par.schedule, par.zero_stage) == (lay.mbs, lay.schedule, lay.zero)
    assert par.sequence_parallel == lay.sp
    assert plan.cluster.nodes * plan.cluster.gpus_per_node == run.gpus
    # at its real size: the traced parameter count is the published configuration's, not a toy's
    c = run.dense_config
    ffn = c.ffn or 4 * c.hidden
    kv_dim = (c.kv_heads or c.heads) * (c.hidden // c.heads)
    per_layer = 2 * c.hidden * (c.hidden + kv_dim) + (3 if run.model == "llama" else 2) * c.hidden * ffn
    assert plan.total_params >= c.layers * per_layer * 0.9
    assert 0 < plan.predicted.peak_memory_bytes <= cluster.gpu.memory_bytes
    assert plan.predicted.iteration_time_s > 0


def test_distribution_statistics():
    assert percentile([0.3, 0.1, 0.2, 0.4], 0.9) == 0.4
    assert percentile([0.3, 0.1, 0.2, 0.4], 0.5) == 0.2
    assert percentile([5.0], 0.9) == 5.0


def test_recorded_miss_causes_print_once_and_keep_their_rows_in_the_distribution(capsys):
    runs = {r.id: r for r in RUNS.runs}
    nlg = [runs["mt-nlg-530b-2240"], runs["mt-nlg-530b-2800"]]
    assert nlg[0].miss_cause and nlg[0].miss_cause == nlg[1].miss_cause
    results = [RunResult(r, 0.75 * r.published_iteration_s, 20.0, 80.0, "gpu") for r in nlg]
    print_misses(results)
    out = capsys.readouterr().out
    assert out.count("cause [1]") == 2 and "[2]" not in out
    assert out.count("DeepSpeed's pipeline engine") == 1  # the text once, under its number
    assert distribution(results).startswith("n=2:")  # unlike `unsupported`, the rows still count
    # the A100 MPT rows take the H100 rows' fields by the yaml merge key, but not their cause
    assert runs["mpt-h100-7b-8"].miss_cause and runs["mpt-a100-80gb-7b-8"].miss_cause is None


def test_schema_refuses_a_miss_cause_on_a_fit_row():
    fit = next(r for r in RUNS.runs if r.role == "fit").model_dump()
    with pytest.raises(ValidationError, match="miss_cause"):
        PublishedRuns(sources=RUNS.sources, runs=[{**fit, "miss_cause": "excused"}])


def test_bench_reports_refused_rows_as_infeasible():
    # torchtitan's 8B run with the attention core alone recomputed (not its per-op policy): 92 GiB of activations
    (run,) = [r for r in RUNS.runs if r.id == "torchtitan-8b-fsdp-8"]
    run = run.model_copy(update={"layout": run.layout.model_copy(update={"recompute": "selective"})})
    sub = PublishedRuns(sources=RUNS.sources, runs=[run])
    (result,) = run_published(sub)
    assert result.error is None and "fit" in result.reason
    assert "selective recomputation" in result.reason  # the mode it was measured under, not "full"
    assert "infeasible" in distribution([result])
    assert graph_key(sub.runs[0])[0] == "llama"


def test_torchtitan_8b_per_op_checkpointing_keeps_the_closed_form():
    """torchtitan's Llama 3 8B (seq 8192, local batch 2, per-op selective checkpointing): each of the 32 blocks
    keeps its input and q, v, w1, w2's outputs and SDPA's output and log-sum-exp, s b (2h + 2(3h + kv + F) + 4a)
    bytes; the head keeps its input and its logits (its one matmul is an odd one): 32.1 GiB at mbs 2, against
    92 GiB without recomputation. The loss, outside every checkpointed unit (tp 1: no loss parallelism), adds its
    fp32 log-softmax and its backward's two fp32 gradients, 12 bytes per predicted logit: 23.5 GiB more."""
    (run,) = [r for r in RUNS.runs if r.id == "torchtitan-8b-fsdp-8"]
    c = run.config
    assert run.layout.recompute == "op"
    tokens = run.layout.mbs * c.seq
    kv = (c.kv_heads or c.heads) * (c.hidden // c.heads)
    ffn = c.ffn or 4 * c.hidden
    block = tokens * (2 * c.hidden + 2 * (3 * c.hidden + kv + ffn) + 4 * c.heads)
    head = tokens * (2 * c.hidden + 2 * c.vocab)
    loss = run.layout.mbs * (c.seq - 1) * c.vocab * 12
    states, acts = rank0_memory_gib(plan_run(run, _GRAPHS)[0])
    assert acts * 2**30 == pytest.approx(c.layers * block + head + loss, rel=0.01)


@pytest.mark.parametrize("run_id", ["korthikanti-22b-baseline-memory", "korthikanti-175b-baseline-memory"])
def test_memory_only_rows_within_10_percent_of_korthikanti_figure_1_baseline(run_id):
    """No sequence parallelism, no recomputation (the math attention's 5as/h term kept): Figure 1's baseline."""
    (run,) = [r for r in RUNS.memory_runs if r.id == run_id]
    assert run.memory is not None and run.memory.states_gib and run.memory.activations_gib
    states, acts = rank0_memory_gib(plan_run(run, _GRAPHS)[0])
    assert states == pytest.approx(run.memory.states_gib, rel=0.10)
    assert acts == pytest.approx(run.memory.activations_gib, rel=0.10)


def test_memory_figures_are_split_or_a_peak_and_memory_rows_have_no_speed():
    from published_runs import PublishedMemory

    assert PublishedMemory(peak_gib=82.4, cite="x").total_gib == 82.4
    assert PublishedMemory(states_gib=1.0, activations_gib=2.0, cite="x").total_gib == 3.0
    for bad in ({"states_gib": 1.0, "cite": "x"}, {"states_gib": 1.0, "activations_gib": 2.0, "peak_gib": 3.0,
                                                     "cite": "x"}, {"cite": "x"}):
        with pytest.raises(ValueError, match="states_gib and activations_gib, or peak_gib"):
            PublishedMemory(**bad)
    timed = RUNS.runs[0]
    with pytest.raises(ValueError, match="memory-only row"):
        PublishedRuns(sources=RUNS.sources, runs=[], memory_runs=[timed])
    untimed = RUNS.memory_runs[0]
    with pytest.raises(ValueError, match="needs its published speed"):
        PublishedRuns(sources=RUNS.sources, runs=[untimed])


@pytest.mark.parametrize("run_id", ["korthikanti-22b-seq-sel", "korthikanti-175b-seq-sel"])
def test_memory_per_gpu_within_10_percent_of_korthikanti_figure_1(run_id):
    """Sequence parallelism + selective recomputation: model states and activations of the first pipeline rank
    against the paper's profiled figures (Figure 1), each within 10%."""
    (run,) = [r for r in RUNS.runs if r.id == run_id]
    assert run.memory is not None
    states, acts = rank0_memory_gib(plan_run(run)[0])
    assert states == pytest.approx(run.memory.states_gib, rel=0.10)
    assert acts == pytest.approx(run.memory.activations_gib, rel=0.10)


def test_small_scale_fsdp_scales_flat_as_published():
    """llm-foundry's MPT-13B on 8-64 H100 (FSDP, ZeRO-3, 2 nodes and more): the published iteration time is flat
    with the GPU count (0.851-0.859 s). The predictions are flat too (within 3%) once the data-parallel ring
    crosses nodes on all of a node's NICs (`terms.dp_link`); on one NIC they doubled from 16 GPUs on."""
    ids = ["mpt-h100-13b-8", "mpt-h100-13b-16", "mpt-h100-13b-32", "mpt-h100-13b-64"]
    runs = {r.id: r for r in RUNS.runs}
    published = [runs[i].published_iteration_s for i in ids]
    assert max(published) / min(published) < 1.01
    predicted = [plan_run(runs[i], _GRAPHS)[0].predicted.iteration_time_s for i in ids]
    assert max(predicted) / min(predicted) < 1.03


MOE = [r for r in RUNS.runs if r.hf is not None]


def test_moe_rows_load_as_validation_with_an_expert_parallel_degree():
    """The mixture-of-experts rows: Hugging Face configs with an expert count, ep > 1, validation only (their
    sources on the validation side of the H100 split), converted to iteration times like the dense rows."""
    assert len(MOE) >= 6 and {r.source for r in MOE} >= {"moe-modelzoo", "megatron-bridge"}
    h100 = RUNS.splits["h100"]
    for run in MOE:
        assert run.role == "validation" and run.gpu in h100.gpus and run.source in h100.validation, run.id
        assert run.layout.ep > 1 and run.model == "hf" and run.config is None
        experts = run.hf.config.get("num_experts") or run.hf.config.get("num_local_experts")
        assert experts and experts % run.layout.ep == 0, run.id
    by_id = {r.id: r for r in MOE}
    # 5984 tokens/s/GPU on 64 GPUs, 1280 x 4096 tokens per iteration
    assert by_id["bridge-gpt-oss-120b-h100-64"].published_iteration_s == pytest.approx(1280 * 4096 / (5984 * 64))
    assert by_id["zoo-qwen3-235b-pp32-ep8-a2a"].published_iteration_s == 24.2


def test_moe_schema_keeps_the_model_kinds_apart():
    base = yaml.safe_load(RUNS_FILE.read_text())
    dense = next(r for r in base["runs"] if r["id"] == "mpt-h100-7b-128")
    moe = next(r for r in base["runs"] if r["id"] == "bridge-gpt-oss-120b-h100-64")
    cases = [
        ({**dense, "layout": {**dense["layout"], "ep": 2}}, "needs a mixture-of-experts model"),
        ({**dense, "hf": moe["hf"]}, "model hf takes `hf`"),
        ({k: v for k, v in moe.items() if k != "hf"}, "model hf takes `hf`"),
        ({**moe, "hf": {**moe["hf"], "config": {k: v for k, v in moe["hf"]["config"].items() if k != "model_type"}}},
         "model_type is required"),
        ({**moe, "published": {"metric": "tflops_per_gpu", "value": 163, "flops": "megatron-model"}},
         "publisher's FLOP formula"),
        ({**moe, "hf": {**moe["hf"], "revision": "main"}}, "Extra inputs"),
    ]
    for row, match in cases:
        data = {**base, "runs": [row]}
        with pytest.raises(ValidationError, match=match):
            PublishedRuns.model_validate(data)


def test_moe_layout_folding_experts_over_tp_x_dp_is_reported_not_expressible():
    """Megatron's ep 8 over tp 2 x dp 4 (expert TP 1): the planner's ep divides dp, so the row says so (before
    any model is traced)."""
    run = next(r for r in MOE if r.id == "zoo-qwen3-235b-pp32-ep8-a2a")
    with pytest.raises(NotExpressible, match=r"ep 8, dp 4.*ep divides dp.*tp = 1 only \(tp 2\)"):
        plan_run(run)


def test_moe_row_plans_with_its_pinned_ep():
    """GPT-OSS 120B on 64 H100 (Megatron-Bridge): built from its config on meta at full size, planned at the
    published tp 1, pp 4, dp 16 with ep 8 pinned: each rank holds 16 of each layer's 128 experts."""
    run = next(r for r in MOE if r.id == "bridge-gpt-oss-120b-h100-64")
    plan, cluster = plan_run(run)
    par = plan.parallel
    assert (par.dp, par.tp, par.pp, par.ep, par.micro_batch_size) == (16, 1, 4, 8, 1)
    assert (par.virtual_stages, par.zero_stage, par.schedule) == (1, 1, "1f1b")
    assert plan.experts and set(plan.experts.values()) == {128} and len(plan.experts) == 36
    assert 110e9 < plan.total_params < 125e9  # 116.8B: the published model, not a toy
    assert plan.predicted.comm.expert_parallel_s > 0
    assert 0 < plan.predicted.peak_memory_bytes <= cluster.gpu.memory_bytes
    assert graph_key(run)[:2] == ("hf", "openai/gpt-oss-120b")
