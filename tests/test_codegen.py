"""Codegen: rendering is deterministic, ruff-clean and carries the plan; the generated functions cut a model
correctly. (Runs of the generated script under torchrun are in tests/e2e.)"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.plans import FILES, TINY, make_plan

from planner.codegen.render import (
    LINE_LENGTH,
    compress_mapping,
    compress_names,
    py_literal,
    render,
    runtime_objects,
    write_scripts,
)
from planner.errors import PlanError
from planner.runtime.digest import package_digest, runtime_files
from planner.runtime.errors import LayoutError
from planner.runtime.layout import Layout, TPPlan, expand_names, read_layout_file

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))


def _constants(train_py: str) -> dict[str, object]:
    """The literal constants assigned at the top of a rendered train.py."""
    out = {}
    for node in ast.parse(train_py).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper():
                try:
                    out[name] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out


PLANS = {
    "single": lambda: make_plan("gpt"),
    "pp2_dp2": lambda: make_plan("gpt", pp=2, dp=2),
    "interleaved": lambda: make_plan("gpt", pp=2, virtual_stages=2, schedule="interleaved-1f1b", num_micro_batches=4),
    "zbv": lambda: make_plan("gpt", pp=2, virtual_stages=2, schedule="zero-bubble", num_micro_batches=4),
    "tp_sp_fsdp": lambda: make_plan(
        "llama", tp=2, dp=2, zero_stage=3, sequence_parallel=True, recompute="selective"
    ),
    "deep": lambda: make_plan("gpt", pp=4, tp=2, model_args={**TINY["gpt"], "layers": 48}),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_render_is_deterministic(name):
    plan = PLANS[name]()
    first = render(plan)
    again = render(plan.model_validate_json(plan.to_json()))
    assert first == again
    scripts = {"train.py", "launch.sh", "launch_multinode.sh", "slurm.sbatch"}
    runtime = {f"planner_runtime/{name}" for name in runtime_files()}
    model = {f"model/{Path(plan.model.path).name}"}  # the model file travels with the scripts
    assert set(first) == scripts | runtime | model and "planner_runtime/loop.py" in runtime
    assert all(first[name][1] for name in scripts) and not any(first[name][1] for name in runtime)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_rendered_train_py_is_ruff_clean(name, tmp_path):
    (tmp_path / "train.py").write_text(render(PLANS[name]())["train.py"][0])
    result = subprocess.run(
        [RUFF, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(tmp_path / "train.py")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert max(len(line) for line in (tmp_path / "train.py").read_text().splitlines()) <= LINE_LENGTH


def test_constants_carry_the_plan():
    plan = make_plan("gpt", pp=2, dp=2, tp=2, zero_stage=1, num_micro_batches=4, recompute="full")
    c = _constants(render(plan)["train.py"][0])
    p = plan.parallel
    assert (c["PP"], c["DP"], c["TP"], c["VIRTUAL_STAGES"]) == (2, 2, 2, 1)
    assert (c["MICRO_BATCH_SIZE"], c["NUM_MICRO_BATCHES"], c["GLOBAL_BATCH_SIZE"]) == (2, 4, p.global_batch_size)
    assert (c["SCHEDULE"], c["ZERO_STAGE"], c["SEQUENCE_PARALLEL"]) == ("1f1b", 1, False)
    assert c["MESH_DIMS"] == ("pp", "dp", "tp")
    expand = lambda names: [n for m in names for n in expand_names(m)]  # noqa: E731
    assert [(r, expand(m), rec) for r, m, rec in c["STAGES"]] == [(s.pp_rank, s.modules, "full") for s in plan.stages]
    assert c["STAGES"][0][1] == ["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1"]  # runs of 3+ are written short
    assert {n: v for k, v in c["TP_PLAN"].items() for n in expand_names(k)} == plan.tp.styles
    assert c["TP_PLAN"]["blocks.{0-3}.attn.o"] == "rowwise" and "blocks.3.attn.o" not in c["TP_PLAN"]
    layout, _, _ = runtime_objects(plan)
    assert layout.tp_plan == plan.tp
    assert c["MODEL_FILE"] == f"model/{Path(plan.model.path).name}" and c["MODEL_ARGS"] == plan.model.model_args
    assert (c["LOSS_FN"], c["BATCH_FN"], c["BUILD_FN"]) == ("loss_fn", None, "build_model")
    assert (c["SEED"], c["LR"], c["STEPS"], c["DTYPE"]) == (0, 0.01, 3, "fp32")


def test_body_is_the_same_for_every_plan():
    """Only the constants differ between plans: no plan-specific code paths, and the same runtime copy."""

    def body(text: str) -> str:
        return text[text.index("def check_runtime") :]

    rendered = [render(make()) for make in PLANS.values()]
    assert len({body(files["train.py"][0]) for files in rendered}) == 1
    copies = {tuple(sorted((k, v) for k, v in files.items() if k.startswith("planner_runtime/"))) for files in rendered}
    assert len(copies) == 1


def test_train_py_is_short_and_calls_the_runtime():
    text = render(make_plan("gpt", pp=2, dp=2))["train.py"][0]
    assert len(text.splitlines()) < 140
    assert "from planner_runtime.loop import run" in text
    code = text[text.index("def check_runtime") :]
    # the code (not the plan's constants): a check, the editable step, one call
    assert len(code.splitlines()) < 60 and "def train_step(step):" in code


def test_paths_with_spaces_and_quotes_are_quoted(tmp_path):
    odd = tmp_path / "my models" / "it's \"gpt\".py"
    odd.parent.mkdir()
    shutil.copy(FILES["gpt"], odd)
    plan = make_plan("gpt")
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(odd)})})
    out = tmp_path / "out dir"
    write_scripts(plan, out)
    assert _constants((out / "train.py").read_text())["MODEL_FILE"] == "model/model_file.py"  # an importable name
    assert (out / "model" / "model_file.py").read_bytes() == odd.read_bytes()
    for name in ("launch.sh", "launch_multinode.sh", "slurm.sbatch"):
        text = (out / name).read_text()
        assert "set -euo pipefail" in text
        subprocess.run(["bash", "-n", str(out / name)], check=True)
    assert 'cd "$(dirname "$0")"' in (out / "launch.sh").read_text()


def test_write_scripts_sets_modes(tmp_path):
    written = write_scripts(make_plan("gpt", dp=2), tmp_path)
    scripts = [p for p in written if p.parent == tmp_path]
    assert sorted(p.name for p in scripts) == ["launch.sh", "launch_multinode.sh", "slurm.sbatch", "train.py"]
    for path in scripts:
        assert path.stat().st_mode & stat.S_IXUSR
    copied = sorted(p.name for p in written if p.parent == tmp_path / "planner_runtime")
    model = [p for p in written if p.parent == tmp_path / "model"]  # the model file's copy
    assert copied == sorted(runtime_files()) and len(model) == 1
    assert len(copied) + len(scripts) + len(model) == len(written)
    for path in written:
        if path.parent != tmp_path:
            assert not path.stat().st_mode & stat.S_IXUSR
    assert not list(tmp_path.glob(".*.tmp"))


def test_cpu_launchers():
    files = render(make_plan("gpt", pp=2, dp=2))
    launch = files["launch.sh"][0]
    assert 'torchrun --standalone --nproc-per-node="$NPROC" train.py --device cpu "$@"' in launch
    assert "NPROC=4" in launch and "nvidia-smi" not in launch and "cuda.device_count" not in launch


def test_gpu_launchers_span_nodes():
    plan = make_plan("gpt", pp=2, dp=4, tp=2, gpu="h100-sxm5-80gb")
    plan = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"nodes": 4, "gpus_per_node": 8})})
    files = render(plan)
    launch, multi, slurm = files["launch.sh"][0], files["launch_multinode.sh"][0], files["slurm.sbatch"][0]
    assert "WORLD=16" in launch and "NPROC=8" in launch and "--device cuda" in launch
    assert "NNODES=2" in multi and "--rdzv-backend=c10d" in multi and '--node-rank="$NODE_RANK"' in multi
    assert '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in multi
    assert "#SBATCH --nodes=2" in slurm and "#SBATCH --ntasks-per-node=1" in slurm
    assert "#SBATCH --gpus-per-node=8" in slurm
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in slurm
    assert '--node-rank="$SLURM_NODEID"' in slurm and "srun bash -c '" in slurm


def test_plan_too_big_for_the_cluster_is_refused():
    plan = make_plan("gpt", dp=4, tp=2, gpu="h100-sxm5-80gb")
    plan = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"nodes": 1, "gpus_per_node": 4})})
    with pytest.raises(PlanError, match="do not fill"):
        render(plan)


def test_multinode_launcher_requires_its_environment(tmp_path):
    write_scripts(make_plan("gpt", dp=2), tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(["bash", str(tmp_path / "launch_multinode.sh")], env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "NODE_RANK" in result.stderr


def test_codegen_does_not_import_the_solver():
    code = (
        "import sys, planner.codegen.render\n"
        "bad = [m for m in sys.modules if m.startswith(('planner.search', 'pulp'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    "value",
    [
        {"layers": 4, "name": 'a "quoted"\nvalue', "ratio": 0.5, "flag": True, "none": None, "inf": float("inf")},
        [(0, [f"blocks.{i}" for i in range(40)], "full"), (1, ["head"], "none")],
        ("pp", "dp", "tp"),
        ("one",),
        {},
    ],
)
def test_py_literal_round_trips_and_wraps(value):
    text = py_literal(value, indent=10)
    assert ast.literal_eval(text.replace('float("inf")', "1e999")) == value
    assert all(len(line) <= LINE_LENGTH for line in text.splitlines())


def test_py_literal_refuses_objects():
    with pytest.raises(PlanError, match="literal"):
        py_literal({"fn": print})


def test_copied_runtime_matches_the_recorded_digest(tmp_path):
    write_scripts(make_plan("gpt", dp=2), tmp_path)
    assert _constants((tmp_path / "train.py").read_text())["RUNTIME_DIGEST"] == package_digest(
        tmp_path / "planner_runtime"
    )
    assert package_digest(tmp_path / "planner_runtime") == package_digest(ROOT / "planner" / "runtime")


@pytest.mark.parametrize("change", ["edit", "remove", "add"])
def test_train_py_refuses_a_changed_runtime(change, tmp_path):
    write_scripts(make_plan("gpt"), tmp_path)
    runtime = tmp_path / "planner_runtime"
    if change == "edit":
        loop = runtime / "loop.py"
        loop.write_text(loop.read_text().replace("def log0(", "def log0_(", 1))
    elif change == "remove":
        shutil.rmtree(runtime)
    else:
        (runtime / "extra.py").write_text("x = 1\n")
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    result = subprocess.run(
        [sys.executable, "train.py", "--steps", "1", "--device", "cpu"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode != 0
    expected = "is missing" if change == "remove" else "differs from the one this train.py was generated with"
    assert expected in result.stderr and "planner emit" in result.stderr
    assert not (tmp_path / "metrics.json").exists()


def test_a_broken_layout_is_refused_when_rendering():
    plan = make_plan("gpt", pp=2)
    stages = [s.model_copy(update={"recompute": "sometimes"}) if s.index == 1 else s for s in plan.stages]
    with pytest.raises(PlanError, match="recompute 'sometimes'"):
        render(plan.model_copy(update={"stages": stages}))


@pytest.mark.parametrize(
    "names",
    [
        ["a", "blocks.0", "blocks.1", "blocks.2", "blocks.4", "blocks.5", "head"],
        [f"layers.{i}" for i in range(96)],
        ["blocks.9", "blocks.10", "blocks.11", "x.01", "x.02", "x.03"],  # leading zeros are not numbers to count
        ["h.0.a", "h.1.a", "h.2.b", "h.3.b"],
        [],
    ],
)
def test_compressed_names_expand_back(names):
    short = compress_names(names)
    assert [n for m in short for n in expand_names(m)] == names
    mapping = {n: ("colwise" if "a" in n else "rowwise") for n in names}
    short_map = compress_mapping(mapping)
    assert {n: v for k, v in short_map.items() for n in expand_names(k)} == mapping
    assert len(short_map) <= len(mapping)


def test_train_py_stays_short_for_deep_models():
    plan = make_plan("gpt", pp=16, tp=8, model_args={**TINY["gpt"], "layers": 96})  # GPT-3 175B's layout
    text = render(plan)["train.py"][0]
    assert len(text.splitlines()) < 140 and max(len(line) for line in text.splitlines()) <= LINE_LENGTH


def test_one_line_length():
    """render.LINE_LENGTH (what generated code is wrapped to) is the project's ruff line length."""
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["ruff"]["line-length"] == LINE_LENGTH


