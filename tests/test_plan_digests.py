"""Plans byte-identical to the recorded ones (tests/fixtures/plan_digests.json): the search's reshaping (issue 29)
must not change a plan. The cheap cases run here, in this process; `python bench/plan_digests.py` runs them all
(the README's examples, GPT-3 175B on 1024 A100s), each in a fresh process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plan_digests", ROOT / "bench" / "plan_digests.py")
assert _spec is not None and _spec.loader is not None
digests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digests)

RECORDED = json.loads(digests.FIXTURE.read_text())
CHEAP = [name for name, (cheap, _) in digests.CASES.items() if cheap]


def test_every_case_has_a_recorded_digest():
    assert sorted(RECORDED) == sorted(digests.CASES)


@pytest.mark.parametrize("name", CHEAP)
def test_plan_is_byte_identical_to_the_recorded_one(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_NO_CACHE", "1")
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, digests.plan_args(name, out))
    assert result.exit_code == 0, result.output
    assert digests.digest(out / "plan.json", out) == RECORDED[name]
