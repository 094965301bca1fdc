"""The analysis cache: a re-plan of the same model reads the graph instead of tracing, gives the same plan,
misses when anything the analysis read changes, ignores corrupt entries, and is bypassed by PLANNER_NO_CACHE.
The plan-time check is skipped only when the same check passed before."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli.main import app
from planner.model import cache
from planner.pipeline import PlanRequest, analyse, plan_model

ROOT = Path(__file__).resolve().parents[1]
ARGS = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128}


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLANNER_NO_CACHE", raising=False)
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(ROOT / "sample_models" / "gpt.py", folder / "gpt.py")
    return folder / "gpt.py"


def _request(path, **args):
    return PlanRequest(model_path=str(path), model_args={**ARGS, **args}, gpu="a100-sxm4-80gb", nodes=1,
                       global_batch_size=8)


def _traced(monkeypatch) -> list[int]:
    from planner.model import analysis

    calls: list[int] = []
    real = analysis.analyse_model
    monkeypatch.setattr(analysis, "analyse_model", lambda loaded: calls.append(1) or real(loaded))
    return calls


def test_a_replan_reads_the_cache_and_plans_the_same(model, monkeypatch):
    calls = _traced(monkeypatch)
    first = analyse(_request(model))
    second = analyse(_request(model))
    assert calls == [1] and second == first
    plan_a = plan_model(_request(model), first)[0]
    plan_b = plan_model(_request(model), second)[0]
    assert plan_a.model_dump_json() == plan_b.model_dump_json()


def test_what_the_analysis_read_is_in_the_key(model, monkeypatch):
    calls = _traced(monkeypatch)
    analyse(_request(model))
    analyse(_request(model, layers=3))  # another --model-arg
    analyse(_request(model).model_copy(update={"dtype": "fp32"}))
    (model.parent / "layers.py").write_text("X = 1\n")  # a file beside the model (a sibling import)
    analyse(_request(model))
    model.write_text(model.read_text() + "\n# edited\n")
    analyse(_request(model))
    assert len(calls) == 5


def test_corrupt_entries_are_ignored_and_rewritten(model, monkeypatch):
    calls = _traced(monkeypatch)
    graph = analyse(_request(model))
    (entry,) = cache.analysis_cache_dir().glob("*.json")
    for junk in ("{not json", json.dumps({"schema": 1, "key": entry.stem, "graph": {"units": 3}}), "[]"):
        entry.write_text(junk)
        assert analyse(_request(model)) == graph
    assert len(calls) == 4
    assert analyse(_request(model)) == graph and len(calls) == 4  # rewritten by the last miss


def test_no_cache_env_and_argument_bypass(model, monkeypatch):
    calls = _traced(monkeypatch)
    analyse(_request(model), cache=False)
    assert not cache.analysis_cache_dir().exists()
    monkeypatch.setenv("PLANNER_NO_CACHE", "1")
    analyse(_request(model))
    analyse(_request(model))
    assert len(calls) == 3 and not cache.analysis_cache_dir().exists()


def test_the_check_is_skipped_only_after_it_passed(model, monkeypatch, tmp_path):
    import planner.codegen.check as codegen_check

    checks: list[int] = []
    real = codegen_check.check_plan_runs
    monkeypatch.setattr(codegen_check, "check_plan_runs", lambda plan: checks.append(1) or real(plan))
    monkeypatch.setenv("PLANNER_CHECK_WORKER", "0")  # counted in this process: no worker checks it
    base = ["plan", str(model), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "4",
            "--pp", "2", "--quiet", "--force"]
    for k, v in ARGS.items():
        base += ["--model-arg", f"{k}={v}"]
    for i in range(2):
        result = CliRunner().invoke(app, base + ["--out", str(tmp_path / f"out{i}")])
        assert result.exit_code == 0, result.output
    assert checks == [1]
    assert (tmp_path / "out0" / "plan.json").read_text() == (tmp_path / "out1" / "plan.json").read_text()
    result = CliRunner().invoke(app, base + ["--out", str(tmp_path / "out2"), "--dp", "2", "--pp", "1"])
    assert result.exit_code == 0, result.output
    assert checks == [1, 1]  # another plan: checked


def test_the_same_file_elsewhere_hits_with_its_own_path(model, monkeypatch, tmp_path):
    """A source compiled into each plan directory (hf:NAME) is the same file at another path: it hits, and
    the graph names the path it was loaded from."""
    calls = _traced(monkeypatch)
    first = analyse(_request(model))
    other = tmp_path / "elsewhere"
    shutil.copytree(model.parent, other)
    moved = analyse(_request(other / "gpt.py"))
    assert calls == [1]
    assert moved.source.path == str((other / "gpt.py").resolve())
    assert moved.model_copy(update={"source": first.source}) == first


def test_the_planners_own_cache_files_are_not_the_models_reads(model, tmp_path):
    """The analysis cache is read and written while the plan records what the model read (cli/plan.py wraps the
    analysis in a recording): its files are the planner's, so they are neither reads nor writes of the model."""
    from planner.model.reads import recording

    for _ in range(2):  # a miss (written), then a hit (read)
        with recording(model.parent) as during:
            analyse(_request(model))
        assert during.complete, during.why_incomplete
        assert not [f for f in during.files if f.startswith(str(tmp_path / "cache"))], during.files


def test_a_module_loaded_from_its_cached_bytecode_is_recorded_as_its_source(tmp_path):
    """tests/fixtures/models/finetune_gpt.py runs sample_models/gpt.py by spec_from_file_location and exec_module.
    Where Python has cached that file's bytecode (__pycache__, written by any earlier run), the import opens the
    .pyc and never the source; the source is what the model read, and what the copy beside the scripts needs
    (a second plan in one process, where the module's name is not new, lost it: the e2e fine-tune run failed)."""
    import py_compile

    from planner.model.reads import recording
    from planner.runtime.model import load_model_file

    base = tmp_path / "lib" / "base_model.py"
    base.parent.mkdir()
    base.write_text("WIDTH = 8\n")
    py_compile.compile(str(base), cfile=importlib.util.cache_from_source(str(base)), doraise=True)
    model = tmp_path / "proj" / "net.py"
    model.parent.mkdir()
    model.write_text(
        "import importlib.util, sys\n"
        f"_spec = importlib.util.spec_from_file_location('reads_test_base', {str(base)!r})\n"
        "base = importlib.util.module_from_spec(_spec)\n"
        "sys.modules[_spec.name] = base\n"
        "_spec.loader.exec_module(base)\n"
    )
    load_model_file(str(model))  # an earlier plan in this process: the base module's name is taken already
    with recording(model.parent) as during:
        load_model_file(str(model))
    assert str(base) in during.files, sorted(during.files)
    assert not [f for f in during.files if f.endswith(".pyc")], sorted(during.files)
