"""Rendering a Plan into a torchrun training script and its launchers (jinja2 templates in templates/).

The generated train.py carries the plan's numbers as Python constants at its top and calls the runtime
package (planner/runtime), which is copied beside it as planner_runtime/ so that the plan directory runs
where the planner is not installed; train.py records the copy's digest and checks it at start. The
launchers wrap torchrun for one node, several nodes and SLURM. Rendering is a pure function of the plan (no
timestamps, sorted mappings), so equal plans give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jinja2

from planner.codegen.modelcopy import copied_model
from planner.errors import PlanError
from planner.escape import py_text
from planner.io import write_output_set
from planner.model.graph import ModelSource
from planner.names import SCHEDULES
from planner.plan import Plan
from planner.runtime.digest import digest_of, runtime_files
from planner.runtime.errors import LayoutError
from planner.runtime.layout import Layout, ModelFile, Stage, Training, expand_names

# The project's one line length: [tool.ruff] line-length in pyproject.toml says the same (tests/test_codegen.py
# checks that they agree), and generated code stays within it.
LINE_LENGTH = 120

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)

RUNTIME_DIR = "planner_runtime"  # where the runtime package is copied, next to train.py
LAYOUT_FILE = "layout.json"  # the plan's module lists, next to train.py, when too long for its constants
TRAIN_PY_LINES = 139  # train.py stays under 140 lines: a person reads it whole

# file name -> (template, executable)
_OUTPUTS = {
    "train.py": ("train.py.j2", True),
    "launch.sh": ("launch.sh.j2", True),
    "launch_multinode.sh": ("launch_multinode.sh.j2", True),
    "slurm.sbatch": ("slurm.sbatch.j2", True),
}


def py_literal(value: Any, indent: int = 0, width: int = LINE_LENGTH, base: int = 0) -> str:
    """`value` (JSON-like data) as Python source starting at column `indent` of a line indented `base`: one
    line if it fits, else one element per line indented 4 past `base` with trailing commas (the layout ruff
    format would choose), or, for a list or mapping of names and numbers, as many elements per line as fit."""
    flat = _flat(value)
    if indent + len(flat) <= width or not isinstance(value, (list, tuple, dict)) or not value:
        return flat
    inner = base + 4
    pad = " " * inner
    if isinstance(value, dict):
        items = [
            f"{_flat(k)}: {py_literal(v, inner + len(_flat(k)) + 2, width, inner)}" for k, v in value.items()
        ]
        open_, close = "{", "}"
        scalars = all(not isinstance(v, (list, tuple, dict)) for v in value.values())
    else:
        items = [py_literal(v, inner, width, inner) for v in value]
        open_, close = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        scalars = all(not isinstance(v, (list, tuple, dict)) for v in value)
    if scalars:  # names and numbers: as many per line as fit, so long module lists stay a few lines
        return f"{open_}\n{_filled(items, pad, width)}{' ' * base}{close}"
    body = "".join(f"{pad}{item},\n" for item in items)
    return f"{open_}\n{body}{' ' * base}{close}"


def _filled(items: list[str], pad: str, width: int) -> str:
    """`items` as lines of `pad` + comma-separated items, each line within `width` where the items allow."""
    lines: list[str] = []
    line = ""
    for item in items:
        if line and len(pad) + len(line) + 1 + len(item) + 1 > width:
            lines.append(line)
            line = ""
        line = f"{line} {item}," if line else f"{item},"
    lines.append(line)
    return "".join(f"{pad}{line}\n" for line in lines)


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
    """`value` safe inside a docstring or a shell comment (planner.escape.py_text)."""
    return py_text(value)


def _schedule_note(plan: Plan) -> str:
    p = plan.parallel
    if p.pp == 1:
        return f"no pipeline, {p.num_micro_batches} micro-batch(es) accumulated"
    return f"{p.schedule} over {p.num_stages} stages"


def _layout_lists(plan: Plan) -> dict[str, Any]:
    """STAGES, TP_PLAN and TP_HEAD_ATTRS as train.py (or its layout.json) holds them: runs of numbered names
    compressed to "blocks.{0-5}", which the runtime's expand_names reads back."""
    return {
        # a stage with blocks recomputed fully (Megatron-LM's block method) names their modules fourth
        "STAGES": [
            (s.pp_rank, compress_names(list(s.modules)), s.recompute)
            + ((compress_names(list(s.recompute_full_modules)),) if s.recompute_full_modules else ())
            for s in sorted(plan.stages, key=lambda s: s.index)
        ],
        "TP_PLAN": compress_mapping(dict(plan.tp.styles)),
        "TP_HEAD_ATTRS": compress_mapping({k: list(v) for k, v in plan.tp.head_attrs.items()}),
    }


