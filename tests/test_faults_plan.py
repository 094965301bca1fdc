"""plan.json cross-checks and strict JSON (issue 13 point 6), and the small items of point 8 that live in
the spec loader and `report`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401 - see tests/test_cli.py
import yaml
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import PlanError, SpecError
from planner.hardware.load import load_cluster, specs_dir
from planner.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny_gpt.py"
runner = CliRunner()


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "p"
    result = runner.invoke(app, ["plan", str(TINY), "--gpu", "cpu", "--gpus-per-node", "2", "--pp", "2",
                                 "--global-batch-size", "4", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return out


def _set(doc: dict, path: str, value) -> None:
    *head, last = path.split(".")
    for key in head:
        doc = doc[int(key)] if key.isdigit() else doc[key]
    doc[last] = value


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("cluster.nodes", 3, "but the cluster has"),
        ("predicted.iteration_time_s", float("nan"), "finite number"),
        ("predicted.mfu", -0.5, "greater than or equal to 0"),
        ("stages.0.forward_time_s", float("inf"), "finite number"),
        ("stages.1.index", 0, "stage indices"),
        ("stages.1.pp_rank", 5, "pp_rank"),
        ("training.steps", -1, "greater than or equal to 1"),
        ("training.lr", 0.0, "greater than 0"),
        ("parallel.tp", True, "valid integer"),
        ("training.steps", "10", "valid integer"),
    ],
)
def test_inconsistent_plans_are_refused(planned, tmp_path, path, value, needle):
    doc = json.loads((planned / "plan.json").read_text())
    _set(doc, path, value)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))  # json writes NaN/Infinity for float nan/inf, as a hand edit might
    with pytest.raises(PlanError, match=needle):
        load_plan(bad)
    for command in (["report", str(bad)], ["report", str(bad), "--json"], ["emit", str(bad), "--out",
                                                                           str(tmp_path / "e")]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and "Traceback" not in result.output and "NaN" not in result.stdout


def test_report_json_is_strict_json(planned):
    result = runner.invoke(app, ["report", str(planned), "--json"])
    assert result.exit_code == 0
    json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_report_to_a_full_device(planned, extra):
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "planner.cli.main", "report", str(planned), *extra], cwd=ROOT,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr


def test_huge_memory_in_a_spec_is_a_spec_error(tmp_path):
    spec = yaml.safe_load((specs_dir() / "h100-sxm-80gb.yaml").read_text()) if (
        specs_dir() / "h100-sxm-80gb.yaml").exists() else yaml.safe_load(sorted(specs_dir().glob("*.yaml"))[0]
                                                                             .read_text())
    spec["memory_gib"] = 1e300
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match="memory_gib"):
        load_cluster(str(path), 1)
