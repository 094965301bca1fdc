"""The dry-run cost report as rich renderables, built from a Plan (and, for `validate`, measured figures).

Pure functions from data to rich objects: nothing here prints. The CLI hands the result to a
``rich.console.Console``, which drops colour and animation when stdout is not a terminal.
Memory is shown in GiB (2**30 bytes, what allocators and nvidia-smi report), times in milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from planner.cost.terms import group_sizes
from planner.plan import Alternative, Plan, Predicted, Rejection, recompute_label

GIB = 2**30
REJECTED_SHOWN = 10

_ZERO = {0: "0 (DDP, replicated)", 1: "1 (sharded optimizer)", 2: "2 (sharded optimizer + grads)", 3: "3 (FSDP)"}


# --- formatting -------------------------------------------------------------------------------------------


def gib(n_bytes: float) -> str:
    """Bytes as GiB with two decimals; a small non-zero amount shows as '<0.01' rather than '0.00'."""
    if 0 < n_bytes < 0.005 * GIB:
        return "<0.01"
    return f"{n_bytes / GIB:.2f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def duration(seconds: float) -> str:
    """'0.312 ms' below 10 ms, '812.4 ms' below ten seconds, '12.35 s' above."""
    if seconds < 0.01:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def human_count(n: float) -> str:
    """1234567 -> '1.23M'; the suffixes papers use for parameter counts."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"


def rate(n: float) -> str:
    return f"{n:,.1f}" if n < 100 else f"{n:,.0f}"


def percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def compress_units(names: Sequence[str]) -> str:
    """Runs of consecutively numbered units shortened: ['embed', 'blocks.0', ..., 'blocks.11', 'head']
    -> 'embed, blocks.0-11, head'. Order is kept; only adjacent runs with one prefix are merged."""
    parts: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)

    def close() -> None:
        if run is not None:
            prefix, first, last = run
            parts.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")

    for name in names:
        m = _NUMBERED.match(name)
        if m and run is not None and m.group(1) == run[0] and int(m.group(2)) == run[2] + 1:
            run = (run[0], run[1], int(m.group(2)))
            continue
        close()
        run = None
        if m:
            run = (m.group(1), int(m.group(2)), int(m.group(2)))
        else:
            parts.append(name)
    close()
    return ", ".join(parts)


def stage_labels(plan: Plan) -> list[str]:
    """One short label per pipeline stage, in stage order (for the timeline picture)."""
    return [compress_units(s.units) for s in sorted(plan.stages, key=lambda s: s.index)]


def degrees(p: Any) -> str:
    """'dp 4 / tp 2 / pp 2 / v 1' for a ParallelConfig ('dp 8 (ep 4) / ...' with expert parallelism)."""
    ep = f" (ep {p.ep})" if getattr(p, "ep", 1) > 1 else ""
    cp = f" / cp {p.cp}" if getattr(p, "cp", 1) > 1 else ""
    return f"dp {p.dp}{ep}{cp} / tp {p.tp} / pp {p.pp} / v {p.virtual_stages}"


def _table(title: str, **kwargs: Any) -> Table:
    return Table(
        title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
        collapse_padding=True, **kwargs,
    )


# --- the plan report --------------------------------------------------------------------------------------