def layout_file_text(plan: Plan) -> str:
    """layout.json: the module lists of a plan too long for train.py's constants (stages in pipeline order)."""
    lists = _layout_lists(plan)
    data = {"stages": lists["STAGES"], "tp_plan": lists["TP_PLAN"], "tp_head_attrs": lists["TP_HEAD_ATTRS"]}
    return json.dumps(data, indent=1) + "\n"  # key order as written: stages in pipeline order, names natural


def _constants(plan: Plan, layout_digest: str | None = None, model_path: str | None = None) -> dict[str, str]:
    """The plan's numbers as Python source, keyed by constant name (indent: after `NAME = `). With
    `layout_digest`, the module lists are in layout.json (of that sha256) instead."""
    p, m, t = plan.parallel, plan.model, plan.training
    lists = _layout_lists(plan)
    values: dict[str, Any] = {
        "MODEL_FILE": m.path if model_path is None else model_path,
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
        **lists,
        "LAYOUT_FILE": None if layout_digest is None else LAYOUT_FILE,
        "LAYOUT_DIGEST": layout_digest,
        "EP": p.ep,
        "CP": p.cp,
        "ASYNC_TP": p.tp_overlap,
        "EXPERTS": compress_mapping(dict(plan.experts)),
        "TP_FUSED": compress_mapping(dict(plan.tp.fused)),
        "TP_TRANSPOSED": compress_names(list(plan.tp.transposed)),
        "TP_COPIED": compress_names(list(plan.tp.copied)),
        "TP_SUMMED": compress_names(list(plan.tp.summed)),
        "SEED": t.seed,
        "LR": float(t.lr),
        "STEPS": t.steps,
        "DTYPE": t.dtype,
        "INIT_FROM": t.init_from,
        **_optimizer_constants(),
        "PREDICTED": {
            "step_time_s": float(f"{plan.predicted.iteration_time_s:.4g}"),
            "mfu": float(f"{plan.predicted.mfu:.4g}"),
            "peak_memory_bytes": plan.predicted.peak_memory_bytes,
        },
        "RUNTIME_DIGEST": digest_of(runtime_files()),
    }
    return {name: py_literal(value, indent=len(name) + 3) for name, value in values.items()}


def _optimizer_constants() -> dict[str, Any]:
    """The optimizer, schedule and checkpoint knobs train.py starts with: the runtime's defaults (torchtitan's
    AdamW set-up), for people to edit there."""
    d = Training()
    return {
        "WEIGHT_DECAY": d.weight_decay, "BETAS": tuple(d.betas), "EPS": d.eps, "WARMUP_STEPS": d.warmup_steps,
        "LR_DECAY": d.lr_decay, "MIN_LR_RATIO": d.min_lr_ratio, "GRAD_CLIP": d.grad_clip,
        "CHECKPOINT_EVERY": d.checkpoint_every, "DATA_FILE": d.data_file, "DATA_DTYPE": d.data_dtype,
    }


