"""The output set as one unit (issue 13, points 3 and 4): edited files kept unless --force, a lock per
folder (two real `planner plan` processes), a real `plan` killed between two file writes, a folder in the
way, a full disk, nested paths, and never an orphan temporary file."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401 - see tests/test_cli.py
from typer.testing import CliRunner

from planner import io
from planner.cli.main import app
from planner.errors import ConfigError
from planner.io import MANIFEST, PAUSE_ENV, OutputLockedError, output_lock, read_manifest, write_output_set

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny_gpt.py"
CLUSTER = ["--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "4"]

runner = CliRunner()


def plan(out: Path, *extra: str):
    return runner.invoke(app, ["plan", str(TINY), *CLUSTER, "--out", str(out), "-q", *extra])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def no_leftovers(folder: Path) -> None:
    siblings = [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]
    assert siblings == [], siblings
    assert not [p for p in folder.rglob("*.tmp")]


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored and Python keeps an ignored SIGINT ignored, so a
    # suite run with `&` would send its Ctrl-C to nobody: the planner gets the default a terminal gives it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _planner(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "planner.cli.main", *args], cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint,
    )


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer never reached its first file"
        time.sleep(0.05)


# --- edits ------------------------------------------------------------------------------------------------


def test_edited_script_is_kept_when_the_plan_is_identical(tmp_path):
    out = tmp_path / "p"
    assert plan(out).exit_code == 0
    manifest = read_manifest(out)
    assert set(manifest) >= {"plan.json", "train.py", "launch.sh"}
    (out / "train.py").write_text((out / "train.py").read_text() + "# my edit\n")
    result = plan(out)
    assert result.exit_code == 0, result.output
    assert "kept train.py" in result.stderr and "--force" in result.stderr
    assert (out / "train.py").read_text().endswith("# my edit\n")
    # emit keeps it as well (its help says so)
    result = runner.invoke(app, ["emit", str(out), "--out", str(out), "-q"])
    assert result.exit_code == 0 and "kept train.py" in result.stderr
    assert (out / "train.py").read_text().endswith("# my edit\n")
    # --force regenerates it
    assert plan(out, "--force").exit_code == 0
    assert not (out / "train.py").read_text().endswith("# my edit\n")
    no_leftovers(out)


def test_edited_script_and_a_different_plan_is_refused(tmp_path):
    out = tmp_path / "p"
    assert plan(out).exit_code == 0
    (out / "launch.sh").write_text("#!/bin/sh\necho mine\n")
    before = snapshot(out)
    result = plan(out, "--seed", "7")
    assert result.exit_code == 2
    message = result.stderr[result.stderr.rfind("Error: "):]
    assert "different plan" in message and "launch.sh" in message and "--force" in message
    assert snapshot(out) == before
    assert plan(out, "--seed", "7", "--force").exit_code == 0
    assert json.loads((out / "plan.json").read_text())["training"]["seed"] == 7
    no_leftovers(out)


def test_unchanged_generated_files_are_regenerated_and_others_left_alone(tmp_path):
    out = tmp_path / "p"
    files = {"a.txt": ("one\n", False), "runtime/__init__.py": ("x = 1\n", False), "run.sh": ("echo\n", True)}
    write_output_set(out, files, force=False)
    (out / "validate.log").write_text("user data\n")  # not planner's: survives every rewrite
    (out / "runtime" / "notes.txt").write_text("mine\n")
    new = {"a.txt": ("two\n", False), "runtime/__init__.py": ("x = 2\n", False)}  # run.sh no longer written
    result = write_output_set(out, new, force=False)
    assert sorted(p.name for p in result.written) == ["__init__.py", "a.txt"]
    assert (out / "a.txt").read_text() == "two\n" and (out / "runtime" / "__init__.py").read_text() == "x = 2\n"
    assert not (out / "run.sh").exists()  # stale: the previous set wrote it, the new one does not
    assert (out / "validate.log").read_text() == "user data\n"
    assert (out / "runtime" / "notes.txt").read_text() == "mine\n"
    assert set(read_manifest(out)) == set(new)
    no_leftovers(out)


def test_bad_names_are_a_bug():
    with pytest.raises(ValueError):
        io.check_names({"../x": ("", False)})


# --- the folder itself ------------------------------------------------------------------------------------


def test_a_folder_in_the_way_is_refused_then_replaced_with_force(tmp_path):
    out = tmp_path / "p"
    (out / "train.py").mkdir(parents=True)
    (out / "train.py" / "x").write_text("x")
    result = plan(out)
    assert result.exit_code == 2 and "train.py" in result.stderr and "not a plain file" in result.stderr
    assert not (out / "plan.json").exists()
    assert plan(out, "--force").exit_code == 0
    assert (out / "train.py").is_file()
    no_leftovers(out)


def test_a_full_disk_leaves_the_old_set(tmp_path, monkeypatch):
    out = tmp_path / "p"
    assert plan(out).exit_code == 0
    before = snapshot(out)
    calls = []

    def full(path, text, executable):
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, text, executable)

    real = io._write_file
    monkeypatch.setattr(io, "_write_file", full)
    result = plan(out, "--seed", "3", "--force")
    assert result.exit_code == 2
    assert "No space left on device" in result.stderr and "Nothing was changed" in result.stderr
    assert snapshot(out) == before
    no_leftovers(out)


def test_the_working_directory_is_written_in_place(tmp_path, monkeypatch):
    out = tmp_path / "p"
    out.mkdir()
    monkeypatch.chdir(out)
    write_output_set(Path("."), {"a.txt": ("1\n", False)}, force=False)
    write_output_set(Path("."), {"a.txt": ("2\n", False), "b/c.txt": ("3\n", False)}, force=False)
    assert (out / "a.txt").read_text() == "2\n" and (out / "b" / "c.txt").read_text() == "3\n"
    assert json.loads((out / MANIFEST).read_text())["files"].keys() == {"a.txt", "b/c.txt"}
    no_leftovers(out)


# --- the lock ---------------------------------------------------------------------------------------------


def test_the_lock_fails_fast_and_is_removed(tmp_path):
    out = tmp_path / "p"
    with output_lock(out) as lock:
        assert lock.exists()
        with pytest.raises(OutputLockedError, match=r"holds the lock .*\.p\.lock"):
            write_output_set(out, {"a": ("1", False)}, force=False)
    assert not lock.exists()
    write_output_set(out, {"a": ("1", False)}, force=False)
    no_leftovers(out)


def test_two_real_plans_on_one_folder(tmp_path):
    """The first holds the lock (paused by the test seam after its first file); the second fails at once."""
    out = tmp_path / "p"
    marker = tmp_path / "paused"
    first = _planner("plan", str(TINY), *CLUSTER, "--out", str(out), "-q", env={PAUSE_ENV: str(marker)})
    try:
        _wait_for(marker, first)
        second = _planner("plan", str(TINY), *CLUSTER, "--seed", "5", "--out", str(out), "-q")
        _, err = second.communicate(timeout=600)
        assert second.returncode == 2, err
        assert "Another planner process" in err and ".p.lock" in err and "Traceback" not in err
    finally:
        marker.unlink(missing_ok=True)  # let the first one finish
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert json.loads((out / "plan.json").read_text())["training"]["seed"] == 0
    manifest = read_manifest(out)
    for name, digest in manifest.items():  # the set on disk is exactly the first run's
        assert io._file_digest(out / name) == digest
    no_leftovers(out)


# --- killed between two files ---------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_plan_killed_between_file_writes(tmp_path, sig):
    out = tmp_path / "p"
    assert plan(out).exit_code == 0
    before = snapshot(out)
    marker = tmp_path / "paused"
    proc = _planner("plan", str(TINY), *CLUSTER, "--seed", "9", "--force", "--out", str(out), "-q",
                    env={PAUSE_ENV: str(marker)})
    _wait_for(marker, proc)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert snapshot(out) == before  # the old set, whole: no new train.py beside the old plan.json
    if sig == signal.SIGKILL:
        assert [p for p in tmp_path.iterdir() if p.name.startswith(".p.tmp-")]  # nothing can clean up a SIGKILL
        assert plan(out, "--seed", "9", "--force").exit_code == 0  # ... but the next writer does
        assert json.loads((out / "plan.json").read_text())["training"]["seed"] == 9
    no_leftovers(out)


def test_write_errors_are_config_errors(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        write_output_set(target, {"a": ("1", False)}, force=False)
