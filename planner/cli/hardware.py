"""The hardware specs the planner knows: GPUs and cluster presets (YAML files under hardware_specs/).

Usage:
    planner hardware --help

    # Every known spec, one line each
    planner hardware list

    # Every field of one spec, with the source of each number
    planner hardware show h100
    planner hardware show ./my_gpu.yaml --json
"""

from __future__ import annotations

import json as jsonlib
import sys
from typing import Annotated, Any

import typer

from planner.cli._options import JsonOpt, examples_epilog, stdout_console

LIST_EXAMPLES = ["planner hardware list", "planner hardware list --json"]
SHOW_EXAMPLES = ["planner hardware show h100-sxm5-80gb", "planner hardware show ./my_gpu.yaml --json"]

hardware_app = typer.Typer(
    help="List and inspect GPU specs and cluster presets.", no_args_is_help=True, add_completion=False,
    rich_markup_mode=None
)


@hardware_app.command("list", epilog=examples_epilog(LIST_EXAMPLES))
def list_(json: JsonOpt = False) -> None:
    """List every GPU spec and cluster preset: name, peak bf16 TFLOP/s, memory, bandwidth and node."""
    from planner.hardware.load import list_specs

    rows = [_row(spec) for spec in list_specs()]
    if json:
        sys.stdout.write(jsonlib.dumps(rows, indent=2, sort_keys=True) + "\n")
        return
    from planner.report.tables import hardware_table

    stdout_console().print(hardware_table(rows))


@hardware_app.command(epilog=examples_epilog(SHOW_EXAMPLES))
def show(
    name: Annotated[
        str,
        typer.Argument(
            help="A spec name or alias (see `planner hardware list`) or a YAML path.", metavar="NAME|PATH",
            show_default=False,
        ),
    ],
    json: JsonOpt = False,
) -> None:
    """Show every field of a GPU spec or cluster preset, with the source of each number."""
    from planner.hardware.load import load_spec

    spec = load_spec(name)
    data = spec.model_dump(mode="json")
    if json:
        sys.stdout.write(jsonlib.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    from planner.report.tables import spec_table

    stdout_console().print(spec_table(data, f"{spec.display_name} ({spec.kind} spec {spec.name})"))


def _row(spec: Any) -> dict[str, Any]:
    """One line of `hardware list`; a cluster preset shows the figures of its GPU."""
    from planner.errors import SpecError
    from planner.hardware.load import load_cluster

    gpu = spec
    if spec.kind == "cluster":
        try:
            gpu = load_cluster(spec.name, 1).gpu
        except SpecError:
            gpu = None  # a preset naming a missing GPU: listed, without figures
    topo = spec.topology
    node = f"{topo.gpus_per_node} x {gpu.name if gpu is not None else '?'}, {topo.intra_node_link}"
    return {
        "name": spec.name,
        "display_name": spec.display_name,
        "kind": spec.kind,
        "aliases": list(spec.aliases),
        "bf16_tflops": gpu.peak_flops("bf16") / 1e12 if gpu is not None else None,
        "memory_gib": gpu.memory_gib if gpu is not None else None,
        "memory_bandwidth_gbps": gpu.memory_bandwidth_gbps if gpu is not None else None,
        "node": node,
    }
