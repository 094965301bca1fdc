"""Rendering a Plan into a torchrun training script and its launchers (jinja2 templates in templates/).

The generated train.py carries the plan's numbers as Python constants at its top and an identical body for
every plan; the launchers wrap torchrun for one node, several nodes and SLURM. Rendering is a pure function
of the plan (no timestamps, sorted mappings), so equal plans give byte-identical files.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any

import jinja2

from planner.errors import PlanError
from planner.io import write_output_set
from planner.plan import Plan

LINE_LENGTH = 110  # the project's ruff line length; generated code stays within it

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)

# file name -> (template, executable)
_OUTPUTS = {
    "train.py": ("train.py.j2", True),
    "launch.sh": ("launch.sh.j2", True),
    "launch_multinode.sh": ("launch_multinode.sh.j2", True),
    "slurm.sbatch": ("slurm.sbatch.j2", True),
}


def py_literal(value: Any, indent: int = 0, width: int = LINE_LENGTH) -> str:
    """`value` (JSON-like data) as Python source: one line if it fits after `indent` columns, else one
    element per line with trailing commas (the layout ruff format would choose)."""
    flat = _flat(value)
    if indent + len(flat) <= width or not isinstance(value, (list, tuple, dict)) or not value:
        return flat
    pad = " " * (indent + 4)
    if isinstance(value, dict):
        items = [f"{_flat(k)}: {py_literal(v, indent + 4 + len(_flat(k)) + 2, width)}" for k, v in value.items()]
        open_, close = "{", "}"
    else:
        items = [py_literal(v, indent + 4, width) for v in value]
        open_, close = ("(", ")") if isinstance(value, tuple) else ("[", "]")
    body = "".join(f"{pad}{item},\n" for item in items)
    return f"{open_}\n{body}{' ' * indent}{close}"


def _flat(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return f'float("{value}")'
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string literal is a valid Python one, in double quotes
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flat(k)}: {_flat(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        inner = ", ".join(_flat(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_flat(v) for v in value) + "]"
    raise PlanError(
        f"Cannot write {value!r} ({type(value).__name__}) into the training script: model arguments must be "
        "Python literals (numbers, strings, booleans, None, lists, dicts). Re-plan with literal --model-arg values."
    )


def _text(value: str) -> str:
    """`value` safe inside a docstring or a shell comment: printable, no quotes or backslashes."""
    return "".join(ch if ch.isprintable() and ch not in "\"'`\\$" else "_" for ch in value)


def _schedule_note(plan: Plan) -> str:
    p = plan.parallel
    if p.pp == 1:
        return f"no pipeline, {p.num_micro_batches} micro-batch(es) accumulated"
    return f"{p.schedule} over {p.num_stages} stages"


def _constants(plan: Plan) -> dict[str, str]:
    """The plan's numbers as Python source, keyed by constant name (indent: after `NAME = `)."""
    p, m, t = plan.parallel, plan.model, plan.training
    stages = [(s.pp_rank, list(s.modules), s.recompute) for s in sorted(plan.stages, key=lambda s: s.index)]
    values: dict[str, Any] = {
        "MODEL_FILE": m.path,
        "BUILD_FN": m.build_fn,
        "INPUTS_FN": m.inputs_fn,
        "LOSS_FN": m.loss_fn,
        "BATCH_FN": m.batch_fn,
        "MODEL_ARGS": dict(sorted(m.model_args.items())),
        "PP": p.pp,
        "DP": p.dp,
        "TP": p.tp,
        "VIRTUAL_STAGES": p.virtual_stages,
        "MESH_DIMS": tuple(p.mesh_dims),
        "MICRO_BATCH_SIZE": p.micro_batch_size,
        "NUM_MICRO_BATCHES": p.num_micro_batches,
        "GLOBAL_BATCH_SIZE": p.global_batch_size,
        "SCHEDULE": p.schedule,
        "ZERO_STAGE": p.zero_stage,
        "SEQUENCE_PARALLEL": p.sequence_parallel,
        "STAGES": stages,
        "TP_PLAN": dict(sorted(plan.tp_plan.items(), key=lambda kv: _natural_key(kv[0]))),
        "SEED": t.seed,
        "LR": float(t.lr),
        "STEPS": t.steps,
        "DTYPE": t.dtype,
    }
    return {name: py_literal(value, indent=len(name) + 3) for name, value in values.items()}


