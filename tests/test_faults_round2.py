"""Hostile input, round two (issue 28): no injected code, no lost input, no stale answer, no hang, and each
user mistake one paragraph with exit 2. Most cases are in-process CLI calls on a two-Linear model."""

from __future__ import annotations

import ast
import json
import os
import runpy
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch  # noqa: F401 - see tests/test_cli.py: torch's log handlers bind to the real stderr
import yaml
from e2e.plans import make_plan
from typer.testing import CliRunner

from planner.cli._options import parse_model_args
from planner.cli.main import app
from planner.codegen.render import render, write_scripts
from planner.errors import ConfigError, SpecError
from planner.escape import py_str, py_text, shell_word
from planner.hardware.load import list_specs, load_cluster, specs_dir

ROOT = Path(__file__).resolve().parents[1]
HF_CONFIG = ROOT / "tests" / "fixtures" / "models" / "hf_llama_config"
CLUSTER = ["--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "4"]
runner = CliRunner()

NET = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 8),)
"""

# Quotes of every kind, a docstring end, newlines, shell substitutions: each would run `touch PWNED` if pasted.
HOSTILE = [
    'x/a"""\nimport os; os.system("touch PWNED")\n"""',
    "x/a'''\nimport os; os.system('touch PWNED')\n'''",
    "x/$(touch PWNED)`touch PWNED`",
    'x/a\\"; __import__("os").system("touch PWNED"); "',
    "x/a\r\n# \\\nimport os; os.system('touch PWNED')",
]


def user_error(result, *needles: str) -> str:
    """The one-paragraph message of an exit-2 result (asserting there is no traceback)."""
    assert result.exit_code == 2, f"{result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    message = result.stderr[result.stderr.rfind("Error: "):]
    for needle in needles:
        assert needle in message, message
    return message


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --- 1. code injection ------------------------------------------------------------------------------------


def test_escaping_functions_round_trip():
    for s in HOSTILE + ["plain", "", "ünïcode ✓"]:
        assert ast.literal_eval(py_str(s)) == s
        assert not set(py_text(s)) & set("\"'`\\$\n\r")
        out = subprocess.run(["bash", "-c", f"printf %s {shell_word(s)}"], capture_output=True, check=True)
        assert out.stdout == s.encode()


@pytest.mark.parametrize("name", HOSTILE)
def test_hf_source_name_is_a_literal(tmp_path, monkeypatch, name):
    """An hf: name with quotes, newlines and $() gives a model_source.py that parses, holds the name as data
    and runs nothing of it when imported."""
    from planner.model.sources import compile_source

    monkeypatch.chdir(tmp_path)
    path = compile_source(f"hf:{name}", tmp_path / "src", hf_config=HF_CONFIG, seq=32)
    tree = ast.parse(path.read_text())
    assigned = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "SOURCE"}
    assert assigned == {"SOURCE": f"hf:{name}"}
    runpy.run_path(str(path))
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("name", HOSTILE[:3])
def test_factory_source_names_are_literals(tmp_path, monkeypatch, name):
    import importlib.util

    from planner.model import sources

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda *_: object())  # any module name "exists"
    path = sources._compile_factory(f"module:{name}:build", tmp_path)
    text = path.read_text()
    tree = ast.parse(text)
    calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert calls == [f"importlib.import_module({name!r})", "getattr(_mod, 'build')",
                     "getattr(_mod, 'example_inputs')", "hasattr(_mod, 'loss_fn')"]


def test_every_plan_field_reaching_train_py_and_launchers_is_escaped(tmp_path):
    """Model path, function names, class name and model args with quotes, newlines and $(): train.py keeps
    each as the same value, the launchers are valid shell that never expand them."""
    plan = make_plan("gpt")
    hostile = HOSTILE[0] + HOSTILE[2]
    hostile_file = tmp_path / f"m{HOSTILE[2]}.py"
    hostile_file.parent.mkdir(parents=True)
    hostile_file.write_bytes(Path(plan.model.path).read_bytes())
    model = plan.model.model_copy(update={
        "path": str(tmp_path / f"m{HOSTILE[2]}.py"), "build_fn": hostile, "inputs_fn": hostile,
        "loss_fn": hostile, "batch_fn": hostile, "model_args": {**plan.model.model_args, "tag": hostile},
    })
    plan = plan.model_copy(update={"model": model, "model_class": hostile})
    write_scripts(plan, tmp_path / "out")
    train = (tmp_path / "out" / "train.py").read_text()
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(train).body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
              and n.targets[0].id in ("MODEL_FILE", "BUILD_FN", "MODEL_ARGS")}
    assert consts["MODEL_FILE"] == "model/model_file.py" and consts["BUILD_FN"] == hostile
    assert consts["MODEL_ARGS"]["tag"] == hostile
    for name in ("launch.sh", "launch_multinode.sh", "slurm.sbatch"):
        text = (tmp_path / "out" / name).read_text()
        subprocess.run(["bash", "-n", str(tmp_path / "out" / name)], check=True)
        assert "touch PWNED" not in text


def test_plan_of_a_hostile_hf_name_runs_nothing(tmp_path, monkeypatch):
    """The issue's reproduction, end to end: exit 0, nothing executed, the name kept as data."""
    monkeypatch.chdir(tmp_path)
    name = f"hf:{HOSTILE[0]}"
    result = runner.invoke(app, ["dry-run", name, "--hf-config", str(HF_CONFIG), "-a", "seq=32", "--dp", "2",
                                 *CLUSTER, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["source_spec"] == name
    assert not (tmp_path / "PWNED").exists()


# --- 2. the plan's inputs are never overwritten -----------------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
def test_a_model_named_train_py_is_never_replaced(tmp_path, force):
    model = write(tmp_path / "train.py", NET)
    before = model.read_bytes()
    result = runner.invoke(app, ["plan", str(model), *CLUSTER, "--out", str(tmp_path), "-q",
                                 *(["--force"] if force else [])])
    user_error(result, "train.py", "never replaces", "--out")
    assert model.read_bytes() == before
    assert not (tmp_path / "plan.json").exists()


def test_a_file_the_model_reads_is_never_replaced(tmp_path):
    """A model reading a file beside it named like an output (here launch.sh) keeps it, --force or not."""
    write(tmp_path / "launch.sh", "width: 8\n")
    reader = "from pathlib import Path\nWIDTH = len(Path(__file__).with_name('launch.sh').read_text())\n"
    model = write(tmp_path / "m.py", reader + NET)
    result = runner.invoke(app, ["plan", str(model), *CLUSTER, "--out", str(tmp_path), "-q", "--force"])
    user_error(result, "launch.sh", "never replaces")
    assert (tmp_path / "launch.sh").read_text() == "width: 8\n"


def test_emit_into_the_model_folder_keeps_the_model(tmp_path):
    model = write(tmp_path / "src" / "train.py", NET)
    plan = make_plan("gpt")
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(model)})})
    (tmp_path / "plan.json").write_text(plan.to_json())
    user_error(runner.invoke(app, ["emit", str(tmp_path / "plan.json"), "--out", str(model.parent), "--force"]),
               "never replaces")
    assert model.read_text() == NET


