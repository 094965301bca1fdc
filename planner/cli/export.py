"""Write a saved plan's layout in the configuration of torchtitan or Megatron-LM.

Usage:
    planner export --help

    # torchtitan: plan_out/torchtitan_plan.py (apply_plan(config) for a Trainer.Config, and FLAGS)
    planner export plan_out --to torchtitan

    # Megatron-LM: plan_out/megatron_args.sh (PLANNED_ARGS, a bash array of its arguments)
    planner export plan_out --to megatron
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from planner.cli._options import ForceOpt, PlanPathArg, QuietOpt, is_quiet, stdout_console

EXPORT_EXAMPLES = ["planner export plan_out --to torchtitan", "planner export plan_out --to megatron"]
FILES = {"torchtitan": "torchtitan_plan.py", "megatron": "megatron_args.sh"}


class Framework(str, Enum):
    torchtitan = "torchtitan"
    megatron = "megatron"


def export(
    ctx: typer.Context,
    plan_path: PlanPathArg,
    to: Annotated[Framework, typer.Option("--to", help="The framework whose configuration to write.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help=f"The file to write (default: beside plan.json, {', '.join(FILES.values())}).",
                     show_default=False),
    ] = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write the plan's parallel layout, batch, recomputation and ZeRO stage in torchtitan's or Megatron-LM's own
    names. What the framework cannot express (a schedule it lacks, stages it cannot split) exits 2 with the
    reason; an existing file that holds something else is kept unless --force."""
    from planner.errors import ConfigError
    from planner.io import atomic_write_text
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    if to is Framework.torchtitan:
        from planner.export.torchtitan import render
    else:
        from planner.export.megatron import render
    text = render(plan)
    folder = plan_path if plan_path.is_dir() else plan_path.parent
    target = out if out is not None else folder / FILES[to.value]
    if target.exists() and not force and target.read_text(errors="replace") != text:
        raise ConfigError(f"{target} exists and holds something else: pass --force to replace it, or --out.")
    atomic_write_text(target, text)
    if not is_quiet(ctx, quiet):
        stdout_console().print(f"Wrote {target}")