def runtime_objects(plan: Plan) -> tuple[Layout, ModelFile, Training]:
    """The runtime's validated objects for `plan`: what train.py builds from its constants (the plan-time
    check and the tests use them to call the runtime in-process). Raises LayoutError on a broken plan."""
    p, m, t = plan.parallel, plan.model, plan.training
    layout = Layout(
        pp=p.pp, dp=p.dp, tp=p.tp, virtual_stages=p.virtual_stages, mesh_dims=tuple(p.mesh_dims),
        micro_batch_size=p.micro_batch_size, num_micro_batches=p.num_micro_batches,
        global_batch_size=p.global_batch_size, schedule=p.schedule, zero_stage=p.zero_stage,
        sequence_parallel=p.sequence_parallel,
        stages=tuple(
            Stage(s.pp_rank, tuple(s.modules), s.recompute, tuple(s.recompute_full_modules))
            for s in sorted(plan.stages, key=lambda s: s.index)
        ),
        tp_plan=plan.tp, ep=p.ep, experts=dict(plan.experts), cp=p.cp, async_tp=p.tp_overlap,
    )
    return layout, model_file(m), Training(seed=t.seed, lr=float(t.lr), steps=t.steps, dtype=t.dtype)


def model_file(m: ModelSource) -> ModelFile:
    """The runtime's ModelFile for a plan's model (what train.py's MODEL_FILE and function names say)."""
    return ModelFile(m.path, m.build_fn, m.inputs_fn, m.loss_fn, m.batch_fn, dict(m.model_args))


def compress_names(names: list[str]) -> list[str]:
    """Runs of 3+ consecutive names that differ only in one increasing number, as "blocks.{0-5}" (what
    planner.runtime.layout.expand_names reads back), so train.py stays short for deep models."""
    out: list[str] = []
    i = 0
    while i < len(names):
        k = _differing_part(names[i], names[i + 1]) if i + 1 < len(names) else None
        j = i
        while k is not None and j + 1 < len(names) and _differing_part(names[j], names[j + 1]) == k:
            j += 1
        if k is not None and j - i >= 2:
            parts = names[i].split(".")
            parts[k] = f"{{{parts[k]}-{names[j].split('.')[k]}}}"
            out.append(".".join(parts))
            i = j + 1
        else:
            out.append(names[i])
            i += 1
    return out


def _differing_part(a: str, b: str) -> int | None:
    """The one dotted component where a and b differ, both numbers with b's = a's + 1; else None."""
    pa, pb = a.split("."), b.split(".")
    if len(pa) != len(pb):
        return None
    diff = [k for k, (x, y) in enumerate(zip(pa, pb, strict=True)) if x != y]
    if len(diff) != 1 or not (pa[diff[0]].isdigit() and pb[diff[0]].isdigit()):
        return None
    return diff[0] if int(pb[diff[0]]) == int(pa[diff[0]]) + 1 and str(int(pb[diff[0]])) == pb[diff[0]] else None


def compress_mapping(mapping: dict[str, Any]) -> dict[str, Any]:
    """{name: value} with names that differ only in their first number and share a value over a contiguous
    range of 3+ numbers merged into one "prefix.{lo-hi}.suffix" key; sorted naturally."""
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for name in mapping:
        parts = name.split(".")
        k = next((i for i, p in enumerate(parts) if p.isdigit() and str(int(p)) == p), None)
        if k is not None:
            key = (".".join(parts[:k]), ".".join(parts[k + 1 :]))
            groups.setdefault(key, []).append((int(parts[k]), name))
    out: dict[str, Any] = {}
    merged: set[str] = set()
    for (head, tail), members in groups.items():
        members.sort()
        numbers = [n for n, _ in members]
        values = {json.dumps(mapping[name], sort_keys=True) for _, name in members}
        if len(members) >= 3 and len(values) == 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
            pattern = ".".join(p for p in (head, f"{{{numbers[0]}-{numbers[-1]}}}", tail) if p)
            out[pattern] = mapping[members[0][1]]
            merged.update(name for _, name in members)
    out.update({name: value for name, value in mapping.items() if name not in merged})
    return dict(sorted(out.items(), key=lambda kv: _natural_key(expand_names(kv[0])[0])))