# --- 3. the analysis cache sees what the model read --------------------------------------------------------


def test_cache_misses_when_a_sub_package_or_a_yaml_file_changes(tmp_path, monkeypatch):
    from planner.pipeline import PlanRequest, analyse

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLANNER_NO_CACHE", raising=False)
    folder = tmp_path / "m"
    write(folder / "netpkg" / "__init__.py", "from netpkg.sizes import DEPTH\n")
    write(folder / "netpkg" / "sizes.py", "DEPTH = 2\n")
    write(folder / "sizes.yaml", "width: 16\n")
    model = write(folder / "model.py", NET.replace("import torch\n", "import torch\nimport yaml\nimport netpkg\n", 1)
                  .replace("for _ in range(2)", "for _ in range(netpkg.DEPTH)")
                  .replace("    return Net()\n", "    w = yaml.safe_load(open(__file__.replace('model.py', "
                           "'sizes.yaml')))['width']\n    return Net(w)\n")
                  .replace("torch.randn(batch_size, 8)", "torch.randn(batch_size, yaml.safe_load(open(__file__"
                           ".replace('model.py', 'sizes.yaml')))['width'])"))
    request = PlanRequest(model_path=str(model), gpu="cpu", global_batch_size=4)

    def params() -> int:
        for name in [m for m in sys.modules if m == "netpkg" or m.startswith("netpkg.")]:
            del sys.modules[name]  # as a new planner process would: the edited sub-package is imported again
        return analyse(request).total_params

    first = params()
    assert params() == first  # a hit
    (folder / "netpkg" / "sizes.py").write_text("DEPTH = 5\n")
    deeper = params()
    assert deeper == first * 5 // 2
    (folder / "sizes.yaml").write_text("width: 64\n")
    assert params() == 5 * (64 * 64 + 64)
    sys.path[:] = [p for p in sys.path if p != str(folder)]