def summary_panel(plan: Plan, params: int | None = None, timeline: str | Path | None = None) -> Panel:
    """The headline: what is trained where, the chosen layout and the predicted speed and memory.

    params: the model's parameter count when the caller has the traced graph (a saved plan does not
    record it, unless its schema grows a ``total_params`` field).
    """
    p, pred, c = plan.parallel, plan.predicted, plan.cluster
    params = params if params is not None else getattr(plan, "total_params", None)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()

    model = plan.model_class + (f" ({human_count(params)} parameters)" if params else "")
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(plan.model.model_args.items()))
    grid.add_row("Model", model)
    grid.add_row("Model file", Path(plan.model.path).name + (f" ({args})" if args else ""))
    if plan.source_spec:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(plan.source_settings.items()))
        grid.add_row("Model source", plan.source_spec + (f" ({settings}, set by the planner)" if settings else ""))
    elif plan.source_settings:  # a transformers model built in a model file gets the hf: source's training settings
        settings = ", ".join(f"{k}={v}" for k, v in sorted(plan.source_settings.items()))
        grid.add_row("Model settings", f"{settings} (transformers, set by the planner for training)")
    if plan.structure:
        grid.add_row("Units", "; ".join(plan.structure))
    if plan.tp.head_attrs:
        # One line per module pattern (transformer.h.*.attn), not per block.
        pattern = {re.sub(r"\.\d+(?=\.|$)", ".*", m): ", ".join(a) for m, a in plan.tp.head_attrs.items()}
        grid.add_row("TP head attributes", "; ".join(f"{m}: {a} / tp" for m, a in pattern.items()))
    if plan.tp.refused:
        more = f" (+{len(plan.tp.refused) - 1} more in plan.json)" if len(plan.tp.refused) > 1 else ""
        grid.add_row("TP not applied", plan.tp.refused[0] + more)
    where = f"{c.nodes} node{'s' if c.nodes != 1 else ''} x {c.gpus_per_node} x {c.gpu}"
    if c.name != c.gpu:
        where += f" ({c.name})"
    grid.add_row("Cluster", f"{where} = {c.nodes * c.gpus_per_node} GPUs")
    grid.add_row("Parallelism", degrees(p))
    grid.add_row(
        "Micro-batches",
        f"{p.micro_batch_size} sample{'s' if p.micro_batch_size != 1 else ''} x {p.num_micro_batches} per "
        f"replica (global batch {p.global_batch_size})",
    )
    grid.add_row("Schedule", p.schedule if p.pp > 1 else f"{p.schedule} (no pipeline: gradient accumulation)")
    grid.add_row("ZeRO stage", _ZERO.get(p.zero_stage, str(p.zero_stage)))
    grid.add_row("Sequence parallel", "yes" if p.sequence_parallel else "no")
    if p.tp_overlap:
        grid.add_row("Async TP", "yes (collectives overlapped with the matmuls; torch.compile)")
    modes = sorted({s.recompute_label for s in plan.stages})
    grid.add_row("Recompute", ", ".join(modes))
    grid.add_row("Iteration time", duration(pred.iteration_time_s))
    grid.add_row("Samples/s", rate(pred.samples_per_s))
    tokens = rate(pred.tokens_per_s) if pred.tokens_per_s is not None else "n/a (inputs are not tokens)"
    grid.add_row("Tokens/s", tokens)
    grid.add_row(
        "TFLOP/s per GPU",
        f"{pred.model_tflops_per_gpu:.2f} model, {pred.hardware_tflops_per_gpu:.2f} with recomputation",
    )
    grid.add_row("MFU", percent(pred.mfu))
    headroom = pred.memory_capacity_bytes - pred.memory_reserve_bytes - pred.peak_memory_bytes
    # the reserve holds NCCL buffers for each process group of more than one rank (`terms.comm_reserve_bytes`)
    groups, reserve = group_sizes(p.dp, p.tp, p.pp, p.ep, p.cp), pred.memory_reserve_bytes
    grid.add_row(
        "Peak memory",
        f"{gib(pred.peak_memory_bytes)} of {gib(pred.memory_capacity_bytes)} GiB per GPU, reserve "
        f"{gib(pred.memory_reserve_bytes)} GiB"
        + (f" for the {', '.join(groups)} group{'s' if len(groups) > 1 else ''}" if groups and reserve else "")
        + f" (headroom {gib(headroom)} GiB after it)",
    )
    grid.add_row("Pipeline bubble", percent(pred.bubble_fraction))
    how = "profiled on this machine" if pred.source == "measured" else "roofline model of the spec"
    grid.add_row("Figures", f"{pred.source} ({how})")
    if timeline is not None:
        grid.add_row("Timeline", str(timeline))
    if plan.created_at:
        grid.add_row("Created", plan.created_at)
    return Panel(grid, title="Plan", title_align="left", box=box.ROUNDED, expand=False)