def _natural_key(name: str) -> list[Any]:
    """blocks.2 before blocks.10."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _check(plan: Plan) -> None:
    p = plan.parallel
    if sorted(p.mesh_dims) != ["dp", "pp", "tp"]:
        raise PlanError(f"mesh_dims must order 'pp', 'dp' and 'tp', got {p.mesh_dims}. Regenerate the plan.")
    indices = sorted(s.index for s in plan.stages)
    if indices != list(range(len(plan.stages))):
        raise PlanError(f"Stage indices must be 0..{len(plan.stages) - 1}, got {indices}. Regenerate the plan.")
    for s in plan.stages:
        if not 0 <= s.pp_rank < p.pp:
            raise PlanError(f"Stage {s.index} is on pp rank {s.pp_rank}, outside 0..{p.pp - 1}. Regenerate the plan.")
        if not s.modules:
            raise PlanError(f"Stage {s.index} owns no modules. Regenerate the plan.")
    if p.pp == 1 and p.virtual_stages != 1:
        raise PlanError("A plan without pipeline (pp=1) must have virtual_stages=1. Regenerate the plan.")


def render(plan: Plan, plan_path_in_dir: str = "plan.json") -> dict[str, tuple[str, bool]]:
    """Render train.py and the launchers for `plan`: {file name: (text, executable)}.

    `plan_path_in_dir` is the plan file's name as the scripts refer to it (next to them).
    """
    _check(plan)
    p, cluster = plan.parallel, plan.cluster
    cpu = cluster.gpu.lower() == "cpu"
    world = p.world_size
    gpus_per_node = max(1, cluster.gpus_per_node)
    if cpu:
        nodes, per_node = 1, world  # CPU plans run as processes on one machine
    else:
        per_node = min(world, gpus_per_node)
        nodes = world // per_node
        if world % per_node or nodes > cluster.nodes:
            raise PlanError(
                f"The plan's {world} ranks do not fill {cluster.nodes} node(s) of {gpus_per_node} GPUs evenly. "
                "Regenerate the plan for this cluster."
            )
    title = (
        f"Train {_text(plan.model_class)} on {world} process{'es' if world != 1 else ''}: "
        f"pp {p.pp} x dp {p.dp} x tp {p.tp} ({_schedule_note(plan)})."
    )
    origin = f"Generated by planner {_text(plan.planner_version)} from {_text(plan_path_in_dir)}."
    context = {
        "c": _constants(plan),
        "title": "\n".join(textwrap.wrap(title, LINE_LENGTH - 3)),
        "origin": "\n".join(textwrap.wrap(origin, LINE_LENGTH - 40)),
        "plan_name": _text(plan_path_in_dir),
        "world": world,
        "pp": p.pp,
        "dp": p.dp,
        "tp": p.tp,
        "cpu": cpu,
        "nodes": nodes,
        "per_node": per_node,
        "device_flag": "--device cpu" if cpu else "--device cuda",
        "job_name": re.sub(r"[^A-Za-z0-9_.-]", "_", f"planner-{plan.model_class}")[:64],
    }
    out: dict[str, tuple[str, bool]] = {}
    for name, (template, executable) in _OUTPUTS.items():
        out[name] = (_env.get_template(template).render(**context), executable)
    return out


def write_scripts(plan: Plan, out_dir: str | Path, plan_path_in_dir: str = "plan.json") -> list[Path]:
    """Render and write the scripts into `out_dir` (each atomically); returns the paths written."""
    files = render(plan, plan_path_in_dir)  # render everything before writing anything
    out = Path(out_dir)
    write_output_set(out, files, force=True)  # one unit, under the folder's lock
    return [out / name for name in files]
