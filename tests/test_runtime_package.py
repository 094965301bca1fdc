"""The runtime package stands alone: it imports only the standard library and torch, and a copy of it runs
under another name (planner_runtime/, next to a generated train.py) without the planner installed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from planner.runtime.digest import digest_of, package_digest, runtime_files

RUNTIME = Path(__file__).resolve().parents[1] / "planner" / "runtime"


def test_imports_only_the_standard_library_and_torch():
    """At load, only the standard library and torch; a format's library (safetensors, huggingface_hub, datasets) only
    inside the function that reads that format, so a run that does not ask for it never needs it."""
    allowed = set(sys.stdlib_module_names) | {"torch"}
    for name, text in runtime_files(RUNTIME).items():
        tree = ast.parse(text)
        lazy = {
            id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: within the package
                    continue
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            optional = {"safetensors", "huggingface_hub", "datasets", "pyarrow"} if id(node) in lazy else set()
            assert set(roots) <= allowed | optional, (name, roots)


def test_a_copy_imports_without_the_planner(tmp_path):
    copy = tmp_path / "planner_runtime"
    copy.mkdir()
    for name, text in runtime_files(RUNTIME).items():
        (copy / name).write_text(text)
    code = (
        "import sys\n"
        "sys.modules['planner'] = None  # any import of the planner fails\n"
        "import planner_runtime.loop, planner_runtime.parallel\n"
        "from planner_runtime import Layout\n"
        "print(Layout(pp=1, dp=1, tp=1, micro_batch_size=1, num_micro_batches=1, stages=[(0, ['m'])]).world_size)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert package_digest(copy) == digest_of(runtime_files(RUNTIME))


def test_the_digest_sees_names_and_contents():
    base = digest_of({"a.py": "x = 1\n", "b.py": ""})
    assert digest_of({"b.py": "", "a.py": "x = 1\n"}) == base  # order-free
    assert digest_of({"a.py": "x = 2\n", "b.py": ""}) != base
    assert digest_of({"c.py": "x = 1\n", "b.py": ""}) != base
    assert digest_of({"a.py": "x = 1\n"}) != base