def _alt_recompute(alt: Alternative) -> list[str]:
    """A runner-up's stages' recomputation as the stages table labels it ("full x3 + none")."""
    ks = alt.recompute_full_blocks or [0] * len(alt.recompute)
    return [recompute_label(mode, k) for mode, k in zip(alt.recompute, ks, strict=True)]


def stages_table(plan: Plan, memory: bool = True) -> Table:
    """Per pipeline stage: where it runs, what it owns, its per-micro-batch times and (if `memory`) its
    memory breakdown in GiB."""
    title = "Pipeline stages (times per micro-batch in ms" + (", memory per GPU in GiB)" if memory else ")")
    t = _table(title)
    names = ["stage", "pp", "units", "recompute", "fwd", "bwd", "p2p"]
    names += ["weights", "grads", "optim", "activ", "buf+ws", "total"] if memory else ["GiB"]
    for name in [*names, "source"]:
        if name == "units":  # the one column that wraps; the numbers stay on one line
            t.add_column(name, overflow="fold", min_width=16, ratio=1)
        else:
            t.add_column(name, justify="left" if name in ("recompute", "source") else "right", no_wrap=True)
    for s in sorted(plan.stages, key=lambda s: s.index):
        m = s.memory
        cells = [str(s.index), str(s.pp_rank), compress_units(s.units), s.recompute_label,
                 ms(s.forward_time_s), ms(s.backward_time_s), ms(s.p2p_time_s)]
        if memory:
            cells += [gib(m.weights), gib(m.gradients), gib(m.optimizer), gib(m.activations),
                      gib(m.comm_buffers + m.workspace)]
        t.add_row(*cells, gib(m.total), s.source)
    return t


def memory_table(plan: Plan) -> Table:
    """Per pipeline stage memory breakdown in GiB (the stages table's right half, for narrow terminals)."""
    t = _table("Memory per stage (GiB per GPU)")
    for name in ("stage", "pp", "weights", "grads", "optim", "activ", "buf+ws", "total"):
        t.add_column(name, justify="right", no_wrap=True)
    for s in sorted(plan.stages, key=lambda s: s.index):
        m = s.memory
        t.add_row(str(s.index), str(s.pp_rank), gib(m.weights), gib(m.gradients), gib(m.optimizer),
                  gib(m.activations), gib(m.comm_buffers + m.workspace), gib(m.total))
    return t


def comm_table(plan: Plan) -> Table:
    """Communication per iteration by kind, with its share of the iteration time."""
    pred = plan.predicted
    comm = pred.comm
    t = _table("Communication per iteration")
    t.add_column("kind")
    t.add_column("ms", justify="right")
    t.add_column("of iteration", justify="right")
    rows: tuple[tuple[str, float], ...] = (
        ("tensor parallel (all-reduce / gather)", comm.tensor_parallel_s),
        ("pipeline p2p (activations + grads)", comm.pipeline_p2p_s),
        ("data parallel, total", comm.data_parallel_s),
        ("data parallel, exposed (not overlapped)", comm.data_parallel_exposed_s),
    )
    if comm.expert_parallel_s > 0:
        rows += (("expert parallel (MoE all-to-all)", comm.expert_parallel_s),)
    if comm.context_parallel_s > 0:
        rows += (("context parallel (K/V all-gather)", comm.context_parallel_s),)
    for kind, seconds in rows:
        share = seconds / pred.iteration_time_s if pred.iteration_time_s > 0 else 0.0
        t.add_row(kind, ms(seconds), percent(share))
    return t


