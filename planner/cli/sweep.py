"""Which GPUs and how many nodes, for what time and price: one plan per cluster, a table and a plot.

Usage:
    planner sweep --help

    # Llama-3-70B on A100s, H100s and H200s, 4 to 128 nodes, 1T tokens
    planner sweep sample_models/llama.py -a preset=llama3-70b --gpu a100-sxm-80gb,h100-sxm-80gb,h200 \
        --nodes 4..128 --global-batch-size 1024 --tokens 1e12 --price h200=4.5 --out sweep_out
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from planner.cli._options import (
    DType,
    DTypeOpt,
    GlobalBatchOpt,
    JsonOpt,
    ModelArgOpt,
    ModelFileArg,
    QuietOpt,
    is_quiet,
    plan_request,
    stderr_console,
    stdout_console,
)

SWEEP_EXAMPLES = [
    "planner sweep sample_models/llama.py -a preset=llama3-70b --gpu a100-sxm-80gb,h100-sxm-80gb,h200 "
    "--nodes 4..128 --global-batch-size 1024 --tokens 1e12",
    "planner sweep sample_models/gpt.py --gpu a100,h100 --nodes 1,2,4 --global-batch-size 64 --price h100=2.49",
]
TABLE_FILE = "sweep.json"
PLOT_FILE = "sweep.svg"
PNG_FILE = "sweep.png"


def sweep(
    ctx: typer.Context,
    model_file: ModelFileArg,
    gpu: Annotated[str, typer.Option(help="GPU kinds, comma-separated names or aliases (`planner hardware list`).",
                                     show_default=False)],
    nodes: Annotated[str, typer.Option(help="Node counts: LOW..HIGH (the powers of two between, with both ends) "
                                       "or a comma-separated list.", show_default=False)],
    global_batch_size: GlobalBatchOpt,
    model_arg: ModelArgOpt = None,
    price: Annotated[list[str] | None, typer.Option(
        metavar="GPU=USD", help="USD per GPU-hour for a GPU kind (repeatable; default: the spec's price, whose "
        "source and date are in its YAML).", show_default=False)] = None,
    tokens: Annotated[float | None, typer.Option(
        help="Training tokens, for the time to train and its cost (e.g. 1e12).", min=1, show_default=False)] = None,
    dtype: DTypeOpt = DType.bf16,
    jobs: Annotated[int, typer.Option(min=1, help="Plans searched at once (forked processes).")] = 2,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Folder for sweep.json and the plot (sweep.svg, and sweep.png with matplotlib).",
        show_default=False)] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Plan one model on every GPU kind x node count and compare iteration time, tokens/s, MFU, time to train
    and cost; the Pareto front (no other cluster both faster and cheaper) is marked."""
    import json as jsonlib
    from dataclasses import asdict

    from planner.io import atomic_write_text
    from planner.report.sweep import parse_nodes, parse_prices, sweep_png, sweep_svg
    from planner.report.sweep import sweep as run_sweep

    kinds = [g.strip() for g in gpu.split(",") if g.strip()]
    counts = parse_nodes(nodes)
    prices = parse_prices(price)
    request = plan_request(
        model_file, model_arg, gpu=kinds[0] if kinds else gpu, nodes=1, gpus_per_node=None,
        global_batch_size=global_batch_size, dp=None, tp=None, pp=None, virtual_stages=None, micro_batch_size=None,
        schedule=None, zero_stage=None, recompute=None, sequence_parallel=None, dtype=dtype, build_fn="build_model",
        inputs_fn="example_inputs", loss_fn=None, top_k=0, time_limit=None, no_overlap=False, seed=0, lr=1e-4,
        steps=10, measure=False,
    )
    quiet = is_quiet(ctx, quiet)
    console = stderr_console()
    progress = None
    if not quiet and console.is_terminal:
        def progress(done: int, total: int) -> None:
            console.print(f"planned {done}/{total}", end="\r")
    points = run_sweep(request, kinds, counts, prices, int(tokens) if tokens else None, jobs, progress=progress)
    title = f"{Path(request.model_path).name} {request.model_args or ''}: global batch {global_batch_size}".strip()
    doc = {"model": request.model_path, "model_args": request.model_args, "global_batch_size": global_batch_size,
           "tokens": tokens, "points": [asdict(p) for p in points]}
    text = jsonlib.dumps(doc, indent=1, sort_keys=True) + "\n"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / TABLE_FILE, text)
        atomic_write_text(out / PLOT_FILE, sweep_svg(points, title))
        png = sweep_png(points, title)
        if png is not None:
            tmp = out / f".{PNG_FILE}.tmp"
            tmp.write_bytes(png)
            tmp.replace(out / PNG_FILE)
    if json:
        sys.stdout.write(text)
    elif not quiet:
        from planner.report.sweep import sweep_table

        stdout_console().print(sweep_table(points, title))
        if out is not None:
            stdout_console().print(f"Wrote {out / TABLE_FILE} and {out / PLOT_FILE}.")
