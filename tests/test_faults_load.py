"""Model files that exit, hang, signal, raise or print, at import or in build_model / example_inputs / forward:
each is one clean user error (exit 2) naming the file and line, or (printing) a normal plan with clean --json.
Also the guard's own contract (everything restored afterwards) and the plan-time checks of what the
generated script will need (input dtypes, model-arg names, optimizer settings)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch  # noqa: F401 - see tests/test_cli.py: torch's log handlers bind to the real stderr
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import ModelLoadError
from planner.model.guard import user_code

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ["--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "4"]

MODEL = '''\
import torch
from torch import nn

{at_import}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        {in_forward}
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def build_model(**kwargs):
    {in_build}
    return Net()


def example_inputs(batch_size, **kwargs):
    {in_inputs}
    return (torch.randn(batch_size, 8),)
'''

ACTIONS = {
    "exit0": ("import sys; sys.exit(0)", "called sys.exit(0)"),
    "exit3": ("import sys; sys.exit(3)", "called sys.exit(3)"),
    "exit_str": ("import sys; sys.exit('bye')", "called sys.exit('bye')"),
    "builtin_exit": ("exit(5)", "called sys.exit(5)"),
    "os_exit": ("import os; os._exit(0)", "called os._exit(0)"),
    "sigterm": ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", "received signal SIGTERM"),
    "sigusr1": ("import signal; signal.raise_signal(signal.SIGUSR1)", "received signal SIGUSR1"),
    "keyboard": ("raise KeyboardInterrupt", "raised KeyboardInterrupt"),
    "hang": ("while True: pass", "time limit"),
    "sleep": ("import time; time.sleep(3600)", "time limit"),
    "raise": ("raise ValueError('boom')", "ValueError"),
    "print": ("print('hello from the model'); print('{\"not\": \"json\"}')", None),
    # issue 28: what the code does to the process's cwd and stdout is undone, and --json stays one document
    "chdir": ("import os; os.chdir('/')", None),
    "fd1_write": ("import os; os.write(1, b'{raw fd 1')", None),
    "fd1_close": ("import os; os.close(1)", None),
    "stdout_close": ("import sys; sys.stdout.close()", None),
}
PLACES = ("at_import", "in_build", "in_inputs", "in_forward")

runner = CliRunner()


def model_file(tmp_path: Path, place: str, code: str) -> Path:
    holes = dict.fromkeys(PLACES, "pass")
    holes[place] = code
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(**holes))
    return path


def _line_of(path: Path, code: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if code in line)


@pytest.mark.parametrize(("place", "action"), list(itertools.product(PLACES, ACTIONS)))
def test_fuzz_model_files(tmp_path, place, action):
    """Every place x every misbehaviour: exit 2 with the file and line, or (print) a clean JSON plan."""
    code, needle = ACTIONS[action]
    path = model_file(tmp_path, place, code)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGUSR1)}
    exit_before = os._exit
    cwd, stdout_before = Path.cwd(), os.fstat(1)
    # A short limit only where the code hangs (it covers the planner's tracing too, slow on a busy machine).
    limit = "3" if needle == "time limit" else "600"
    result = runner.invoke(
        app, ["plan", str(path), *CLUSTER, "--out", str(tmp_path / "out"), "--json", "--load-timeout", limit],
    )
    # Whatever happened, the process is as it was: handlers, timer and os._exit back in place.
    assert {s: signal.getsignal(s) for s in before} == before
    assert os._exit is exit_before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert Path.cwd() == cwd and os.path.samestat(os.fstat(1), stdout_before)  # cwd and fd 1 as they were
    if needle is None:
        assert result.exit_code == 0, result.output
        json.loads(result.stdout)  # the model's prints went to stderr, not into the plan document
        if action == "print":
            assert "hello from the model" in result.stderr
        return
    assert result.exit_code == 2, f"{result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    message = result.stderr[result.stderr.rfind("Error: "):]
    assert needle in message
    assert f"model.py, line {_line_of(path, code.split(';')[-1].strip()[:12])}" in message
    assert not (tmp_path / "out").exists()


MODEL_KINDS = {
    "script_module": ("return torch.jit.script(Net())", "TorchScript"),
    "lazy": ("return nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(8))", "lazy modules"),
}


@pytest.mark.parametrize("kind", sorted(MODEL_KINDS))
def test_fuzz_models_the_planner_cannot_take_apart(tmp_path, kind):
    """build_model returning what cannot be traced and split (issue 28): one paragraph, exit 2, no file."""
    code, needle = MODEL_KINDS[kind]
    path = model_file(tmp_path, "in_build", code)
    result = runner.invoke(app, ["plan", str(path), *CLUSTER, "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 2, f"{result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output and needle in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("code", ["import os; os._exit(0)", "import sys; sys.exit(0)", "while True: pass"])
def test_real_process_exit_is_a_user_error(tmp_path, code):
    """In a real `planner` process (not CliRunner) os._exit / sys.exit / a hang still give exit 2."""
    path = model_file(tmp_path, "at_import", code)
    proc = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "plan", str(path), *CLUSTER, "--out", str(tmp_path / "out"),
         "--load-timeout", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "model.py, line 4" in proc.stderr and "Traceback" not in proc.stderr


def test_guard_restores_state_and_nests():
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ModelLoadError, match="outer.*time limit|inner.*time limit"):
        with user_code(__file__, "outer", 0.3):
            with user_code(__file__, "inner", 100.0):  # the outer limit holds inside
                while True:
                    pass
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    # Ordinary exceptions pass through unchanged for the caller to word.
    with pytest.raises(ZeroDivisionError):
        with user_code(__file__, "x"):
            1 / 0  # noqa: B018
    # A handler the user installs does not outlive the guarded code.
    with user_code(__file__, "x"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) is handler


def test_real_ctrl_c_still_interrupts():
    with pytest.raises(KeyboardInterrupt):
        with user_code(__file__, "x"):
            signal.raise_signal(signal.SIGINT)


def test_bad_time_limit_is_refused():
    with pytest.raises(ModelLoadError, match="non-negative"):
        with user_code(__file__, "x", float("nan")):
            pass


# --- plan-time checks of what the script will need -------------------------------------------------------


def _plan(tmp_path: Path, model: str, *extra: str):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(model))
    return runner.invoke(app, ["plan", str(path), *CLUSTER, "--out", str(tmp_path / "out"), "-q", *extra])


def _message(result) -> str:
    assert result.exit_code == 2, f"{result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    return result.stderr[result.stderr.rfind("Error: "):]


NET = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, layers=2, width=8):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x
"""