def alternatives_table(plan: Plan) -> Table:
    """The runners-up, in rank order, against the chosen plan (marked *)."""
    best = plan.predicted.iteration_time_s
    t = _table("Runners-up (diff: iteration time vs the chosen plan; GiB: peak memory per GPU)")
    # The ep column only where some layout has expert parallelism: dense models' reports stay as they were.
    with_ep = any(a.parallel.ep > 1 for a in plan.alternatives) or plan.parallel.ep > 1
    ep_col = ("ep",) if with_ep else ()
    # likewise the cp column, only where some layout has context parallelism
    with_cp = any(a.parallel.cp > 1 for a in plan.alternatives) or plan.parallel.cp > 1
    cp_col = ("cp",) if with_cp else ()
    names = (
        "#", "dp/tp/pp/v", *ep_col, *cp_col, "schedule", "zero", "sp", "mbs x m", "recompute", "iteration", "diff",
        "GiB",
    )
    for name in names:
        if name == "recompute":  # a list of modes: the one column that wraps
            t.add_column(name, min_width=9, ratio=1)
        else:
            t.add_column(name, justify="left" if name in ("dp/tp/pp/v", "schedule") else "right", no_wrap=True)

    def layout(p: Any) -> tuple[str, ...]:
        return (
            f"{p.dp}/{p.tp}/{p.pp}/{p.virtual_stages}", *((str(p.ep),) if with_ep else ()),
            *((str(p.cp),) if with_cp else ()),
        )

    p = plan.parallel
    t.add_row(
        "*", *layout(p), p.schedule, str(p.zero_stage), "yes" if p.sequence_parallel else "no",
        f"{p.micro_batch_size} x {p.num_micro_batches}", ", ".join(sorted({s.recompute_label for s in plan.stages})),
        duration(best), "-", gib(plan.predicted.peak_memory_bytes), style="bold",
    )
    for i, alt in enumerate(plan.alternatives, start=1):
        p = alt.parallel
        diff = alt.predicted.iteration_time_s / best - 1 if best > 0 else 0.0
        t.add_row(
            str(i), *layout(p), p.schedule, str(p.zero_stage), "yes" if p.sequence_parallel else "no",
            f"{p.micro_batch_size} x {p.num_micro_batches}", ", ".join(sorted(set(_alt_recompute(alt)))),
            duration(alt.predicted.iteration_time_s), f"{diff * 100:+.1f}%", gib(alt.predicted.peak_memory_bytes),
        )
    return t


def top_rejections(rejected: Iterable[Rejection], limit: int = REJECTED_SHOWN) -> list[Rejection]:
    """The most common reasons first (ties by region), at most `limit`."""
    return sorted(rejected, key=lambda r: (-r.count, r.region, r.reason))[:limit]


def rejected_table(plan: Plan, limit: int = REJECTED_SHOWN) -> Table:
    """Regions of the search space ruled out, and why (the `limit` largest)."""
    shown = top_rejections(plan.rejected, limit)
    t = _table("Rejected regions")
    t.add_column("region", no_wrap=True)
    t.add_column("reason", overflow="fold")
    t.add_column("count", justify="right")
    for r in shown:
        t.add_row(r.region, r.reason, str(r.count))
    hidden = len(plan.rejected) - len(shown)
    if hidden > 0:
        rest = sum(r.count for r in plan.rejected) - sum(r.count for r in shown)
        t.add_row(f"({hidden} more)", "smaller groups; every one is listed under rejected in plan.json", str(rest),
                  style="dim")
    return t


def search_table(plan: Plan) -> Table:
    s = plan.search
    t = _table("Search")
    t.add_column("candidates", justify="right")
    t.add_column("ILPs solved", justify="right")
    t.add_column("pruned by bound", justify="right")
    t.add_column("status")
    t.add_column("gap", justify="right")
    t.add_column("iteration-time gap", justify="right")
    t.add_row(
        str(s.candidates), str(s.ilps_solved), str(s.pruned_by_bound), s.status, percent(s.gap),
        percent(s.reported_gap),
    )
    return t


# Below this many columns the per-stage memory breakdown gets a table of its own.
WIDE = 120


def plan_report(
    plan: Plan, params: int | None = None, timeline: str | Path | None = None, width: int | None = None
) -> Group:
    """The whole dry-run cost report of a plan, top to bottom; `width`: the console's, if known."""
    parts: list[RenderableType] = [summary_panel(plan, params, timeline)]
    if width is not None and width < WIDE:
        parts += [stages_table(plan, memory=False), memory_table(plan)]
    else:
        parts.append(stages_table(plan))
    parts.append(comm_table(plan))
    if plan.alternatives:
        parts.append(alternatives_table(plan))
    if plan.rejected:
        parts.append(rejected_table(plan))
    parts.append(search_table(plan))
    return Group(*parts)


