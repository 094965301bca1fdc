"""The layer order of DESIGN.md, read from the source with ast: every import (lazy ones included) goes
down the layers, planner's import graph has no cycle, and planner.runtime imports only the standard
library and torch (the generated script runs it where the planner is not installed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import modules of its own group or of a lower one.
LAYERS: list[tuple[str, ...]] = [
    (
        "planner", "planner.errors", "planner.escape", "planner.io", "planner.names", "planner.processes",
        "planner.runtime",
    ),
    ("planner.hardware",),
    ("planner.model",),
    ("planner.cost",),
    ("planner.measure",),
    ("planner.search",),
    ("planner.plan",),
    ("planner.pipeline",),
    ("planner.codegen", "planner.report", "planner.export"),
    ("planner.cli",),
]
RUNTIME_ALLOWED = {"torch", "numpy"}  # numpy: torch.distributed.pipelining needs it
# Libraries of a format the runtime reads when a run asks for it (weights.py: a Hugging Face checkpoint; data.py: a
# `datasets` folder, read through pyarrow), imported inside the functions that use them (tests/test_runtime_package.py
# checks that no module imports them at load).
RUNTIME_OPTIONAL = {"safetensors", "huggingface_hub", "datasets", "pyarrow"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, at the top or inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            # `from planner.cost import collectives` imports a submodule
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def project_modules() -> dict[str, Path]:
    files = list((ROOT / "planner").rglob("*.py"))
    return {module_name(f): f for f in files}


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matched prefix, layer)
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                if prefix == "planner" and module != "planner":
                    continue  # the package's __init__ only; every subpackage is listed
                best = (len(prefix), i)
    return None if best is None else best[1]


def internal_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items()}


def test_every_project_module_has_a_layer():
    missing = [m for m in project_modules() if layer_of(m) is None]
    assert not missing, f"add these modules to LAYERS (and to DESIGN.md): {missing}"


def test_imports_go_down_the_layers():
    wrong = []
    for mod, deps in sorted(internal_graph().items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(mod):
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports against the layer order: " + ", ".join(wrong)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    # A package's __init__ is imported with each of its modules; edges to it would be spurious cycles.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in internal_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_layer_rule_rejects_an_upward_import():
    assert layer_of("planner.cost.model") < layer_of("planner.search.ilp")
    assert layer_of("planner.runtime.layout") == layer_of("planner.errors")
    assert layer_of("planner.plan") < layer_of("planner.pipeline") < layer_of("planner.codegen.render")


def test_runtime_imports_only_stdlib_and_torch():
    wrong = []
    for mod, path in sorted(project_modules().items()):
        if not (mod == "planner.runtime" or mod.startswith("planner.runtime.")):
            continue
        for dep in sorted(imports_of(path)):
            top = dep.split(".")[0]
            allowed = RUNTIME_ALLOWED | RUNTIME_OPTIONAL
            if dep.startswith("planner.runtime") or top in sys.stdlib_module_names or top in allowed:
                continue
            if top == "__future__":
                continue
            wrong.append(f"{mod} -> {dep}")
    assert not wrong, "planner.runtime must import only the standard library and torch: " + ", ".join(wrong)


def test_cost_model_and_solver_never_import_torch_distributed():
    wrong = [
        f"{mod} -> {dep}"
        for mod, path in sorted(project_modules().items())
        if mod.startswith(("planner.cost", "planner.search"))
        for dep in sorted(imports_of(path))
        if dep.startswith("torch.distributed")
    ]
    assert not wrong, wrong


def test_schedule_names_are_defined_once():
    """planner.runtime.names is the one definition (a leaf importing only typing); planner.names re-exports
    it, the runtime's Layout validates against it and the CLI's options take its Literal types as choices."""
    leaf = ROOT / "planner" / "runtime" / "names.py"
    assert imports_of(leaf) <= {"__future__", "__future__.annotations", "typing", "typing.Literal", "typing.get_args"}

    from planner import names
    from planner.cli._options import Recompute, Schedule
    from planner.runtime import layout
    from planner.runtime import names as runtime_names

    assert names.SCHEDULES is runtime_names.SCHEDULES and names.Schedule is runtime_names.Schedule
    assert names.RECOMPUTE_MODES is runtime_names.RECOMPUTE_MODES and names.Recompute is runtime_names.Recompute
    assert layout.SCHEDULES is runtime_names.SCHEDULES and layout.RECOMPUTE_MODES is runtime_names.RECOMPUTE_MODES
    # The CLI's --schedule and --recompute choices are these Literal types themselves.
    assert Schedule is runtime_names.Schedule and Recompute is runtime_names.Recompute
    # No other module spells the list out.
    spelled = '"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"'
    copies = [m for m, p in project_modules().items() if spelled in p.read_text() and p != leaf]
    assert not copies, copies


def test_the_names_leaf_imports_without_torch():
    import subprocess

    code = "import sys, planner.names; sys.exit(1 if 'torch' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, "importing planner.names imported torch\n" + done.stderr
