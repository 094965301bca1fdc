"""The model file travels with the plan: train.py names a copy beside it, relative to itself, with the local
modules the model imports, so that a plan folder made on one machine runs on another."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from e2e.plans import make_plan

from planner.codegen.modelcopy import copied_model, local_imports
from planner.codegen.render import render
from planner.errors import PlanError

SIBLING_MODEL = '''
import math

import torch
from torch import nn

import layers
from blocks.mlp import MLP


def build_model():
    return nn.Sequential(layers.Scale(), MLP())


def example_inputs(batch_size=2):
    return (torch.randn(batch_size, 8),)
'''


def _tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "blocks").mkdir(parents=True)
    (src / "model.py").write_text(SIBLING_MODEL)
    (src / "layers.py").write_text("from torch import nn\nimport helpers\n\n\nclass Scale(nn.Identity):\n    pass\n")
    (src / "helpers.py").write_text("X = 1\n")
    (src / "blocks" / "__init__.py").write_text("")
    (src / "blocks" / "mlp.py").write_text("from torch import nn\n\n\ndef MLP():\n    return nn.Linear(8, 8)\n")
    (src / "unrelated.py").write_text("raise SystemExit('never copied')\n")
    return src / "model.py"


def test_local_imports_are_found_transitively_and_installed_ones_are_not(tmp_path):
    model = _tree(tmp_path)
    assert sorted(local_imports(model)) == ["blocks/__init__.py", "blocks/mlp.py", "helpers.py", "layers.py"]
    rel, files = copied_model(str(model))
    assert rel == "model/model.py"
    assert sorted(files) == ["model/blocks/__init__.py", "model/blocks/mlp.py", "model/helpers.py",
                             "model/layers.py", "model/model.py"]
    assert files["model/model.py"][0] == model.read_text()


def test_train_py_names_the_copy_relative_to_itself(tmp_path):
    plan = make_plan("gpt")
    files = render(plan)
    train = files["train.py"][0]
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(train).body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    name = Path(plan.model.path).name
    assert consts["MODEL_FILE"] == f"model/{name}" and not Path(consts["MODEL_FILE"]).is_absolute()
    assert files[f"model/{name}"][0] == Path(plan.model.path).read_text()
    assert "ModelFile(str(here / MODEL_FILE)" in train
    assert str(Path(plan.model.path).parent) not in train  # no path of the planning machine


def test_a_missing_model_file_is_a_plan_error(tmp_path):
    with pytest.raises(PlanError, match="not there to copy"):
        copied_model(str(tmp_path / "gone.py"))


def test_emit_from_a_moved_plan_folder_uses_its_copy(tmp_path):
    """A plan folder moved to a machine without the original model file still re-emits."""
    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.codegen.render import write_scripts

    src = tmp_path / "laptop"
    src.mkdir()
    model = src / "gpt_model.py"
    plan = make_plan("gpt")
    shutil.copy(plan.model.path, model)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(model)})})
    out = tmp_path / "plan_out"
    write_scripts(plan, out)
    (out / "plan.json").write_text(plan.to_json())
    moved = tmp_path / "cluster" / "plan_out"
    moved.parent.mkdir()
    shutil.move(str(out), moved)
    shutil.rmtree(src)
    result = CliRunner().invoke(app, ["emit", str(moved / "plan.json"), "--out", str(tmp_path / "again"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "again" / "model" / "gpt_model.py").read_text() == (moved / "model" / "gpt_model.py").read_text()


@pytest.mark.e2e
def test_a_moved_plan_folder_trains_without_the_original_model(tmp_path):
    """Planned on one machine (the model beside its local module), run on another: the folder moves, the
    planning machine's model folder is gone, and train.py trains from its copies."""
    import json
    import os
    import subprocess
    import sys

    from planner.codegen.render import write_scripts

    src = tmp_path / "laptop"
    src.mkdir()
    plan = make_plan("mlp")
    text = Path(plan.model.path).read_text()
    (src / "mlp_consts.py").write_text("SCALE = 1.0\n")
    (src / "my_mlp.py").write_text("import mlp_consts  # a local module beside the model\n" + text)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(src / "my_mlp.py")})})
    write_scripts(plan, tmp_path / "out")
    moved = tmp_path / "cluster"
    shutil.move(str(tmp_path / "out"), moved)
    shutil.rmtree(src)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "train.py", "--steps", "1", "--device", "cpu"], cwd=moved, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = json.loads((moved / "metrics.json").read_text())["steps"]
    assert len(steps) == 1 and steps[0]["loss"] == steps[0]["loss"]  # trained one step, a finite loss


def test_files_the_model_read_keep_their_place_relative_to_it(tmp_path):
    """A model that reaches a file by a path built from its own __file__ (a base model two folders up, a config
    beside it): the copy keeps them where that path leads."""
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("[project]\nname = 'ft'\n")  # the project the model belongs to
    (tmp_path / "home" / ".cache").mkdir(parents=True)
    token = tmp_path / "home" / ".cache" / "token"  # read by a library, outside the project: never copied
    token.write_text("hf_secret\n")
    (repo / ".env").write_text("KEY=1\n")  # hidden, inside it: never copied
    (repo / "models" / "ft").mkdir(parents=True)
    (repo / "base.py").write_text("WIDTH = 8\n")
    (repo / "models" / "ft" / "cfg.yaml").write_text("width: 8\n")
    (repo / "configs" / "big.bin").write_bytes(b"\0" * 16)  # not text: not copied
    model = repo / "models" / "ft" / "tune.py"
    model.write_text("from pathlib import Path\nBASE = Path(__file__).resolve().parents[2] / 'base.py'\n")
    reads = [str(repo / "base.py"), str(repo / "configs" / "big.bin"), str(token), str(repo / ".env")]
    rel, files = copied_model(str(model), reads=reads)
    assert rel == "model/models/ft/tune.py"
    assert sorted(files) == ["model/base.py", "model/models/ft/cfg.yaml", "model/models/ft/tune.py"]
    out = tmp_path / "out"
    for name, (text, _) in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    assert (out / rel).resolve().parents[2] / "base.py" == (out / "model" / "base.py").resolve()


def test_emit_carries_the_plan_folders_copy_with_its_edits(tmp_path):
    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.codegen.render import write_scripts

    plan = make_plan("gpt")
    out = tmp_path / "plan_out"
    write_scripts(plan, out)
    (out / "plan.json").write_text(plan.to_json())
    copy = out / "model" / Path(plan.model.path).name
    copy.write_text(copy.read_text() + "\nEDITED = True\n")
    result = CliRunner().invoke(app, ["emit", str(out), "--out", str(tmp_path / "again"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "again" / "model" / copy.name).read_text().endswith("EDITED = True\n")