def _long_plan():
    """GPT-3 175B's layout with every module name unnumbered (nothing compresses into runs)."""
    plan = make_plan("gpt", pp=16, tp=8, model_args={**TINY["gpt"], "layers": 96})
    rename = {}

    def unnumbered(name: str) -> str:
        return rename.setdefault(name, name.replace(".", "_") + "_x")

    stages = [s.model_copy(update={"modules": [unnumbered(m) for m in s.modules]}) for s in plan.stages]
    tp_plan = {unnumbered(k): v for k, v in plan.tp.styles.items()}
    return plan.model_copy(update={"stages": stages, "tp": dataclasses.replace(plan.tp, styles=tp_plan)})


def test_module_lists_too_long_for_train_py_go_to_layout_json(tmp_path):
    plan = _long_plan()
    files = render(plan)
    text = files["train.py"][0]
    assert len(text.splitlines()) < 140 and max(len(line) for line in text.splitlines()) <= LINE_LENGTH
    assert "layout.json" in files
    (tmp_path / "train.py").write_text(text)
    ruff = subprocess.run(
        [RUFF, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(tmp_path / "train.py")],
        capture_output=True, text=True,
    )
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    c = _constants(text)
    assert c["LAYOUT_FILE"] == "layout.json" and "\nSTAGES = TP_PLAN = TP_HEAD_ATTRS = None\n" in text
    layout_text = files["layout.json"][0]
    assert c["LAYOUT_DIGEST"] == hashlib.sha256(layout_text.encode()).hexdigest()
    # What train.py builds from layout.json is what the plan says.
    (tmp_path / "layout.json").write_text(layout_text)
    stages, tp_plan, heads = read_layout_file(tmp_path / "layout.json", c["LAYOUT_DIGEST"])
    expected, _, _ = runtime_objects(plan)
    built = Layout(
        pp=expected.pp, dp=expected.dp, tp=expected.tp, micro_batch_size=expected.micro_batch_size,
        num_micro_batches=expected.num_micro_batches, stages=stages, tp_plan=TPPlan(styles=tp_plan, head_attrs=heads),
    )
    assert built.stages == expected.stages
    assert (built.tp_plan.styles, built.tp_plan.head_attrs) == (expected.tp_plan.styles, expected.tp_plan.head_attrs)
    # Short plans keep their lists as constants and write no layout.json.
    short = render(make_plan("gpt", pp=2, dp=2))
    assert "layout.json" not in short and _constants(short["train.py"][0])["LAYOUT_FILE"] is None


def test_an_edited_layout_json_is_refused(tmp_path):
    path = tmp_path / "layout.json"
    path.write_text('{"stages": [], "tp_plan": {}, "tp_head_attrs": {}}\n')
    with pytest.raises(LayoutError, match="differs from the one this train.py was generated with"):
        read_layout_file(path, "0" * 64)
    with pytest.raises(LayoutError, match="cannot be read"):
        read_layout_file(tmp_path / "missing.json", "0" * 64)


def test_name_lists_fill_lines():
    """A long list of names takes a few lines, not one per name, indented 4 past its line."""
    names = [f"module_{i}_x" for i in range(60)]
    text = py_literal({"A": names, "B": {"k": [1, 2]}}, indent=4)
    assert ast.literal_eval(text) == {"A": names, "B": {"k": [1, 2]}}
    lines = text.splitlines()
    assert len(lines) < 15 and all(len(line) <= LINE_LENGTH for line in lines)
    assert lines[1] == '    "A": [' and lines[2].startswith("        ") and lines[-1] == "}"
