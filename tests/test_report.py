"""The report tables (planner/report/tables.py): formatting helpers and what each table shows for a plan."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from planner.hardware.load import list_specs
from planner.model.graph import ModelSource
from planner.plan import (
    Alternative,
    ClusterSummary,
    CommBreakdown,
    MemoryBreakdown,
    ParallelConfig,
    Plan,
    Predicted,
    Rejection,
    SearchStats,
    StagePlan,
)
from planner.report.tables import (
    compress_units,
    duration,
    gib,
    hardware_table,
    human_count,
    plan_report,
    spec_table,
    stage_labels,
    summary_panel,
    top_rejections,
    validation_table,
)

GIB = 2**30


def render(renderable, width: int = 200) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _predicted(iteration: float, peak: int = 60 * GIB, **kw) -> Predicted:
    return Predicted(
        iteration_time_s=iteration, samples_per_s=64 / iteration if iteration else 0.0,
        tokens_per_s=64 * 2048 / iteration if iteration else 0.0, model_tflops_per_gpu=312.5,
        hardware_tflops_per_gpu=400.25, mfu=0.4211, peak_memory_bytes=peak, memory_capacity_bytes=80 * GIB,
        bubble_fraction=0.125, **kw,
    )


def make_plan(iteration: float = 2.0, rejections: int = 12) -> Plan:
    """dp 2 x tp 2 x pp 2, interleaved over 4 stages of a 16-block GPT; two runners-up."""
    parallel = ParallelConfig(
        dp=2, tp=2, pp=2, virtual_stages=2, micro_batch_size=2, num_micro_batches=16, global_batch_size=64,
        schedule="interleaved-1f1b", zero_stage=3, sequence_parallel=True,
    )
    stages = []
    for i in range(4):
        units = [f"blocks.{4 * i + j}" for j in range(4)]
        if i == 0:
            units = ["embed", *units]
        if i == 3:
            units = [*units, "norm+head"]
        mem = MemoryBreakdown(
            weights=2 * GIB, gradients=GIB, optimizer=4 * GIB, activations=(10 + i) * GIB, comm_buffers=GIB // 2,
            workspace=GIB // 2,
        )
        stages.append(StagePlan(
            index=i, pp_rank=i % 2, units=units, modules=units, recompute="selective" if i < 2 else "full",
            forward_time_s=0.0125, backward_time_s=0.025, p2p_time_s=0.0005, compute_time_s=0.0375,
            memory_bytes=mem.total, memory=mem, source="estimated",
        ))
    alternatives = [
        Alternative(
            parallel=parallel.model_copy(update={"zero_stage": 1}), recompute=["full"] * 4,
            predicted=_predicted(iteration * 1.1, peak=70 * GIB),
        ),
        Alternative(
            parallel=ParallelConfig(
                dp=1, tp=4, pp=2, micro_batch_size=1, num_micro_batches=64, global_batch_size=64, schedule="gpipe",
            ),
            recompute=["none", "full"], predicted=_predicted(iteration * 1.5),
        ),
    ]
    return Plan(
        planner_version="test", inputs_digest="0" * 64,
        model=ModelSource(path="/models/gpt.py", file_sha256="0" * 64, model_args={"preset": "gpt3-1.3b"}),
        model_class="GPT", trace_method="fx", tokens_per_sample=2048,
        cluster=ClusterSummary(name="dgx-h100", gpu="h100-sxm5-80gb", nodes=1, gpus_per_node=8),
        parallel=parallel, stages=stages,
        predicted=_predicted(iteration).model_copy(update={"comm": CommBreakdown(
            tensor_parallel_s=0.2, pipeline_p2p_s=0.05, data_parallel_s=0.5, data_parallel_exposed_s=0.1,
        )}),
        alternatives=alternatives,
        rejected=[Rejection(region=f"tp={r}", reason=f"reason {r}", count=r + 1) for r in range(rejections)],
        search=SearchStats(candidates=140, pruned_by_bound=120, ilps_solved=20, status="optimal"),
    )


# --- helpers ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["embed", *[f"blocks.{i}" for i in range(12)], "head"], "embed, blocks.0-11, head"),
        (["blocks.0", "blocks.2", "blocks.3"], "blocks.0, blocks.2-3"),
        (["a.1", "b.2", "b.3"], "a.1, b.2-3"),
        (["layers.3", "layers.2"], "layers.3, layers.2"),  # only ascending runs merge
        (["tok_emb+pos_emb", "h.0", "h.1", "ln_f+lm_head"], "tok_emb+pos_emb, h.0-1, ln_f+lm_head"),
        (["blocks.7"], "blocks.7"),
        ([], ""),
    ],
)
def test_compress_units(names, expected):
    assert compress_units(names) == expected


def test_number_formats():
    assert gib(0) == "0.00" and gib(1) == "<0.01" and gib(GIB) == "1.00" and gib(80 * GIB) == "80.00"
    assert human_count(175e9) == "175.00B" and human_count(1_060_000) == "1.06M" and human_count(12) == "12"
    assert duration(0.0003125) == "0.312 ms" and duration(0.8124) == "812.4 ms" and duration(12.345) == "12.35 s"


def test_stage_labels_follow_stage_order():
    plan = make_plan()
    shuffled = plan.model_copy(update={"stages": list(reversed(plan.stages))})
    assert stage_labels(shuffled) == ["embed, blocks.0-3", "blocks.4-7", "blocks.8-11", "blocks.12-15, norm+head"]


def test_top_rejections_orders_by_count_and_keeps_ten():
    plan = make_plan(rejections=12)
    top = top_rejections(plan.rejected)
    assert len(top) == 10
    assert [r.count for r in top] == list(range(12, 2, -1))


# --- the plan report --------------------------------------------------------------------------------------


def test_summary_shows_layout_speed_and_memory():
    text = render(summary_panel(make_plan(), params=1_300_000_000, timeline="out/timeline.svg"))
    for expected in (
        "GPT (1.30B parameters)", "gpt.py (preset='gpt3-1.3b')", "1 node x 8 x h100-sxm5-80gb (dgx-h100) = 8 GPUs",
        "dp 2 / tp 2 / pp 2 / v 2", "2 samples x 16 per replica (global batch 64)", "interleaved-1f1b",
        "3 (FSDP)", "Sequence parallel  yes", "full, selective", "2000.0 ms", "Samples/s          32.0",
        "65,536", "312.50 model, 400.25 with recomputation", "42.1%",
        "60.00 of 80.00 GiB per GPU, reserve 0.00 GiB (headroom 20.00 GiB after it)",
        "12.5%", "estimated", "out/timeline.svg",
    ):
        assert expected in text, expected


def test_summary_shows_the_headroom_after_the_memory_reserve():
    plan = make_plan()
    pred = plan.predicted.model_copy(update={"memory_reserve_bytes": 3 * 2**30})
    text = render(summary_panel(plan.model_copy(update={"predicted": pred})))
    expected = "60.00 of 80.00 GiB per GPU, reserve 3.00 GiB for the dp, tp, pp groups (headroom 17.00 GiB after it)"
    assert expected in text


def test_summary_without_params_or_tokens():
    plan = make_plan()
    plan = plan.model_copy(update={"predicted": plan.predicted.model_copy(update={"tokens_per_s": None})})
    text = render(summary_panel(plan))
    assert re.search(r"Model\s+GPT\s+│", text) and "parameters" not in text
    assert "n/a (inputs are not tokens)" in text
    assert "Timeline" not in text


def test_report_tables():
    text = render(plan_report(make_plan(), params=1_300_000_000))
    lines = text.splitlines()
    # Per-stage table: units compressed, times in ms, memory in GiB (buffers + workspace together).
    row0 = next(line for line in lines if line.lstrip().startswith("0 ") and "embed" in line)
    for cell in ("embed, blocks.0-3", "selective", "12.500", "25.000", "0.500", "2.00", "4.00", "10.00", "1.00",
                 "18.00", "estimated"):
        assert cell in row0, (cell, row0)
    # Communication: ms and share of the 2 s iteration.
    comm = next(line for line in lines if "tensor parallel" in line)
    assert "200.000" in comm and "10.0%" in comm
    assert "5.0%" in next(line for line in lines if "exposed" in line)
    # Runners-up: the chosen plan first, then each with its difference.
    assert "+10.0%" in text and "+50.0%" in text
    assert "1/4/2/1" in text and "none, full" not in text  # recompute modes are sorted
    # Rejected regions: the ten largest, and a note about the rest.
    assert "tp=11" in text and "tp=2 " in text and "tp=1 " not in text and "tp=0 " not in text
    rest = next(line for line in text.splitlines() if "(2 more)" in line)
    assert rest.split()[-1] == "3"  # the two hidden groups held 1 + 2 candidates
    # Search statistics: the ILP's gap on its objective, then the gap on the reported iteration time.
    search = next(line for line in lines if "optimal" in line)
    assert search.split() == ["140", "20", "120", "optimal", "0.0%", "0.0%"]
    plan = make_plan()
    plan = plan.model_copy(update={"search": plan.search.model_copy(update={"gap": 0.012, "reported_gap": 0.034})})
    lines = render(plan_report(plan, params=1_300_000_000, width=160), width=160).splitlines()
    assert any("iteration-time gap" in line for line in lines)
    search = next(line for line in lines if "optimal" in line)
    assert search.split() == ["140", "20", "120", "optimal", "1.2%", "3.4%"]


def test_report_is_deterministic_and_survives_degenerate_figures():
    plan = make_plan()
    assert render(plan_report(plan)) == render(plan_report(plan))
    zero = make_plan(iteration=0.0, rejections=0)  # a hand-edited plan may say anything that validates
    text = render(plan_report(zero))
    assert "Rejected regions" not in text and "Runners-up" in text


def test_narrow_terminals_keep_every_column():
    text = render(plan_report(make_plan(), width=120), width=120)
    header = next(line for line in text.splitlines() if "recompute" in line and "weights" in line)
    assert header.split()[-1] == "source"
    # At 80 columns the memory breakdown moves to a table of its own and no cell is cut short.
    text = render(plan_report(make_plan(), width=80), width=80)
    assert "Memory per stage" in text and "\u2026" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


# --- validate and hardware --------------------------------------------------------------------------------


def test_validation_table_compares_per_pp_rank():
    plan = make_plan()
    ranks = [(0, 0, 30 * GIB), (1, 1, 35 * GIB), (2, None, GIB)]
    text = render(validation_table(plan, [1.0, 3.0], ranks, "cuda_max_memory_allocated"))
    assert "over 2 step(s)" in text
    mean = next(line for line in text.splitlines() if "iteration time (mean)" in line)
    assert "2000.0 ms" in mean and "1x" in mean
    by_rank = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()[:1].isdigit()}
    # pp rank 0 holds stages 0 and 2: 18 + 20 GiB predicted.
    assert by_rank["0"][1:] == ["0", "38.00", "30.00"]
    assert by_rank["1"][1:] == ["1", "40.00", "35.00"]
    assert by_rank["2"][1:] == ["?", "?", "1.00"]
    assert "cuda_max_memory_allocated" in text


def test_validation_table_warns_that_cpu_rss_is_not_comparable():
    text = render(validation_table(make_plan(), [0.5], [(0, 0, GIB)], "cpu_max_rss"))
    assert "not comparable" in text


def test_hardware_tables():
    rows = [
        {"name": "x1", "display_name": "X One", "kind": "gpu", "bf16_tflops": 989.4, "memory_gib": 80.0,
         "memory_bandwidth_gbps": 3350.0, "node": "8 x x1, NVLink"},
        {"name": "c1", "display_name": "Cluster", "kind": "cluster", "bf16_tflops": None, "memory_gib": None,
         "memory_bandwidth_gbps": None, "node": "8 x ?"},
    ]
    text = render(hardware_table(rows))
    assert "989.4" in text and "3350" in text and "8 x x1, NVLink" in text
    assert next(line for line in text.splitlines() if line.lstrip().startswith("c1")).count(" - ") >= 2

    spec = next(s for s in list_specs() if s.name == "h100-sxm5-80gb")
    text = render(spec_table(spec.model_dump(mode="json"), spec.display_name), width=240)
    for field in ("peak_tflops.bf16", "memory_gib", "topology.gpus_per_node", "efficiency.matmul", "sources."):
        assert field in text, field