def test_the_same_model_in_another_folder_still_hits(tmp_path, monkeypatch):
    """Files read beside the model are recorded relative to its folder: a model compiled into a fresh folder
    each run (hf:, module: sources) keeps its cache entry."""
    from planner.model import analysis
    from planner.pipeline import PlanRequest, analyse

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLANNER_NO_CACHE", raising=False)
    reader = "from pathlib import Path\nWIDTH = len(Path(__file__).with_name('sizes.txt').read_text())\n"
    for name in ("a", "b"):
        write(tmp_path / name / "sizes.txt", "12345678")
        write(tmp_path / name / "model.py", reader + NET)
    first = analyse(PlanRequest(model_path=str(tmp_path / "a" / "model.py"), gpu="cpu", global_batch_size=4))

    def no_analysis(*_):
        raise AssertionError("the cache missed")

    monkeypatch.setattr(analysis, "analyse_model", no_analysis)
    again = analyse(PlanRequest(model_path=str(tmp_path / "b" / "model.py"), gpu="cpu", global_batch_size=4))
    assert again.total_params == first.total_params
    (tmp_path / "b" / "sizes.txt").write_text("changed")
    with pytest.raises(AssertionError, match="missed"):
        analyse(PlanRequest(model_path=str(tmp_path / "b" / "model.py"), gpu="cpu", global_batch_size=4))


# --- 4. --model-arg values survive plan.json, or are refused ------------------------------------------------


@pytest.mark.parametrize(("arg", "needle"), [
    ("widths={0: 16, 1: 16}", "dict key 0"),
    ("shape=(1, 2)", "tuple"),
    ("eps=1e999", "inf"),
    ("eps=float('nan')", None),  # not a literal: kept as the string, which survives
    ("data=b'\\xff'", "bytes"),
    ("name=\udcff", "UTF-8"),
    (f"n={'9' * 5000}", "digits"),
])
def test_model_args_plan_json_cannot_keep_are_refused(arg, needle):
    if needle is None:
        assert parse_model_args([arg]) == {"eps": "float('nan')"}
        return
    with pytest.raises(ConfigError, match=needle):
        parse_model_args([arg])


def test_model_args_round_trip_through_plan_json_and_emit(tmp_path):
    model = write(tmp_path / "m.py", NET)
    out, again = tmp_path / "out", tmp_path / "again"
    arg = "cfg={'widths': [16, 16], 'name': 'a\"b', 'eps': 1e-5, 'off': None, 'on': True}"
    assert runner.invoke(app, ["plan", str(model), *CLUSTER, "-a", arg, "--out", str(out), "-q"]).exit_code == 0
    assert runner.invoke(app, ["emit", str(out), "--out", str(again), "-q"]).exit_code == 0
    want = parse_model_args([arg])
    for folder in (out, again):
        train = (folder / "train.py").read_text()
        node = next(n for n in ast.parse(train).body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "MODEL_ARGS")
        assert ast.literal_eval(node.value) == want


# --- 5. validate measures only this run ---------------------------------------------------------------------


def test_validate_does_not_report_an_old_metrics_file(tmp_path):
    folder = tmp_path / "plan"
    write_scripts(make_plan("gpt"), folder)
    (folder / "plan.json").write_text(make_plan("gpt").to_json())
    (folder / "metrics.json").write_text(json.dumps({"steps": [{"step_time_s": 1.0, "loss": 1.0}] * 5}))
    (folder / "launch.sh").write_text("#!/bin/bash\nexit 0\n")  # a run that writes nothing
    user_error(runner.invoke(app, ["validate", str(folder), "--steps", "3"]), "wrote no")
    assert not list(folder.glob(".metrics.json.run-*"))


# --- 6. the model's import cannot move the planner ---------------------------------------------------------


def test_chdir_at_import_does_not_move_a_relative_out(tmp_path, monkeypatch):
    model = write(tmp_path / "m.py", "import os\nos.chdir('/')\n" + NET)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(model), *CLUSTER, "--out", "rel_out", "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rel_out" / "plan.json").is_file()
    assert Path.cwd() == tmp_path