# --- predicted vs measured (planner validate) -------------------------------------------------------------


def validation_table(
    plan: Plan,
    step_times: Sequence[float],
    ranks: Sequence[tuple[int, int | None, int]],
    memory_kind: str,
) -> Group:
    """Predicted against measured: step time (warm-up steps already dropped) and peak memory per rank.

    ranks: (global rank, pp rank or None, measured peak bytes) per process; memory_kind says what was
    measured (the CUDA allocator's peak, or on CPU the process's peak RSS, runtime included).
    """
    pred: Predicted = plan.predicted
    measured = sum(step_times) / len(step_times) if step_times else 0.0
    t = _table(f"Predicted vs measured over {len(step_times)} step(s) after warm-up")
    t.add_column("figure")
    t.add_column("predicted", justify="right")
    t.add_column("measured", justify="right")
    t.add_column("measured / predicted", justify="right")

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3g}x" if b > 0 else "n/a"

    t.add_row("iteration time (mean)", duration(pred.iteration_time_s), duration(measured),
              ratio(measured, pred.iteration_time_s))
    if step_times:
        t.add_row("iteration time (min / max)", "", f"{duration(min(step_times))} / {duration(max(step_times))}", "")
    measured_rate = plan.parallel.global_batch_size / measured if measured > 0 else 0.0
    t.add_row("samples/s", rate(pred.samples_per_s), rate(measured_rate), ratio(measured_rate, pred.samples_per_s))
    if ranks:
        peak = max(b for _, _, b in ranks)
        t.add_row("peak memory, busiest rank (GiB)", gib(pred.peak_memory_bytes), gib(peak),
                  ratio(peak, pred.peak_memory_bytes))

    per_rank = _table("Peak memory per rank (GiB)")
    for name in ("rank", "pp rank", "predicted", "measured"):
        per_rank.add_column(name, justify="right")
    predicted_by_pp: dict[int, int] = {}
    for s in plan.stages:
        predicted_by_pp[s.pp_rank] = predicted_by_pp.get(s.pp_rank, 0) + s.memory_bytes
    for rank, pp_rank, peak_bytes in sorted(ranks, key=lambda r: r[0]):
        predicted = predicted_by_pp.get(pp_rank) if pp_rank is not None else None
        per_rank.add_row(str(rank), "?" if pp_rank is None else str(pp_rank),
                         gib(predicted) if predicted is not None else "?", gib(peak_bytes))
    note = Text(
        "Memory on CPU is each process's peak resident set (Python, torch and gloo included), not the model's "
        "tensors alone, so it is not comparable with the prediction."
        if memory_kind == "cpu_max_rss"
        else f"Measured memory: {memory_kind}.",
        style="dim",
    )
    return Group(t, per_rank, note)


# --- hardware specs ---------------------------------------------------------------------------------------


def hardware_table(rows: Sequence[dict[str, Any]]) -> Table:
    """`planner hardware list`: one row per spec (rows from the CLI, one dict per spec)."""
    t = _table("Hardware specs")
    for name, justify in (("name", "left"), ("display name", "left"), ("kind", "left"), ("bf16 TFLOP/s", "right"),
                          ("memory GiB", "right"), ("bandwidth GB/s", "right"), ("node", "left")):
        t.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        t.add_row(
            r["name"], r["display_name"], r["kind"], _num(r.get("bf16_tflops")), _num(r.get("memory_gib")),
            _num(r.get("memory_bandwidth_gbps")), r.get("node", ""),
        )
    return t


def spec_table(data: dict[str, Any], title: str) -> Table:
    """`planner hardware show`: every field of a spec, nested fields flattened to dotted names."""
    t = _table(title)
    t.add_column("field", no_wrap=True)
    t.add_column("value", overflow="fold")
    for key, value in _flatten(data):
        t.add_row(key, value)
    return t


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict) and value:
        out: list[tuple[str, str]] = []
        for k, v in value.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list):
        return [(prefix, ", ".join(str(v) for v in value) or "-")]
    return [(prefix, "-" if value is None or value == {} else str(value))]


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:g}"
