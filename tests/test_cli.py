"""The `planner` command line: every command's happy path, every user error as a clean message with exit
code 2 (never a traceback), byte-identical outputs, overwrite protection, and a fuzzed `planner report`."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

# torch is imported here, not first inside a CliRunner call, so that its log handlers bind to the real stderr
# rather than to one invocation's captured stream, closed afterwards ("--- Logging error ---").
import pytest
import torch  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.cli._options import DType, parse_model_args, plan_request
from planner.cli.main import app
from planner.cli.validate import read_metrics
from planner.errors import ConfigError
from planner.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny_gpt.py"
GPT = ROOT / "sample_models" / "gpt.py"
CLUSTER = ["--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", "8"]
OUTPUTS = ("plan.json", "timeline.svg", "timeline.trace.json", "train.py", "launch.sh", "launch_multinode.sh",
           "slurm.sbatch")

runner = CliRunner()


def invoke(*args: str | Path, env: dict[str, str] | None = None):
    # A wide layout whatever the caller's terminal: assertions look for whole names and paths.
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "220", **(env or {})})


def ok(result) -> None:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"


def user_error(result, *needles: str) -> str:
    """Exit code 2, one clean message on stderr, no traceback; returns the message."""
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    # The message is the last paragraph on stderr (torch may log warnings of its own before it).
    message = result.stderr[result.stderr.rfind("Error: "):] if "Error: " in result.stderr else ""
    assert message.startswith("Error: ") and message.count("\nError: ") == 0, result.output
    for needle in needles:
        assert needle in message, result.stderr
    return message


@pytest.fixture
def restore_logging():
    """--debug sets up the planner logger with a handler on the (test runner's) stderr: undo it afterwards."""
    import logging

    logger = logging.getLogger("planner")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """One `planner plan` of the tiny GPT on 4 CPU processes, shared by the read-only tests."""
    out = tmp_path_factory.mktemp("plan") / "out"
    ok(invoke("plan", TINY, *CLUSTER, "--out", out, "--quiet"))
    return out


# --- start-up and help ------------------------------------------------------------------------------------


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, planner.cli.main; sys.exit(1 if 'torch' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, "importing planner.cli.main imported torch: `planner --help` is slow\n" + done.stderr


@pytest.mark.parametrize(
    "command",
    [[], ["plan"], ["dry-run"], ["report"], ["emit"], ["validate"], ["profile"], ["hardware"], ["hardware", "list"],
     ["hardware", "show"]],
)
def test_every_command_has_help_with_usage(command):
    result = invoke(*command, "--help")
    ok(result)
    assert "Usage: " in result.output
    if command and command != ["hardware"]:
        assert "Examples:" in result.output
        assert "planner " + " ".join(command) in result.output


def test_version():
    result = invoke("--version")
    ok(result)
    assert result.output.startswith("planner ")


MAIN = """
import atexit, sys
marker = sys.argv.pop(1)
atexit.register(lambda: open(marker, "w").write("ran"))
sys.argv[0] = "planner"
from planner.cli.main import main
main()
"""


def test_the_process_ends_with_the_commands_status_its_output_flushed_and_atexit_run(planned, tmp_path):
    """main() ends the process without the interpreter's teardown (planner.cli.main.exit_now)."""
    marker = tmp_path / "atexit"
    done = subprocess.run([sys.executable, "-c", MAIN, str(marker), "report", str(planned), "--json"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (planned / "plan.json").read_text()  # all of it, flushed before the exit
    assert marker.read_text() == "ran"
    done = subprocess.run([sys.executable, "-c", MAIN, str(marker), "report", str(tmp_path / "none")], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("Error: ") and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-c", MAIN, str(marker), "plan"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "Usage:" in done.stderr  # click's usage error keeps its status


def test_a_profiler_still_writes_its_results(planned, tmp_path):
    """Under a profiler the process exits as Python does, so that cProfile writes its file after main()."""
    out = tmp_path / "profile.out"
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "planner.cli.main", "report",
                           str(planned), "--json"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0


@pytest.mark.parametrize("json_out", [False, True])
def test_a_reader_that_goes_away_ends_the_command_quietly(planned, json_out):
    """`planner report out | head -1`: the pipe closes under rich's output, which exits with status 1; that is
    not the model file calling sys.exit (the message the CLI gives a SystemExit it did not expect). --json ends
    the same way (it said "Cannot write the report to standard output: Broken pipe", status 2)."""
    cmd = [sys.executable, "-m", "planner.cli.main", "report", str(planned), *(["--json"] if json_out else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the report is written: its first write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait() == 1
    assert "sys.exit" not in err and "Traceback" not in err and "Error" not in err, err


def test_usage_errors_keep_clicks_exit_code():
    result = invoke("plan")  # missing MODEL_FILE and required options
    assert result.exit_code == 2
    assert "Usage:" in result.output and "Traceback" not in result.output
    assert invoke("plan", TINY, *CLUSTER, "--zero-stage", "4").exit_code == 2
    assert invoke("no-such-command").exit_code == 2


# --- plan -------------------------------------------------------------------------------------------------


def test_plan_writes_every_file_and_prints_the_report(tmp_path):
    out = tmp_path / "p"
    result = invoke("plan", TINY, *CLUSTER, "--out", out)
    ok(result)
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    for name in ("train.py", "launch.sh"):
        assert os.access(out / name, os.X_OK)
    plan = load_plan(out)
    assert plan.cluster.gpu == "cpu" and plan.parallel.world_size == 4
    assert (out / "plan.json").read_text() == plan.to_json()
    assert (out / "timeline.svg").read_text().startswith("<?xml")
    for heading in ("Plan", "Pipeline stages", "Communication per iteration", "Search", "timeline.svg", "MFU"):
        assert heading in result.stdout
    assert "\x1b[" not in result.stdout  # not a terminal: no colour codes, no animation
    assert result.stderr == ""


def test_plan_is_byte_identical_across_runs(tmp_path, planned):
    again = tmp_path / "again"
    ok(invoke("plan", TINY, *CLUSTER, "--out", again, "--quiet"))
    for name in OUTPUTS:
        first, second = (planned / name).read_text(), (again / name).read_text()
        diff = "".join(difflib.unified_diff(first.splitlines(True), second.splitlines(True), n=1))
        assert first == second, f"{name} differs between two runs:\n{diff[:3000]}"


def test_plan_overwrites_an_identical_plan_but_not_a_different_one(tmp_path):
    out = tmp_path / "p"
    ok(invoke("plan", TINY, *CLUSTER, "--out", out, "-q"))
    first = (out / "plan.json").read_bytes()
    ok(invoke("plan", TINY, *CLUSTER, "--out", out, "-q"))  # same content: fine

    result = invoke("plan", TINY, *CLUSTER, "--seed", "7", "--out", out, "-q")
    user_error(result, "different plan", "--force")
    assert (out / "plan.json").read_bytes() == first  # nothing was written

    ok(invoke("plan", TINY, *CLUSTER, "--seed", "7", "--out", out, "-q", "--force"))
    assert load_plan(out).training.seed == 7


def test_plan_timestamp_is_recorded_and_does_not_count_as_a_different_plan(tmp_path):
    out = tmp_path / "p"
    ok(invoke("plan", TINY, *CLUSTER, "--out", out, "-q"))
    ok(invoke("plan", TINY, *CLUSTER, "--out", out, "-q", "--timestamp"))
    assert load_plan(out).created_at


def test_plan_refuses_to_overwrite_someone_elses_files(tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / "train.py").write_text("print('mine')\n")
    user_error(invoke("plan", TINY, *CLUSTER, "--out", out, "-q"), "train.py", "--force")
    assert (out / "train.py").read_text() == "print('mine')\n"
    assert not (out / "plan.json").exists()


def test_plan_out_must_be_a_folder(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    user_error(invoke("plan", TINY, *CLUSTER, "--out", target, "-q"), "not a folder")


def test_plan_json_prints_the_plan_and_still_writes_files(tmp_path):
    out = tmp_path / "p"
    result = invoke("plan", TINY, *CLUSTER, "--out", out, "--json")
    ok(result)
    assert result.stdout == (out / "plan.json").read_text()
    assert json.loads(result.stdout)["schema_version"] == 1


def test_plan_quiet_prints_nothing(tmp_path):
    for args in (["plan", TINY, *CLUSTER, "--out", tmp_path / "a", "--quiet"],
                 ["--quiet", "plan", TINY, *CLUSTER, "--out", tmp_path / "b"]):
        result = invoke(*args)
        ok(result)
        assert result.output == ""


def test_plan_pins_reach_the_plan(tmp_path):
    out = tmp_path / "p"
    ok(invoke(
        "plan", TINY, *CLUSTER, "--out", out, "-q", "--dp", "2", "--pp", "2", "--tp", "1", "--schedule", "gpipe",
        "--micro-batch-size", "1", "--zero-stage", "0", "--recompute", "full", "--no-sequence-parallel",
        "--steps", "3", "--lr", "0.01", "--seed", "5", "--dtype", "fp32",
    ))
    plan = load_plan(out)
    p = plan.parallel
    assert (p.dp, p.tp, p.pp, p.micro_batch_size, p.schedule, p.zero_stage) == (2, 1, 2, 1, "gpipe", 0)
    assert p.num_micro_batches == 4 and not p.sequence_parallel
    assert {s.recompute for s in plan.stages} == {"full"}
    assert (plan.training.steps, plan.training.lr, plan.training.seed) == (3, 0.01, 5)
    assert plan.model.dtype == "fp32"


def test_plan_model_args_are_python_literals(tmp_path):
    out = tmp_path / "p"
    ok(invoke("plan", TINY, *CLUSTER, "--out", out, "-q", "-a", "layers=3", "--model-arg", "hidden=64"))
    plan = load_plan(out)
    assert plan.model.model_args == {"layers": 3, "hidden": 64}
    assert sum(u.startswith("blocks.") for s in plan.stages for u in s.units) == 3


def test_parse_model_args():
    parsed = parse_model_args(["n=4", "lr=1e-3", "name=abc", "q='x'", "xs=[1, 2]", "eq=a=b", "flag=True", "e="])
    assert parsed == {"n": 4, "lr": 1e-3, "name": "abc", "q": "x", "xs": [1, 2], "eq": "a=b", "flag": True, "e": ""}
    assert parse_model_args(None) == {}
    for bad in ("novalue", "=3", "1x=2", "a b=1"):
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_model_args([bad])


def _request(**changes):
    options = dict(
        gpu="cpu", nodes=1, gpus_per_node=4, global_batch_size=8, dp=None, tp=None, pp=None, virtual_stages=None,
        micro_batch_size=None, schedule=None, zero_stage=None, recompute=None, sequence_parallel=None,
        dtype=DType.bf16, build_fn="build_model", inputs_fn="example_inputs", loss_fn=None, top_k=5,
        time_limit=None, no_overlap=False, seed=0, lr=1e-4, steps=10,
    )
    options.update(changes)
    return plan_request(TINY, ["layers=2"], **options)


def test_plan_request_maps_options_to_pins_and_defaults():
    from planner.pipeline import PlanRequest

    request = _request()
    assert request.pins == {} and request.model_args == {"layers": 2} and request.overlap_dp_comm
    assert request.time_limit == PlanRequest.model_fields["time_limit"].default  # unset: the library's default
    assert _request(time_limit=0.0).time_limit is None  # 0: no limit
    assert _request(time_limit=3.5).time_limit == 3.5
    pinned = _request(dp=2, tp=1, pp=2, virtual_stages=2, micro_batch_size=1, schedule="interleaved-1f1b",
                      zero_stage=0, recompute="selective", sequence_parallel=False, no_overlap=True)
    assert pinned.pins == {
        "dp": 2, "tp": 1, "pp": 2, "virtual_stages": 2, "micro_batch_size": 1, "schedule": "interleaved-1f1b",
        "zero_stage": 0, "recompute": "selective", "sequence_parallel": False,
    }
    assert not pinned.overlap_dp_comm


# --- the errors users make --------------------------------------------------------------------------------

UNTRACEABLE = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def build_model(**_):
    return Branchy()


def example_inputs(batch_size, **_):
    return (torch.randn(batch_size, 8),)
'''

NO_BUILD = '''
import torch


def example_inputs(batch_size, **_):
    return (torch.randn(batch_size, 8),)
'''


def _error_case(name: str, tmp: Path) -> tuple[list, tuple[str, ...]]:
    """(arguments after `plan`, words the message must contain) for one kind of mistake."""
    if name == "missing model file":
        return [tmp / "nope.py", *CLUSTER], ("nope.py", "does not exist")
    if name == "no build_model":
        (tmp / "nobuild.py").write_text(NO_BUILD)
        return [tmp / "nobuild.py", *CLUSTER], ("build_model", "--build-fn")
    if name == "bad model arg":
        return [TINY, *CLUSTER, "--model-arg", "layers"], ("KEY=VALUE",)
    if name == "untraceable model":
        (tmp / "branchy.py").write_text(UNTRACEABLE)
        return [tmp / "branchy.py", *CLUSTER], ("line 12", "x.sum() > 0")
    if name == "unknown gpu":
        return [TINY, "--gpu", "h900-imaginary", "--global-batch-size", "8"], ("Unknown hardware spec", "h900")
    if name == "malformed spec yaml":
        (tmp / "bad.yaml").write_text("kind: gpu\nname: broken\npeak_tflops: [1, 2\n")
        return [TINY, "--gpu", tmp / "bad.yaml", "--global-batch-size", "8"], ("bad.yaml", "not valid YAML")
    if name == "invalid spec yaml":
        (tmp / "half.yaml").write_text("kind: gpu\nname: half\ndisplay_name: Half\n")
        return [TINY, "--gpu", tmp / "half.yaml", "--global-batch-size", "8"], ("half.yaml", "not a valid GPU spec")
    if name == "impossible degrees":
        return [TINY, *CLUSTER, "--tp", "3"], ("--tp 3", "divide")
    if name == "degrees do not multiply out":
        return [TINY, *CLUSTER, "--dp", "2", "--tp", "1", "--pp", "1"], ("--dp 2",)
    if name == "batch not divisible":
        return [TINY, "--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", "6", "--dp", "4"], ("divisible",)
    if name == "nothing fits":
        return [GPT, "--model-arg", "preset=gpt3-175b", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "1",
                "--global-batch-size", "8"], ("does not fit", "GiB")
    raise AssertionError(name)


ERROR_CASES = [
    "missing model file", "no build_model", "bad model arg", "untraceable model", "unknown gpu",
    "malformed spec yaml", "invalid spec yaml", "impossible degrees", "degrees do not multiply out",
    "batch not divisible", "nothing fits",
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_user_errors_are_one_clean_message_and_exit_2(case, tmp_path):
    args, needles = _error_case(case, tmp_path)
    out = tmp_path / "out"
    user_error(invoke("plan", *args, "--out", out), *needles)
    assert not out.exists()  # nothing is written when planning fails


@pytest.mark.parametrize("case", ["missing model file", "unknown gpu", "impossible degrees"])
def test_dry_run_reports_the_same_errors(case, tmp_path):
    args, needles = _error_case(case, tmp_path)
    user_error(invoke("dry-run", *args), *needles)


def test_internal_errors_exit_1_and_show_the_traceback_only_with_debug(tmp_path, monkeypatch, restore_logging):
    import planner.pipeline

    def broken(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(planner.pipeline, "plan_model", broken)
    result = invoke("plan", TINY, *CLUSTER, "--out", tmp_path / "p")
    assert result.exit_code == 1
    assert "Internal error: RuntimeError: boom" in result.stderr and "--debug" in result.stderr
    assert "Traceback" not in result.output

    result = invoke("--debug", "plan", TINY, *CLUSTER, "--out", tmp_path / "p")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "boom" in result.stderr


def test_debug_shows_the_traceback_of_a_user_error_too(tmp_path, restore_logging):
    result = invoke("--debug", "plan", tmp_path / "nope.py", *CLUSTER)
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "ModelLoadError" in result.stderr


# --- dry-run ----------------------------------------------------------------------------------------------


def test_dry_run_prints_the_report_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("dry-run", TINY, *CLUSTER, "--pp", "2", "--schedule", "1f1b")
    ok(result)
    assert "Pipeline stages" in result.stdout and "1f1b" in result.stdout
    assert "timeline.svg" not in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_dry_run_json_is_the_plan_that_plan_writes(planned):
    result = invoke("dry-run", TINY, *CLUSTER, "--json")
    ok(result)
    assert result.stdout == (planned / "plan.json").read_text()


# --- report -----------------------------------------------------------------------------------------------


def test_report_of_a_folder_and_of_a_file(planned):
    for target in (planned, planned / "plan.json"):
        result = invoke("report", target)
        ok(result)
        for heading in ("Plan", "Pipeline stages", "Communication per iteration", "Search"):
            assert heading in result.stdout
        assert str(planned / "timeline.svg") in result.stdout


def test_report_json(planned):
    result = invoke("report", planned, "--json")
    ok(result)
    assert result.stdout == (planned / "plan.json").read_text()


def test_report_refuses_missing_old_and_broken_plans(tmp_path, planned):
    user_error(invoke("report", tmp_path), "No plan found")
    old = json.loads((planned / "plan.json").read_text())
    old["schema_version"] = 0
    (tmp_path / "plan.json").write_text(json.dumps(old))
    user_error(invoke("report", tmp_path), "schema_version", "Regenerate")
    (tmp_path / "plan.json").write_text("{not json")
    user_error(invoke("report", tmp_path), "not valid JSON")


def _paths(value, prefix=()):
    """Every key path into a JSON document (dict keys and list indices)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


_DELETE = object()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def broken_plans(draw, valid: dict) -> bytes:
    """A valid plan with a few fields replaced or deleted, or JSON of the wrong shape, or junk bytes."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    doc = json.loads(json.dumps(valid))
    paths = [p for p in _paths(doc) if p]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            value = draw(st.just(_DELETE) | json_values)
            if value is _DELETE:
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or retyped this path
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def valid_plan(planned) -> dict:
    return json.loads((planned / "plan.json").read_text())


def test_report_never_shows_a_traceback_on_malformed_plans(valid_plan, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=broken_plans(valid_plan))
    def check(data: bytes):
        (folder / "plan.json").write_bytes(data)
        result = invoke("report", folder / "plan.json")
        assert "Traceback" not in result.output
        assert result.exit_code in (0, 2), f"exit {result.exit_code}: {result.output}\n{result.exception!r}"
        if result.exit_code == 2:
            assert result.stderr.startswith("Error: ") and result.stdout == ""

    check()


# --- emit -------------------------------------------------------------------------------------------------


def test_emit_renders_the_same_scripts_as_plan(planned, tmp_path):
    out = tmp_path / "e"
    result = invoke("emit", planned / "plan.json", "--out", out)
    ok(result)
    for name in ("plan.json", "train.py", "launch.sh", "launch_multinode.sh", "slurm.sbatch"):
        assert (out / name).read_bytes() == (planned / name).read_bytes(), name
    assert os.access(out / "launch.sh", os.X_OK)
    runtime = sorted(p.name for p in (planned / "planner_runtime").glob("*.py"))
    for name in runtime:
        assert (out / "planner_runtime" / name).read_bytes() == (planned / "planner_runtime" / name).read_bytes()
    # the model file's copy (with the configs beside it): the same files
    model = sorted(p.relative_to(planned) for p in (planned / "model").rglob("*") if p.is_file())
    assert model and all((out / p).read_bytes() == (planned / p).read_bytes() for p in model)
    assert runtime and f"Wrote {5 + len(runtime) + len(model)} files" in result.stdout


def test_emit_keeps_other_content_unless_forced(planned, tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "launch.sh").write_text("#!/bin/sh\necho mine\n")
    user_error(invoke("emit", planned, "--out", out), "launch.sh", "--force")
    assert (out / "launch.sh").read_text() == "#!/bin/sh\necho mine\n"
    ok(invoke("emit", planned, "--out", out, "--force", "-q"))
    assert (out / "launch.sh").read_bytes() == (planned / "launch.sh").read_bytes()


def test_emit_of_a_broken_plan_is_a_clean_error(tmp_path):
    (tmp_path / "plan.json").write_text("[]")
    user_error(invoke("emit", tmp_path / "plan.json", "--out", tmp_path / "e"), "plan.json")
    assert not (tmp_path / "e").exists()


# --- validate ---------------------------------------------------------------------------------------------


def _fake_run(folder: Path, body: str) -> None:
    """Replace launch.sh with a script that stands in for torchrun (same arguments: --steps N --metrics P)."""
    (folder / "launch.sh").write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + textwrap.dedent(body))


FAKE_METRICS = """
METRICS="$4"
cat > "$METRICS" <<EOF
{"layout": {"world_size": 4}, "memory_kind": "cpu_max_rss",
 "ranks": [{"rank": 0, "pp": 0, "peak_memory_bytes": 1073741824},
           {"rank": 1, "pp": 0, "peak_memory_bytes": 2147483648}],
 "steps": [{"step": 1, "loss": 4.5, "step_time_s": 9.0},
           {"step": 2, "loss": 4.0, "step_time_s": 0.25},
           {"step": 3, "loss": 3.5, "step_time_s": 0.75}]}
EOF
echo "step 3 loss 3.5"
"""


@pytest.fixture
def plan_copy(planned, tmp_path) -> Path:
    folder = tmp_path / "copy"
    ok(invoke("emit", planned, "--out", folder, "-q"))
    return folder


def test_validate_compares_measured_with_predicted(plan_copy):
    _fake_run(plan_copy, FAKE_METRICS)
    result = invoke("validate", plan_copy, "--steps", "3")
    ok(result)
    assert "Predicted vs measured over 2 step(s)" in result.stdout
    assert "500.0 ms" in result.stdout  # mean of steps 2 and 3; the warm-up step (9 s) is left out
    assert "2.00" in result.stdout  # rank 1's 2 GiB
    assert "resident set" in result.stdout
    assert "step 3 loss 3.5" in (plan_copy / "validate.log").read_text()

    result = invoke("validate", plan_copy, "--steps", "3", "--json")
    ok(result)
    doc = json.loads(result.stdout)
    assert doc["measured"]["step_times_s"] == [0.25, 0.75]
    assert doc["measured"]["iteration_time_s"] == 0.5
    assert doc["measured"]["peak_memory_bytes"] == {"0": 1073741824, "1": 2147483648}
    assert doc["predicted"]["iteration_time_s"] == load_plan(plan_copy).predicted.iteration_time_s


def test_validate_reports_a_failed_run_with_its_log(plan_copy):
    _fake_run(plan_copy, 'echo "CUDA out of memory (pretend)" >&2\nexit 3\n')
    user_error(invoke("validate", plan_copy), "exited with 3", "out of memory (pretend)")


def test_validate_stops_a_run_past_its_timeout(plan_copy):
    _fake_run(plan_copy, "sleep 60\n")
    user_error(invoke("validate", plan_copy, "--timeout", "1"), "did not finish within 1 s", "--timeout")


def test_validate_refuses_a_run_without_metrics(plan_copy):
    _fake_run(plan_copy, "true\n")
    user_error(invoke("validate", plan_copy), "wrote no metrics.json")


def test_validate_needs_the_scripts_and_two_steps(plan_copy, tmp_path):
    (plan_copy / "launch.sh").unlink()
    user_error(invoke("validate", plan_copy), "launch.sh", "planner emit")
    user_error(invoke("validate", tmp_path / "nowhere"), "not a folder")
    assert invoke("validate", plan_copy, "--steps", "1").exit_code == 2  # click range check


def test_read_metrics_rejects_malformed_files(tmp_path):
    from planner.cli.validate import RunError

    path = tmp_path / "metrics.json"
    for text in ("{", "[]", '{"steps": [{"loss": 1}]}', '{"steps": [{"loss": 1, "step_time_s": 0.1}]}'):
        path.write_text(text)
        with pytest.raises(RunError):
            read_metrics(path)


@pytest.mark.e2e
def test_validate_runs_the_generated_script_with_torchrun(tmp_path):
    out = tmp_path / "p"
    ok(invoke("plan", TINY, "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "4", "--out", out, "-q"))
    result = invoke("validate", out, "--steps", "3", "--timeout", "600")
    ok(result)
    assert "Predicted vs measured over 2 step(s)" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["steps"]) == 3 and len(metrics["ranks"]) == 2


# --- hardware ---------------------------------------------------------------------------------------------


def test_hardware_list():
    result = invoke("hardware", "list")
    ok(result)
    for name in ("a100-sxm4-80gb", "h100-sxm5-80gb", "cpu", "dgx-h100"):
        assert name in result.stdout
    rows = json.loads(invoke("hardware", "list", "--json").stdout)
    by_name = {r["name"]: r for r in rows}
    assert by_name["dgx-h100"]["kind"] == "cluster"
    assert by_name["dgx-h100"]["bf16_tflops"] == by_name["h100-sxm5-80gb"]["bf16_tflops"]


def test_hardware_show_by_alias_and_path(tmp_path):
    result = invoke("hardware", "show", "h100-sxm-80gb")
    ok(result)
    assert "h100-sxm5-80gb" in result.stdout and "sources." in result.stdout
    doc = json.loads(invoke("hardware", "show", ROOT / "hardware_specs" / "cpu.yaml", "--json").stdout)
    assert doc["name"] == "cpu" and doc["sources"]


def test_hardware_show_errors(tmp_path):
    user_error(invoke("hardware", "show", "h900-imaginary"), "Unknown hardware spec")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    user_error(invoke("hardware", "show", tmp_path / "bad.yaml"), "not valid YAML")


# --- profile ----------------------------------------------------------------------------------------------


def test_profile_times_each_distinct_unit(tmp_path):
    pytest.importorskip("planner.measure.profile")
    env = {"PLANNER_CACHE_DIR": str(tmp_path / "cache")}
    result = invoke("profile", TINY, "--repeats", "1", "--warmup", "0", "--json", env=env)
    ok(result)
    doc = json.loads(result.stdout)
    assert doc["device"] == "cpu" and doc["units"]
    assert all(u["fwd_s"] > 0 and u["bwd_s"] > 0 for u in doc["units"])
    result = invoke("profile", TINY, "--repeats", "1", "--warmup", "0", env=env)
    ok(result)
    assert "Unit times" in result.stdout and "from cache" in result.stdout


def test_profile_errors(tmp_path):
    user_error(invoke("profile", tmp_path / "nope.py"), "does not exist")
    user_error(invoke("profile", TINY, "-a", "oops"), "KEY=VALUE")


def test_plan_measure_uses_measured_unit_times(tmp_path, monkeypatch):
    """--measure profiles each distinct unit on this machine; the plan and its stages say `measured`. (tp 1
    pinned: unit times are measured unsharded, so a tp 2 plan, which noisy measurements on a loaded machine
    can rank first, is estimated.)"""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "measured"
    result = invoke(
        "plan", ROOT / "sample_models" / "gpt.py", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2",
        "--global-batch-size", "4", "--tp", "1", "--measure", "--out", out, "--quiet",
    )
    ok(result)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["predicted"]["source"] == "measured"
    assert {s["source"] for s in plan["stages"]} == {"measured"}


_yaml_text = st.one_of(
    st.text(max_size=300),
    st.dictionaries(
        st.sampled_from(["kind", "name", "display_name", "vendor", "peak_tflops", "memory_gib", "topology", "sources",
                         "memory_bandwidth_gbps", "gpu", "efficiency"]),
        st.one_of(st.none(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=20),
                  st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
        max_size=8,
    ).map(lambda d: __import__("yaml").safe_dump(d)),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_yaml_text)
def test_fuzzed_spec_yaml_is_a_clean_user_error(tmp_path, text):
    """Malformed spec YAML given as --gpu / hardware show: exit 2 with a message, never a traceback."""
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    result = invoke("hardware", "show", path)
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
