"""Re-plan a training run for another cluster (a job that lost nodes, or got more) and continue it there.

Usage:
    planner replan --help

    # The run in plan_out lost a node: plan the same model for 3 nodes, resume from its newest checkpoint
    planner replan plan_out --nodes 3 --out plan_3n
    plan_3n/resume.sh

    # 4 local CPU processes -> 2
    planner replan plan_out --gpus-per-node 2 --out plan_2
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from planner.cli._options import ForceOpt, PlanPathArg, QuietOpt, is_quiet, stdout_console
from planner.cli.emit import PLAN_FILE, model_beside, write_outputs
from planner.codegen.modelcopy import copy_in_plan_folder

if TYPE_CHECKING:
    from planner.pipeline import PlanRequest
    from planner.plan import Plan

REPLAN_EXAMPLES = [
    "planner replan plan_out --nodes 3 --out plan_3n",
    "planner replan plan_out --gpus-per-node 2 --out plan_2",
]
RESUME_FILE = "resume.sh"


def replan(
    ctx: typer.Context,
    plan_path: PlanPathArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the new plan and its scripts.")],
    nodes: Annotated[
        int | None, typer.Option(min=1, help="Nodes of the new cluster (default: the plan's).", show_default=False)
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option(min=1, help="GPUs per node of the new cluster (default: the plan's).")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="GPU or cluster spec of the new cluster (default: the plan's).", show_default=False),
    ] = None,
    checkpoints: Annotated[
        Path | None,
        typer.Option(
            help="Where the old run's checkpoints are (default: checkpoints/ in the plan's folder).",
            show_default=False,
        ),
    ] = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Plan the same model, batch and training settings for a new cluster, and write resume.sh, which continues
    the old run from its newest complete checkpoint under the new layout (checkpoints reshard on load).

    The degrees are searched again (the old plan's are not pinned): the best layout for the new cluster is
    chosen. The global batch and micro-batch size stay the same, so the resumed run sees the batches the old one
    would have seen.
    """
    from planner.cli.plan import best_that_runs, render_outputs, run_search
    from planner.codegen.render import resume_script
    from planner.errors import PlanError
    from planner.plan import load_plan

    old_dir = plan_path if plan_path.is_dir() else plan_path.parent
    old = model_beside(load_plan(plan_path), plan_path)  # on the cluster: the copy in the plan folder
    request = replan_request(old, old_dir, nodes, gpus_per_node, gpu)
    new_plan, graph, result = run_search(request, show_progress=not is_quiet(ctx, quiet))
    new_plan, result = best_that_runs(request, new_plan, graph, result)
    files = dict(render_outputs(new_plan, result, model=copy_in_plan_folder(old_dir)))
    source_names = ("model_source.py", "config.json") if old.source_spec else ()
    for name in source_names:  # a compiled source (hf:NAME) travels with the plan: copy it into the new folder
        if (old_dir / name).is_file():
            files[name] = ((old_dir / name).read_text(encoding="utf-8"), False)
    where = (checkpoints if checkpoints is not None else old_dir / "checkpoints").absolute()
    if out.absolute() == old_dir.absolute():
        raise PlanError(
            f"--out {out} is the old plan's folder: the new plan goes into a folder of its own, so the old run's "
            "scripts stay as they were. Pass another --out."
        )
    relative = os.path.relpath(where, out.absolute())
    files[RESUME_FILE] = (resume_script(new_plan, relative, old_dir.name), True)
    # the model file (and a compiled source's files) the new plan reads are never replaced, even with --force
    inputs = [Path(old.model.path), *(old_dir / name for name in source_names)]
    write_outputs(out, files, force, inputs=inputs)
    if not is_quiet(ctx, quiet):
        from planner.runtime.checkpoint import latest

        console = stdout_console()
        p = new_plan.parallel
        console.print(
            f"Re-planned for {new_plan.cluster.nodes} x {new_plan.cluster.gpus_per_node} {new_plan.cluster.gpu}: "
            f"pp {p.pp} x dp {p.dp} x tp {p.tp} (was pp {old.parallel.pp} x dp {old.parallel.dp} x tp "
            f"{old.parallel.tp}). Wrote {out / PLAN_FILE} and the scripts."
        )
        found = latest(where)
        if found.path is not None:
            console.print(f"Run {out / RESUME_FILE} to continue from {found.path}.")
        else:
            console.print(f"No complete checkpoint under {where} yet; {out / RESUME_FILE} takes the newest at start.")
        if found.skipped_message():
            console.print(f"({found.skipped_message()})")


def replan_request(
    old: Plan, old_dir: Path, nodes: int | None, gpus_per_node: int | None, gpu: str | None
) -> PlanRequest:
    """The old plan's request (model, batch, dtype, training settings) for the new cluster, nothing pinned."""
    from planner.pipeline import PlanRequest

    m = old.model
    path = Path(m.path)
    if not path.is_absolute():
        path = old_dir / path
    if old.source_spec and (old_dir / "model_source.py").is_file():
        path = old_dir / "model_source.py"  # the compiled source that travels with the plan
    return PlanRequest(
        model_path=str(path), model_args=dict(m.model_args), build_fn=m.build_fn, inputs_fn=m.inputs_fn,
        loss_fn=m.loss_fn, batch_fn=m.batch_fn, dtype=old.training.dtype,
        gpu=gpu if gpu is not None else _spec_of(old),
        nodes=nodes if nodes is not None else old.cluster.nodes,
        gpus_per_node=gpus_per_node if gpus_per_node is not None else old.cluster.gpus_per_node,
        global_batch_size=old.parallel.global_batch_size, seed=old.training.seed, lr=old.training.lr,
        steps=old.training.steps,
        # The model file's batches are drawn per micro-batch: the same size keeps the samples the run would see.
        pins={"micro_batch_size": old.parallel.micro_batch_size},
    )


def _spec_of(old: Plan) -> str:
    """The spec the old plan was made for: its cluster's name where that is a known spec or preset, else its
    GPU's (a cluster described inline keeps only the GPU's name)."""
    from planner.errors import PlannerError
    from planner.hardware.load import load_spec

    try:
        load_spec(old.cluster.name)
    except PlannerError:
        return old.cluster.gpu
    return old.cluster.name
