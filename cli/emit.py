"""Render the training script and launchers of a saved plan, without planning again.

Usage:
    planner emit --help

    # Scripts for a plan into a new folder (plan.json is copied next to them)
    planner emit plan_out/plan.json --out run1

    # Regenerate the scripts in place, e.g. after upgrading the planner
    planner emit plan_out --out plan_out --force
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cli._options import ForceOpt, PlanPathArg, QuietOpt, is_quiet, stdout_console
from planner.errors import ConfigError

EMIT_EXAMPLES = [
    "planner emit plan_out/plan.json --out run1",
    "planner emit plan_out --out plan_out --force",
]

PLAN_FILE = "plan.json"

# name -> (text, executable)
Files = dict[str, tuple[str, bool]]


def emit(
    ctx: typer.Context,
    plan_path: PlanPathArg,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for the scripts (and a copy of plan.json).", show_default=False)
    ],
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write train.py, launch.sh, launch_multinode.sh and slurm.sbatch for a saved plan.

    The plan is validated (schema version included) and rendered in full before anything is written; each
    file is written atomically. Files in --out that hold something else are kept unless --force is given.
    """
    from planner.codegen.render import render
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    files: Files = dict(render(plan, PLAN_FILE))
    files[PLAN_FILE] = (plan.to_json(), False)
    written = write_outputs(out, files, force)
    if not is_quiet(ctx, quiet):
        console = stdout_console()
        console.print(f"Wrote {len(written)} files to {out}:")
        for path in written:
            console.print(f"  {path}")


def write_outputs(out_dir: Path, files: Files, force: bool) -> list[Path]:
    """Write rendered files into out_dir, each atomically, plan.json last (its presence marks a complete set).

    Refuses, unless `force`, when out_dir holds a different plan.json, or (with no plan.json there) any
    file of the same name with other content: that is someone else's work. An identical plan.json means
    the same plan, whose files may be rewritten (e.g. by a newer planner's templates).
    """
    from planner.io import atomic_write_text

    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder. Pass a folder path (it is created if needed).")
    if not force:
        _check_overwrite(out_dir, files)
    order = sorted(name for name in files if name != PLAN_FILE) + ([PLAN_FILE] if PLAN_FILE in files else [])
    written = []
    for name in order:
        text, executable = files[name]
        try:
            atomic_write_text(out_dir / name, text, executable)
        except OSError as e:
            raise ConfigError(
                f"Cannot write {out_dir / name}: {e.strerror or e}. Check that --out is a writable folder."
            ) from e
        written.append(out_dir / name)
    return written


def _check_overwrite(out_dir: Path, files: Files) -> None:
    existing_plan = out_dir / PLAN_FILE
    if PLAN_FILE in files and existing_plan.exists():
        if _same_plan(_content(existing_plan), files[PLAN_FILE][0]):
            return
        raise ConfigError(
            f"{existing_plan} already holds a different plan. Pass --force to replace it (and its scripts), or "
            "choose another folder with --out."
        )
    clashes = sorted(
        name for name, (text, _) in files.items() if (out_dir / name).exists() and _content(out_dir / name) != text
    )
    if clashes:
        raise ConfigError(
            f"{out_dir} already holds {', '.join(clashes)} with other content. Pass --force to overwrite, or "
            "choose another folder with --out."
        )


def _same_plan(old: str | None, new: str) -> bool:
    """Equal plan documents, creation time (--timestamp) aside."""
    if old is None:
        return False
    if old == new:
        return True
    try:
        a, b = json.loads(old), json.loads(new)
    except json.JSONDecodeError:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    a.pop("created_at", None)
    b.pop("created_at", None)
    return a == b


def _content(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
