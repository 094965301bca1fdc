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
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from planner.cli._options import (
    ForceOpt,
    InitFromOpt,
    PlanPathArg,
    QuietOpt,
    compiled_source_files,
    is_quiet,
    stdout_console,
)
from planner.codegen.modelcopy import copy_in_plan_folder
from planner.model.sources import SOURCE_FILE

if TYPE_CHECKING:
    from planner.io import OutputSet
    from planner.plan import Plan

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
    init_from: InitFromOpt = None,
) -> None:
    """Write train.py, launch.sh, launch_multinode.sh and slurm.sbatch for a saved plan.

    The plan is validated (schema version included) and rendered in full before anything is written; each
    file is written atomically. Files in --out that hold something else are kept unless --force is given.
    """
    from planner.codegen.render import render
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    if init_from is not None:
        from planner.codegen.check import with_init_from

        plan = with_init_from(plan, init_from)
    plan = model_beside(plan, plan_path)
    folder = plan_path if plan_path.is_dir() else plan_path.parent
    files: Files = dict(render(plan, PLAN_FILE, copy_in_plan_folder(folder)))  # the folder's copy, edits included
    files[PLAN_FILE] = (plan.to_json(), False)
    model = Path(plan.model.path)
    if model.name == SOURCE_FILE and model.is_file():  # a compiled source (hf: ...) travels with its config
        files.update(compiled_source_files("hf:", str(model)))
    result = write_outputs(out, files, force, inputs=[model, model.with_name("config.json")])
    if not is_quiet(ctx, quiet):
        console = stdout_console()
        # kept (edited) files are named in write_outputs' note, not listed as written
        written = sorted(result.written + result.unchanged)
        console.print(f"Wrote {len(written)} files to {out}:")
        for path in written:
            console.print(f"  {path}")


def model_beside(plan: Plan, plan_path: Path) -> Plan:
    """`plan` with its model file where the plan folder holds it, when the path plan.json names is not there
    (a plan folder moved to another machine): the copy in model/ (or the compiled model_source.py) beside it."""
    from planner.codegen.modelcopy import MODEL_DIR

    model = Path(plan.model.path)
    if model.is_file():
        return plan
    folder = plan_path if plan_path.is_dir() else plan_path.parent
    if model.name == SOURCE_FILE:
        candidates = [folder / SOURCE_FILE]
    else:
        candidates = [folder / MODEL_DIR / model.name, folder / MODEL_DIR / "model_file.py"]
    for candidate in candidates:
        if candidate.is_file():
            moved = plan.model.model_copy(update={"path": str(candidate.resolve())})
            return plan.model_copy(update={"model": moved})
    return plan


def write_outputs(out_dir: Path, files: Files, force: bool, inputs: list[Path] | None = None) -> OutputSet:
    """Write rendered files into out_dir as one unit (planner.io.write_output_set), under the folder's lock.

    Refused unless `force`: a different plan.json there (another plan's folder), or, with no plan.json
    there, files of the same names with other content (someone else's work). With the same plan.json,
    the files its last run wrote are rewritten (e.g. by a newer planner's templates) but a file edited
    since is kept and named in a note on stderr. Returns what happened to each file (written, unchanged, kept).
    `inputs`: the files the plan reads (model file, compiled source, its config, data files): an output that
    would replace one of them with other content is refused, with or without --force.
    """
    from planner.io import Classified, OutputConflictError, write_output_set

    new_plan = files.get(PLAN_FILE, ("", False))[0]

    def precheck(out: Path, c: Classified) -> None:
        refuse_overwriting_inputs(out, files, inputs or [])
        if force or PLAN_FILE not in files:
            return
        existing = out / PLAN_FILE
        if existing.is_file() and not _same_plan(_content(existing), new_plan):
            edited = [n for n in c.edited if n != PLAN_FILE]
            raise OutputConflictError(
                f"{existing} already holds a different plan"
                + (f", and {', '.join(edited)} {'was' if len(edited) == 1 else 'were'} edited since planner wrote "
                   f"{'it' if len(edited) == 1 else 'them'}" if edited else "")
                + ". Pass --force to replace it (and its scripts"
                + (", edits included" if edited else "")
                + "), or choose another folder with --out."
            )
        if not existing.is_file() and c.edited:
            raise OutputConflictError(
                f"{out} already holds {', '.join(c.edited)} with other content. Pass --force to overwrite, or "
                "choose another folder with --out."
            )

    result = write_output_set(
        out_dir, files, force, keep_edited=True, always=frozenset({PLAN_FILE}), precheck=precheck
    )
    if result.kept:
        root = out_dir.absolute()
        names = ", ".join(str(p.relative_to(root)) for p in result.kept)
        typer.echo(
            f"Note: kept {names} in {out_dir}: edited since planner wrote it, so it was not regenerated. Pass "
            "--force to replace it with the generated version.",
            err=True,
        )
    return result


def refuse_overwriting_inputs(out: Path, files: Files, inputs: list[Path]) -> None:
    """An output file that is one of the plan's inputs and would change is an error, --force or not: the
    planner never replaces the user's model (a model file named train.py planned into its own folder)."""
    from planner.io import OutputConflictError

    real = {}
    for path in inputs:
        try:
            real[os.path.realpath(path)] = path
        except (OSError, ValueError):
            continue
    for name, (text, _) in sorted(files.items()):
        target = os.path.realpath(out / name)
        if target not in real:
            continue
        try:
            if Path(target).read_bytes() == text.encode("utf-8"):
                continue  # the same bytes: nothing of the input changes
        except OSError:
            pass
        raise OutputConflictError(
            f"Writing {name} into {out} would overwrite {real[target]}, which this plan reads (its model file, "
            "model source, config or data). planner never replaces its own inputs, not even with --force. Write "
            "the plan into another folder with --out (or rename the model file)."
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
