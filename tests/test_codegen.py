"""Codegen: rendering is deterministic, ruff-clean and carries the plan; the generated functions cut a model
correctly. (Runs of the generated script under torchrun are in tests/e2e.)"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e.plans import FILES, TINY, make_plan
from torch import fx

from planner.codegen.render import py_literal, render, write_scripts
from planner.errors import PlanError

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
    assert set(first) == {"train.py", "launch.sh", "launch_multinode.sh", "slurm.sbatch"}
    assert all(executable for _, executable in first.values())


@pytest.mark.parametrize("name", sorted(PLANS))
def test_rendered_train_py_is_ruff_clean(name, tmp_path):
    (tmp_path / "train.py").write_text(render(PLANS[name]())["train.py"][0])
    result = subprocess.run(
        [RUFF, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(tmp_path / "train.py")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert max(len(line) for line in (tmp_path / "train.py").read_text().splitlines()) <= 110


def test_constants_carry_the_plan():
    plan = make_plan("gpt", pp=2, dp=2, tp=2, zero_stage=1, num_micro_batches=4, recompute="full")
    c = _constants(render(plan)["train.py"][0])
    p = plan.parallel
    assert (c["PP"], c["DP"], c["TP"], c["VIRTUAL_STAGES"]) == (2, 2, 2, 1)
    assert (c["MICRO_BATCH_SIZE"], c["NUM_MICRO_BATCHES"], c["GLOBAL_BATCH_SIZE"]) == (2, 4, p.global_batch_size)
    assert (c["SCHEDULE"], c["ZERO_STAGE"], c["SEQUENCE_PARALLEL"]) == ("1f1b", 1, False)
    assert c["MESH_DIMS"] == ("pp", "dp", "tp")
    assert c["STAGES"] == [(s.pp_rank, s.modules, "full") for s in plan.stages]
    assert c["TP_PLAN"] == plan.tp_plan and c["TP_PLAN"]["blocks.3.attn.o"] == "rowwise"
    assert c["MODEL_FILE"] == plan.model.path and c["MODEL_ARGS"] == plan.model.model_args
    assert (c["LOSS_FN"], c["BATCH_FN"], c["BUILD_FN"]) == ("loss_fn", None, "build_model")
    assert (c["SEED"], c["LR"], c["STEPS"], c["DTYPE"]) == (0, 0.01, 3, "fp32")


def test_body_is_the_same_for_every_plan():
    """Only the constants differ between plans: no plan-specific code paths."""

    def body(text: str) -> str:
        return text[text.index("# Setup: process group") :]

    bodies = {body(render(make())["train.py"][0]) for make in PLANS.values()}
    assert len(bodies) == 1


def test_paths_with_spaces_and_quotes_are_quoted(tmp_path):
    odd = tmp_path / "my models" / "it's \"gpt\".py"
    odd.parent.mkdir()
    shutil.copy(FILES["gpt"], odd)
    plan = make_plan("gpt")
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(odd)})})
    out = tmp_path / "out dir"
    write_scripts(plan, out)
    assert _constants((out / "train.py").read_text())["MODEL_FILE"] == str(odd)
    for name in ("launch.sh", "launch_multinode.sh", "slurm.sbatch"):
        text = (out / name).read_text()
        assert "set -euo pipefail" in text
        subprocess.run(["bash", "-n", str(out / name)], check=True)
    assert 'cd "$(dirname "$0")"' in (out / "launch.sh").read_text()


def test_write_scripts_sets_modes(tmp_path):
    written = write_scripts(make_plan("gpt", dp=2), tmp_path)
    assert sorted(p.name for p in written) == ["launch.sh", "launch_multinode.sh", "slurm.sbatch", "train.py"]
    for path in written:
        assert path.stat().st_mode & stat.S_IXUSR
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
    assert all(len(line) <= 110 for line in text.splitlines())


def test_py_literal_refuses_objects():
    with pytest.raises(PlanError, match="literal"):
        py_literal({"fn": print})


# ---------------------------------------------------------------------------------------------------------
# The generated functions, imported in-process: the cut pieces compute exactly the model's forward.
# ---------------------------------------------------------------------------------------------------------
def _import_train(plan, tmp_path, name):
    write_scripts(plan, tmp_path)
    spec = importlib.util.spec_from_file_location(f"generated_train_{name}", tmp_path / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CUTS = {
    "gpt_pp2": lambda: make_plan("gpt", pp=2),
    "llama_4_stages": lambda: make_plan("llama", pp=2, virtual_stages=2, schedule="interleaved-1f1b"),
    "mlp_zbv": lambda: make_plan("mlp", pp=2, virtual_stages=2, schedule="zero-bubble"),
    "tiny_pp3": lambda: make_plan("tiny", pp=3),
    "tiny_export": lambda: make_plan("tiny", pp=2, model_args={**TINY["tiny"], "check_length": True}),
    "tiny_tied": lambda: make_plan("tiny", model_args={**TINY["tiny"], "tie": True}),
}


@pytest.mark.parametrize("name", sorted(CUTS))
def test_pieces_compute_the_models_forward(name, tmp_path):
    plan = CUTS[name]()
    train = _import_train(plan, tmp_path, name)
    cpu = torch.device("cpu")
    user = train.load_model_file(train.MODEL_FILE)
    example = train.make_batch(user, 0, 0)
    gm, values, method = train.trace(train.build_model(user, everything_on_meta=True), example[0].to("meta"))
    assert method == ("export" if name == "tiny_export" else "fx")
    pieces = train.cut_into_pieces(gm, values)
    assert sorted({p.stage for p in pieces}) == list(range(len(plan.stages)))

    model = train.build_model(user, everything_on_meta=False)
    train.materialise(model, {n for n, _ in model.named_modules()}, cpu)
    assert not any(p.is_meta for p in model.parameters())
    if name == "tiny_tied":
        assert model.head.weight is model.tok_emb.weight
    values_in = (example[0],)
    for i in range(len(plan.stages)):
        mine = [p for p in pieces if p.stage == i]
        modules = []
        for p in mine:
            targets = [n.target for n in p.graph.nodes if n.op in ("get_attr", "call_module")]
            modules.append(fx.GraphModule({t: train.fetch(model, gm, t, cpu) for t in targets}, p.graph))
        out = train.StageModule(modules, [p.owner for p in mine])(*values_in)
        if i < len(plan.stages) - 1:
            assert isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
            values_in = out
    with torch.no_grad():
        expected = model(example[0])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_initial_weights_do_not_depend_on_what_a_rank_holds(tmp_path):
    """A module's initial weights depend on (SEED, its name) only, not on which other modules are built."""
    train = _import_train(make_plan("tiny", pp=2), tmp_path, "init")
    user = train.load_model_file(train.MODEL_FILE)
    cpu = torch.device("cpu")
    everything = train.build_model(user, everything_on_meta=False)
    train.materialise(everything, {n for n, _ in everything.named_modules()}, cpu)
    part = train.build_model(user, everything_on_meta=False)
    owned = {n for n, _ in part.named_modules() if n.startswith(("blocks.2", "blocks.3", "head", "ln_f"))} | {""}
    train.materialise(part, owned, cpu)
    full = dict(everything.named_parameters())
    held = {n: p for n, p in part.named_parameters() if not p.is_meta}
    assert {n.split(".")[0] for n in held} == {"pos_emb", "blocks", "ln_f", "head"}
    for n, p in held.items():
        torch.testing.assert_close(p, full[n], rtol=0, atol=0)
    torch.testing.assert_close(full["blocks.0.scale.gain"], torch.ones(64))  # default init of a 1-d weight