INT_TO_LINEAR = NET + """
    def build_model(**kw):
        return Net()

    def example_inputs(batch_size, **kw):
        return (torch.randint(0, 4, (batch_size, 8)),)
"""


def test_int_input_fed_to_linear(tmp_path):
    message = _message(_plan(tmp_path, INT_TO_LINEAR))
    assert "input 0 of example_inputs()" in message and "int64" in message
    assert "blocks.0 (Linear)" in message and "floating-point" in message


def test_int_tokens_into_embedding_pass(tmp_path):
    result = runner.invoke(app, ["plan", str(ROOT / "tests" / "fixtures" / "tiny_gpt.py"), *CLUSTER,
                                 "--out", str(tmp_path / "o"), "-q"])
    assert result.exit_code == 0, result.output


STRICT_ARGS = NET + """
    def build_model(layers=2, width=8):
        return Net(layers, width)

    def example_inputs(batch_size, width=8, **kw):
        return (torch.randn(batch_size, width),)
"""


def test_unknown_model_arg_is_refused(tmp_path):
    message = _message(_plan(tmp_path, STRICT_ARGS, "-a", "layer=4"))
    assert "'layer'" in message and "build_model()" in message and "Did you mean 'layers'" in message


def test_known_model_arg_and_kwargs_pass(tmp_path):
    assert _plan(tmp_path, STRICT_ARGS, "-a", "layers=3").exit_code == 0
    # sample_models take **kwargs: any key passes (the file's own business)
    result = runner.invoke(app, ["plan", str(ROOT / "sample_models" / "mlp.py"), *CLUSTER, "-a", "anything=1",
                                 "--out", str(tmp_path / "o2"), "-q"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("lr", ["nan", "-1", "0", "inf"])
def test_bad_learning_rate(tmp_path, lr):
    message = _message(_plan(tmp_path, STRICT_ARGS, "--lr", lr))
    assert "--lr" in message


def test_model_path_is_a_directory(tmp_path):
    message = _message(runner.invoke(app, ["plan", str(tmp_path), *CLUSTER, "--out", str(tmp_path / "o")]))
    assert "is a directory" in message and "does not exist" not in message
