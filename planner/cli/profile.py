"""Measure each distinct partition unit's forward and backward time on this machine.

Usage:
    planner profile --help

    # Time the default tiny GPT's units on the CPU at micro-batch sizes 1 and 2
    planner profile sample_models/gpt.py --micro-batch-size 1 --micro-batch-size 2

    # On the local GPU, more repetitions, as JSON
    planner profile sample_models/llama.py -a layers=4 --device cuda --repeats 20 --json
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from planner.cli._options import (
    BuildFnOpt,
    Device,
    DType,
    DTypeOpt,
    InputsFnOpt,
    JsonOpt,
    LossFnOpt,
    ModelArgOpt,
    ModelFileArg,
    QuietOpt,
    is_quiet,
    parse_model_args,
    stderr_console,
    stdout_console,
)
from planner.errors import ConfigError

PROFILE_EXAMPLES = [
    "planner profile sample_models/gpt.py --micro-batch-size 1 --micro-batch-size 2",
    "planner profile sample_models/llama.py -a layers=4 --device cuda --repeats 20 --json",
]


def profile(
    ctx: typer.Context,
    model_file: ModelFileArg,
    model_arg: ModelArgOpt = None,
    micro_batch_size: Annotated[
        list[int] | None, typer.Option(min=1, help="Micro-batch size to time at (repeatable; default 1).")
    ] = None,
    device: Annotated[Device, typer.Option(help="Where to run the units.")] = Device.cpu,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per unit (the median is kept).")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed runs per unit before timing.")] = 2,
    dtype: DTypeOpt = DType.bf16,
    build_fn: BuildFnOpt = "build_model",
    inputs_fn: InputsFnOpt = "example_inputs",
    loss_fn: LossFnOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Time forward and backward of each distinct unit (identical blocks once) on the local device.

    Only one unit is allocated at a time, so large models can be profiled unit by unit. Results are cached
    on disk keyed by everything that changes them; a second identical run measures nothing.
    """
    try:
        from planner.measure.profile import profile_model
    except ImportError:  # the profiler is a later addition to the library
        raise ConfigError(
            "Profiling is not available in this installation of planner (planner.measure.profile is missing). "
            "Plans use roofline estimates meanwhile."
        ) from None
    from planner.model.load import load_model_file

    loaded = load_model_file(model_file, parse_model_args(model_arg), build_fn, inputs_fn, loss_fn, dtype.value)
    from planner.processes import model_loaded

    model_loaded()
    sizes = micro_batch_size or [1]
    console = stderr_console()
    if not is_quiet(ctx, quiet) and console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(TextColumn("Profiling units"), BarColumn(), MofNCompleteColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("profile", total=None)
            result = profile_model(
                loaded, sizes, device.value, repeats, warmup,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    else:
        result = profile_model(loaded, sizes, device.value, repeats, warmup)
    if json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
        return
    if is_quiet(ctx, quiet):
        return
    from rich.table import Table

    from planner.report.tables import compress_units, gib, ms

    table = Table(
        title=f"Unit times on {result.device_name} ({result.dtype}, median of {result.repeats}"
        f"{', from cache' if result.from_cache else ''})",
        title_justify="left",
    )
    for name in ("units", "mbs", "fwd ms", "bwd ms", "peak GiB"):
        table.add_column(name, justify="left" if name == "units" else "right")
    for u in result.units:
        peak = gib(u.peak_memory_bytes) if u.peak_memory_bytes is not None else "-"
        table.add_row(compress_units(u.units), str(u.micro_batch_size), ms(u.fwd_s), ms(u.bwd_s), peak)
    stdout_console().print(table)
