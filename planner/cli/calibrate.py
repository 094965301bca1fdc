"""Measure a GPU's efficiencies on this machine and write them as a spec YAML that `--gpu FILE` accepts.

Usage:
    planner calibrate --help

    # On a machine with H100s: GEMMs of Llama-2 7B's shapes, attention, memory-bound ops, NCCL collectives
    planner calibrate --gpu h100-sxm-80gb --model sample_models/llama.py -a preset=llama2-7b --device cuda \\
        --out h100-measured.yaml
    planner plan sample_models/llama.py -a preset=llama2-7b --gpu h100-measured.yaml --nodes 8 \\
        --global-batch-size 512 --out plan_out

    # Anywhere: the CPU spec against this machine's CPU (gloo between 2 processes)
    planner calibrate --gpu cpu --out cpu-measured.yaml
"""

from __future__ import annotations

import json as jsonlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from planner.cli._options import (
    Device,
    DType,
    DTypeOpt,
    JsonOpt,
    ModelArgOpt,
    QuietOpt,
    is_quiet,
    parse_model_args,
    stdout_console,
)
from planner.errors import ConfigError

CALIBRATE_EXAMPLES = [
    "planner calibrate --gpu h100-sxm-80gb --model sample_models/llama.py -a preset=llama2-7b --device cuda "
    "--out h100-measured.yaml",
    "planner calibrate --gpu cpu --out cpu-measured.yaml",
]


def calibrate(
    ctx: typer.Context,
    gpu: Annotated[
        str, typer.Option(help="The spec to calibrate: a GPU name or alias, or a YAML path.", show_default=False)
    ],
    out: Annotated[Path, typer.Option(help="Where to write the calibrated spec YAML.", show_default=False)],
    model: Annotated[
        list[Path] | None,
        typer.Option(
            help="Model file whose Linear shapes the GEMM benchmarks use (repeatable; default: a "
            "standard set of square GEMMs).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    model_arg: ModelArgOpt = None,
    device: Annotated[Device, typer.Option(help="Where to run the benchmarks.")] = Device.cpu,
    dtype: DTypeOpt = DType.bf16,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per benchmark (the median is kept).")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed runs before timing.")] = 2,
    world: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Processes for the collectives (default: every local GPU, 2 on a CPU; 1 skips "
            "them and keeps the spec's network efficiency).",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Name of the written spec (default: NAME-calibrated).")] = None,
    quick: Annotated[bool, typer.Option(help="Fewer and smaller benchmarks (a smoke test).")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run short micro-benchmarks on the local device and write the measured efficiencies as a spec.

    GEMMs (the model's shapes, or a standard set), causal attention, an elementwise op and all-reduce /
    all-gather / p2p between local processes; each efficiency is measured against the spec's own peak
    figures and written with a `# source:` comment saying how.
    """
    from planner.measure.calibrate import calibrate as run_calibration
    from planner.measure.calibrate import gpu_spec_and_file, model_gemm_shapes, write_calibrated_spec

    spec, spec_file = gpu_spec_and_file(gpu)
    shapes = None
    if model:
        shapes = model_gemm_shapes([(str(m), parse_model_args(model_arg)) for m in model], dtype.value)
        if not shapes:
            raise ConfigError(f"No nn.Linear in {', '.join(map(str, model))}: drop --model to use the standard GEMMs.")
    cal = run_calibration(spec, device.value, dtype.value, shapes, world, repeats, warmup, quick)
    write_calibrated_spec(cal, spec_file, out, name)
    if json:
        doc = {
            "spec": str(out),
            "device_name": cal.device_name,
            "efficiency": cal.efficiency.model_dump() if cal.efficiency else None,
            "measurements": [m.__dict__ for m in cal.measurements],
        }
        sys.stdout.write(jsonlib.dumps(doc, indent=2, sort_keys=True) + "\n")
        return
    if is_quiet(ctx, quiet):
        return
    from rich.table import Table

    table = Table(title=f"Calibration of {spec.name} on {cal.device_name} ({cal.dtype})", title_justify="left")
    for col in ("benchmark", "kind", "ms", "efficiency"):
        table.add_column(col, justify="left" if col in ("benchmark", "kind") else "right")
    for m in cal.measurements:
        table.add_row(m.label, m.kind, f"{1e3 * m.seconds:.3f}", f"{m.efficiency:.4f}")
    console = stdout_console()
    console.print(table)
    eff = cal.efficiency
    console.print(
        f"wrote {out}: "
        + ", ".join(f"{k}={v:g}" for k, v in (eff.model_dump() if eff else {}).items())
        + f"  (use it with --gpu {out})"
    )