def test_json_stays_clean_in_a_real_process(tmp_path):
    """fd 1 written and closed, sys.stdout and sys.__stdout__ closed, sys.exit replaced and an atexit handler
    that prints and exits, at import: the real `planner plan --json` still prints one JSON document on its
    stdout and exits 0 (one process for them all: each costs seconds)."""
    code = ("import atexit, os, sys\nos.write(1, b'{not json')\nsys.stdout.close()\nsys.__stdout__.close()\n"
            "os.close(1)\nsys.exit = lambda *a: None\n"
            "atexit.register(lambda: (print('{at exit'), os.write(1, b'{fd at exit'), os._exit(7)))\n")
    model = write(tmp_path / "m.py", code + NET)
    proc = subprocess.run([sys.executable, "-m", "planner.cli.main", "plan", str(model), *CLUSTER, "--out",
                           str(tmp_path / "out"), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PLANNER_NO_CACHE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schema_version"]
    assert "{not json" in proc.stderr and "{at exit" in proc.stderr


# --- 7 / 8. YAML specs and plan.json -------------------------------------------------------------------------


def _spec(tmp_path: Path, text: str) -> Path:
    return write(tmp_path / "spec.yaml", text)


def _h100() -> dict:
    return yaml.safe_load((specs_dir() / "h100-sxm5-80gb.yaml").read_text())


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = _spec(tmp_path, "\n".join(lines) + "\nname: bomb\n")
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match="anchor or alias"):
        load_cluster(str(path), 1)
    assert time.perf_counter() - t0 < 5


def test_self_referencing_alias_is_a_user_error(tmp_path):
    path = _spec(tmp_path, "name: &a [*a]\n")
    user_error(runner.invoke(app, ["plan", "x.py", "--gpu", str(path), "--global-batch-size", "4"]), "alias")


def test_duplicate_yaml_keys_are_refused(tmp_path):
    text = yaml.safe_dump(_h100(), sort_keys=False) + "memory_gib: 8000\n"
    with pytest.raises(SpecError, match="duplicate key 'memory_gib'"):
        load_cluster(str(_spec(tmp_path, text)), 1)


@pytest.mark.parametrize(("field", "value", "unit"), [
    ("memory_bandwidth_gbps", 3.35e12, "GB/s"),
    ("peak_tflops.bf16", 989e12, "TFLOP/s"),
    ("topology.inter_node_bandwidth_gbps", 50e9, "GB/s"),
])
def test_unit_slips_are_refused(tmp_path, field, value, unit):
    spec = _h100()
    target = spec
    *head, last = field.split(".")
    for key in head:
        target = target[key]
    target[last] = value
    with pytest.raises(SpecError, match=f"'{field}'.*{unit}"):
        load_cluster(str(_spec(tmp_path, yaml.safe_dump(spec))), 1)


def test_built_in_specs_are_plausible():
    assert len(list_specs()) >= 10  # every built-in file loads under the bounds


def test_top_k_is_bounded():
    user_error(runner.invoke(app, ["plan", "x.py", *CLUSTER, "--top-k", "100000"]), "--top-k")
    from planner.search.search import search

    with pytest.raises(ConfigError, match="top_k"):
        search(None, None, 4, top_k=51)  # type: ignore[arg-type]


def _plan_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def test_plan_json_with_a_duplicate_key_is_refused(tmp_path):
    good = make_plan("gpt").to_json()
    bad = good.replace('\n  "training": {', '\n  "training": {"seed": 1},\n  "training": {', 1)
    assert bad != good
    path = _plan_file(tmp_path, bad)
    for cmd in (["report", str(path)], ["emit", str(path), "--out", str(tmp_path / "o")]):
        user_error(runner.invoke(app, cmd), "'training' twice")


def test_plan_json_with_a_5000_digit_integer_is_refused(tmp_path):
    text = make_plan("gpt").to_json().replace('"seed": 0', '"seed": ' + "9" * 5000, 1)
    path = _plan_file(tmp_path, text)
    for cmd in (["report", str(path)], ["emit", str(path), "--out", str(tmp_path / "o")]):
        user_error(runner.invoke(app, cmd), "not valid JSON")


# --- 9. user input reported as user input --------------------------------------------------------------------


def test_script_module_is_a_user_error(tmp_path):
    model = write(tmp_path / "m.py", NET.replace("    return Net()", "    return torch.jit.script(Net())"))
    user_error(runner.invoke(app, ["plan", str(model), *CLUSTER, "--out", str(tmp_path / "o")]), "TorchScript")


def test_lazy_modules_are_a_user_error(tmp_path):
    model = write(tmp_path / "m.py", NET.replace("nn.Linear(width, width)", "nn.LazyLinear(width)"))
    user_error(runner.invoke(app, ["plan", str(model), *CLUSTER, "--out", str(tmp_path / "o")]), "lazy modules",
               "blocks.0")


def test_non_utf8_model_arg_is_a_user_error(tmp_path):
    model = write(tmp_path / "m.py", NET)
    user_error(runner.invoke(app, ["plan", str(model), *CLUSTER, "-a", "x=b'\\xff'", "--out", str(tmp_path)]),
               "--model-arg x")


# --- 11. the small ones ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_fifo_or_device_as_the_model_file(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "m.py"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    user_error(runner.invoke(app, ["plan", str(path), *CLUSTER, "--out", str(tmp_path / "o")]), "not a regular file")


def test_data_function_with_the_wrong_signature(tmp_path):
    model = write(tmp_path / "m.py", NET + "\n\ndef get_batch(step):\n    return (torch.randn(2, 8),)\n")
    message = user_error(runner.invoke(app, ["plan", str(model), *CLUSTER, "--out", str(tmp_path / "o")]),
                         "get_batch(step)", "--data")
    assert "build_model" not in message.split(".")[0]


def test_unknown_hf_model_type_is_one_short_paragraph(tmp_path):
    config = json.loads((HF_CONFIG / "config.json").read_text())
    config["model_type"] = "llamma"
    write(tmp_path / "config.json", json.dumps(config))
    message = user_error(runner.invoke(app, ["dry-run", "hf:x/y", "--hf-config", str(tmp_path), *CLUSTER]),
                         "'llamma'", "llama")
    assert len(message) < 600


def test_launch_steps_below_one_are_refused():
    from planner.runtime.loop import parse_args

    for steps in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            parse_args(["--steps", steps], "x", 10, Path("metrics.json"))
        assert e.value.code == 2
    assert parse_args(["--steps", "3"], "x", 10, Path("m.json")).steps == 3


def test_emit_does_not_list_kept_files_as_written(tmp_path):
    plan = make_plan("gpt")
    (tmp_path / "plan.json").write_text(plan.to_json())
    out = tmp_path / "out"
    assert runner.invoke(app, ["emit", str(tmp_path / "plan.json"), "--out", str(out)]).exit_code == 0
    (out / "train.py").write_text((out / "train.py").read_text() + "# mine\n")
    result = runner.invoke(app, ["emit", str(tmp_path / "plan.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "kept train.py" in result.stderr
    assert str(out / "train.py") not in result.stdout


def test_a_folder_that_cannot_be_swapped_is_written_file_by_file(tmp_path, monkeypatch):
    """A read-only or bind mount point as --out: the exchange fails (EBUSY) and the writer goes file by file,
    so that the real cause (a read-only file system) is what the user reads."""
    import errno

    from planner import io

    def busy(a, b):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(b))

    monkeypatch.setattr(io, "_exchange", busy)
    out = tmp_path / "mnt"
    out.mkdir()
    files = dict(render(make_plan("gpt")))
    io.write_output_set(out, files, force=False)
    assert (out / "train.py").read_text() == files["train.py"][0]
    assert not list(tmp_path.glob(".mnt.tmp-*"))


def test_a_read_only_mount_point_as_out_names_the_cause(tmp_path):
    """A real read-only bind mount (in a user namespace): the message says read-only, not "resource busy"."""
    import shlex

    folder = tmp_path / "ro"
    folder.mkdir()
    q = shlex.quote(str(folder))
    code = ("import sys\nfrom planner.io import write_output_set\nfrom planner.errors import PlannerError\n"
            f"try:\n    write_output_set({str(folder)!r}, {{'a.txt': ('a', False)}}, force=False)\n"
            "except PlannerError as e:\n    print(e)\n    sys.exit(2)\n")
    python = shlex.quote(sys.executable)
    cmd = f"mount --bind {q} {q} && mount -o remount,bind,ro {q} && {python} -c {shlex.quote(code)}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode != 2 and "mount" in proc.stderr + proc.stdout:
        pytest.skip(f"no user namespace to mount in: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Read-only file system" in proc.stdout and "resource busy" not in proc.stdout
