"""Help grouped by the options' panels, shell completion offered, and --config FILE (YAML) for plan / dry-run."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from planner.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "sample_models" / "gpt.py")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_help_shows_the_panels_and_each_option_once():
    text = invoke("plan", "--help").output
    headings = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[A-Z][^ ].*:", line)]
    assert headings[0] == "Arguments" and headings[-1] == "Options"  # options without a panel come last
    for panel in ("Model", "Cluster and batch", "Search", "Output"):
        assert panel in headings, headings
    for option in ("--gpu", "--global-batch-size", "--tp", "--config", "--revision", "--out"):
        assert len(re.findall(rf"^\s+(?:-\w, )?{option}\b", text, re.M)) == 1, option


def test_shell_completion_is_offered():
    text = invoke("--help").output
    assert "--install-completion" in text and "--show-completion" in text


def test_config_file_sets_options_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("gpu: cpu\ngpus-per-node: 4\nglobal_batch_size: 8\nmodel-arg: [layers=2]\ndp: 2\n")
    result = invoke("dry-run", MODEL, "--config", str(config), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["parallel"]["dp"] == 2 and plan["parallel"]["global_batch_size"] == 8
    assert plan["model"]["model_args"] == {"layers": 2}
    result = invoke("dry-run", MODEL, "--config", str(config), "--dp", "4", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["parallel"]["dp"] == 4


def test_config_file_mistakes_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpuz: cpu\n")
    result = invoke("plan", MODEL, "--config", str(bad))
    assert result.exit_code == 2 and "'gpuz' is not an option of `planner plan`" in result.output
    assert "global-batch-size" in result.output
    bad.write_text("- gpu\n")
    result = invoke("dry-run", MODEL, "--config", str(bad))
    assert result.exit_code == 2 and "not a mapping" in result.output
    bad.write_text("gpu: [\n")
    result = invoke("dry-run", MODEL, "--config", str(bad))
    assert result.exit_code == 2 and "cannot be read as YAML" in result.output
    result = invoke("dry-run", MODEL, "--config", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2 and "cannot be read" in result.output


def test_shell_completion_completes_commands_and_choices():
    """The script --install-completion installs asks the program itself (click's _PLANNER_COMPLETE protocol)."""

    def complete(words: str) -> list[str]:
        env = {"_PLANNER_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
        result = CliRunner().invoke(app, [], env=env, prog_name="planner")
        assert result.exit_code == 0, result.output
        return result.output.split()

    assert complete("planner dry") == ["dry-run"]
    assert complete("planner plan model.py --schedule z") == ["zero-bubble"]
    assert complete("planner plan model.py --recompute s") == ["selective"]


def test_config_file_sets_flags_and_choices(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "gpu: cpu\ngpus-per-node: 4\nglobal-batch-size: 8\nmodel-arg: [layers=2]\npp: 2\nschedule: gpipe\n"
        "recompute: selective\nsequence-parallel: false\nno-overlap: true\ndtype: fp32\ntop-k: 1\njson: true\n"
    )
    result = invoke("dry-run", MODEL, "--config", str(config))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["parallel"]["pp"] == 2 and plan["parallel"]["schedule"] == "gpipe"
    assert plan["model"]["dtype"] == "fp32" and len(plan["alternatives"]) == 1
    assert [stage["recompute"] for stage in plan["stages"]] == ["selective", "selective"]
    config.write_text("gpu: cpu\nglobal-batch-size: 8\nschedule: gpipes\n")
    result = invoke("dry-run", MODEL, "--config", str(config))
    assert result.exit_code == 2 and "'gpipes' is not one of" in result.output