def _natural_key(name: str) -> list[Any]:
    """blocks.2 before blocks.10."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _check(plan: Plan) -> None:
    p = plan.parallel
    if sorted(p.mesh_dims) != sorted(["dp", "pp", "tp"] + (["cp"] if p.cp > 1 else [])):
        raise PlanError(
            f"mesh_dims must order 'pp', 'dp'{', cp' if p.cp > 1 else ''} and 'tp', got {p.mesh_dims}. Regenerate the "
            "plan."
        )
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


def render(
    plan: Plan, plan_path_in_dir: str = "plan.json", model: tuple[str, dict[str, tuple[str, bool]]] | None = None
) -> dict[str, tuple[str, bool]]:
    """Render train.py, the launchers and the runtime copy for `plan`: {relative path: (text, executable)}
    (the runtime's files are under planner_runtime/).

    `plan_path_in_dir` is the plan file's name as the scripts refer to it (next to them). `model`: MODEL_FILE
    and the model's copied files (planner.codegen.modelcopy), when the caller knows more than the model file's
    imports (what it read while planned, or a plan folder's copy); by default copied_model(plan.model.path).
    """
    _check(plan)
    try:
        runtime_objects(plan)  # the rules the script's Layout checks at start, checked here first
    except LayoutError as e:
        raise PlanError(str(e)) from None
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
        f"pp {p.pp} x dp {p.dp}{f' x cp {p.cp}' if p.cp > 1 else ''} x tp {p.tp}{f' (ep {p.ep})' if p.ep > 1 else ''} "
        f"({_schedule_note(plan)})."
    )
    origin = f"Generated by planner {_text(plan.planner_version)} from {_text(plan_path_in_dir)}."
    model_path, model_files = copied_model(plan.model.path) if model is None else model
    context = {
        "c": _constants(plan, model_path=model_path),
        "layout_file": False,
        "block_recompute": any(s.recompute_full_modules for s in plan.stages),
        "title": "\n".join(textwrap.wrap(title, LINE_LENGTH - 3)),
        "origin": "\n".join(textwrap.wrap(origin, LINE_LENGTH - 40)),
        "plan_name": _text(plan_path_in_dir),
        "world": world,
        "pp": p.pp,
        "dp": p.dp,
        "tp": p.tp,
        "ep": p.ep,
        "cp": p.cp,
        "cpu": cpu,
        "nodes": nodes,
        "per_node": per_node,
        "device_flag": "--device cpu" if cpu else "--device cuda",
        "schedules": " | ".join(SCHEDULES),
        "job_name": re.sub(r"[^A-Za-z0-9_.-]", "_", f"planner-{plan.model_class}")[:64],
    }
    out: dict[str, tuple[str, bool]] = {}
    for name, (template, executable) in _OUTPUTS.items():
        out[name] = (_env.get_template(template).render(**context), executable)
    if len(out["train.py"][0].splitlines()) > TRAIN_PY_LINES:
        # Module lists too long to read as constants (e.g. hundreds of unnumbered modules): into layout.json.
        text = layout_file_text(plan)
        digest = hashlib.sha256(text.encode()).hexdigest()
        context |= {"c": _constants(plan, digest, model_path), "layout_file": True}
        out["train.py"] = (_env.get_template("train.py.j2").render(**context), True)
        out[LAYOUT_FILE] = (text, False)
    for name, text in runtime_files().items():
        out[f"{RUNTIME_DIR}/{name}"] = (text, False)
    out.update(model_files)
    return out


def resume_script(plan: Plan, checkpoints: str, old_name: str) -> str:
    """resume.sh of a re-planned folder: launch.sh with --resume `checkpoints` (the old run's checkpoint
    folder, relative to the new folder so that both can move together)."""
    import shlex

    p = plan.parallel
    return _env.get_template("resume.sh.j2").render(
        old_name=_text(old_name), checkpoints=shlex.quote(checkpoints), pp=p.pp, dp=p.dp, tp=p.tp, world=p.world_size
    )


def write_scripts(
    plan: Plan, out_dir: str | Path, plan_path_in_dir: str = "plan.json", reads: Iterable[str] = ()
) -> list[Path]:
    """Render and write the scripts and the runtime copy into `out_dir` (each file atomically); returns the
    paths written. `reads`: files the model read while planned, copied with it."""
    model = copied_model(plan.model.path, reads) if reads else None
    files = render(plan, plan_path_in_dir, model)  # render everything before writing anything
    out = Path(out_dir)
    write_output_set(out, files, force=True)  # one unit, under the folder's lock
    return [out / name for name in files]