def test_weights_used_by_two_stages_are_refused(tmp_path):
    train = _import_train(make_plan("tiny", pp=2, model_args={**TINY["tiny"], "tie": True}), tmp_path, "tied")
    user = train.load_model_file(train.MODEL_FILE)
    example = train.make_batch(user, 0, 0)
    gm, values, _ = train.trace(train.build_model(user, everything_on_meta=True), example[0].to("meta"))
    with pytest.raises(SystemExit, match=r"tok_emb.weight is used by stages \[0, 1\] \(tied"):
        train.cut_into_pieces(gm, values)


def test_batches_come_from_get_batch_when_the_plan_names_it(tmp_path):
    model_file = tmp_path / "data_model.py"
    model_file.write_text(
        "import torch\n"
        "from torch import nn\n\n\n"
        "def build_model(**kwargs):\n"
        "    return nn.Linear(4, 1)\n\n\n"
        "def example_inputs(batch_size, **kwargs):\n"
        "    return (torch.zeros(batch_size, 4),)\n\n\n"
        "def get_batch(step, micro_batch_size, micro_batch=-1, width=0, **kwargs):\n"
        "    return (torch.full((micro_batch_size, 4), float(step * 100 + micro_batch + width)),)\n"
    )
    plan = make_plan("mlp", dp=2, num_micro_batches=3)
    model = plan.model.model_copy(update={"path": str(model_file), "batch_fn": "get_batch", "loss_fn": None})
    plan = plan.model_copy(update={"model": model})
    train = _import_train(plan, tmp_path / "out", "batch")
    user = train.load_model_file(train.MODEL_FILE)
    (x,) = train.make_batch(user, 3, 5)
    assert x.shape == (2, 4) and x[0, 0].item() == 300 + 5 + TINY["mlp"]["width"]  # model args passed too


def test_synthetic_batches_depend_on_step_and_micro_batch_only(tmp_path):
    train = _import_train(make_plan("gpt", dp=2), tmp_path, "synthetic")
    user = train.load_model_file(train.MODEL_FILE)
    a, b, c = train.make_batch(user, 1, 2)[0], train.make_batch(user, 1, 2)[0], train.make_batch(user, 1, 3)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (2, TINY["gpt"]["seq"]) and a.dtype == torch.int64
