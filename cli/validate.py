"""Run a plan's generated training script for a few steps and compare measured with predicted figures.

Usage:
    planner validate --help

    # Five steps of the plan in plan_out (CPU plans: torchrun with world-size gloo processes)
    planner validate plan_out

    # More steps, a longer timeout, machine-readable output
    planner validate plan_out --steps 20 --timeout 1800 --json
"""

from __future__ import annotations

import contextlib
import json as jsonlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from cli._options import JsonOpt, QuietOpt, is_quiet, stderr_console, stdout_console
from planner.errors import ConfigError, PlannerError

VALIDATE_EXAMPLES = [
    "planner validate plan_out",
    "planner validate plan_out --steps 20 --timeout 1800 --json",
]

METRICS_FILE = "metrics.json"
LOG_FILE = "validate.log"
WARMUP_STEPS = 1  # the first step pays for allocator growth, lazy init and gloo connection set-up
TAIL_LINES = 25


class RunError(PlannerError):
    """The generated training script failed, timed out, or left no usable metrics."""


def validate(
    ctx: typer.Context,
    plan_dir: Annotated[
        Path, typer.Argument(help="Folder written by `planner plan` (plan.json, launch.sh, train.py).",
                             metavar="PLAN_DIR", show_default=False)
    ],
    steps: Annotated[int, typer.Option(min=2, help="Steps to run; the first is warm-up and not measured.")] = 5,
    timeout: Annotated[float, typer.Option(min=1.0, help="Seconds before the run is stopped.")] = 900.0,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run launch.sh for a few steps on this machine and print predicted vs measured step time and memory.

    CPU plans start world-size processes with torchrun (gloo); GPU plans need the GPUs of one node here.
    The run's output goes to validate.log and its metrics to metrics.json in the plan folder; the first
    step is treated as warm-up and left out of the comparison.
    """
    from planner.plan import load_plan

    if not plan_dir.is_dir():
        raise ConfigError(f"{plan_dir} is not a folder. Pass the folder `planner plan --out` wrote.")
    plan = load_plan(plan_dir)
    launcher = plan_dir / "launch.sh"
    if not launcher.is_file():
        raise ConfigError(
            f"{launcher} does not exist. Write the scripts with "
            f"`planner emit {plan_dir / 'plan.json'} --out {plan_dir}`."
        )
    metrics_path = (plan_dir / METRICS_FILE).resolve()
    log_path = plan_dir / LOG_FILE
    quiet = is_quiet(ctx, quiet)
    cmd = ["bash", "launch.sh", "--steps", str(steps), "--metrics", str(metrics_path)]
    started = time.time()
    console = stderr_console()
    if not quiet and console.is_terminal:
        with console.status(f"Running {steps} steps on {plan.parallel.world_size} processes (log: {log_path})"):
            code = _run(cmd, plan_dir, log_path, timeout)
    else:
        code = _run(cmd, plan_dir, log_path, timeout)
    if code is None:
        raise RunError(
            f"The training run did not finish within {timeout:g} s and was stopped. Last lines of {log_path}:\n"
            f"{_tail(log_path)}\nRaise --timeout or lower --steps."
        )
    if code != 0:
        try:
            cause = first_error(log_path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            cause = ""
        raise RunError(
            f"The training run failed (launch.sh exited with {code})"
            + (f"; the first error was: {cause}" if cause else "")
            + f". Last lines of {log_path}:\n{_tail(log_path)}"
        )
    step_times, losses, ranks, memory_kind = read_metrics(metrics_path, started)
    measured = step_times[WARMUP_STEPS:]
    if json:
        document = {
            "plan": str(plan_dir / "plan.json"),
            "metrics": str(metrics_path),
            "warmup_steps": WARMUP_STEPS,
            "predicted": {
                "iteration_time_s": plan.predicted.iteration_time_s,
                "peak_memory_bytes": plan.predicted.peak_memory_bytes,
            },
            "measured": {
                "iteration_time_s": sum(measured) / len(measured),
                "step_times_s": measured,
                "losses": losses,
                "peak_memory_bytes": {str(r): b for r, _, b in ranks},
                "memory_kind": memory_kind,
            },
        }
        sys.stdout.write(jsonlib.dumps(document, indent=2, sort_keys=True) + "\n")
        return
    if quiet:
        return
    from planner.report.tables import validation_table

    out = stdout_console()
    out.print(validation_table(plan, measured, ranks, memory_kind))
    out.print(f"Loss: {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {len(losses)}. Metrics: {metrics_path}")


def _run(cmd: list[str], cwd: Path, log_path: Path, timeout: float) -> int | None:
    """Run cmd in its own process group with output to log_path; None when it ran past timeout."""
    env = dict(os.environ)
    # torchrun and python from this interpreter's environment, whether or not it is activated.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHON", sys.executable)
    env.setdefault("OMP_NUM_THREADS", "1")  # N processes on one CPU: one thread each avoids oversubscription
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # an outer torchrun's variables would confuse the inner one
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return None
        except BaseException:  # Ctrl-C: do not leave torchrun's workers behind
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop the run's whole process tree: SIGTERM, then SIGKILL after `grace` s for whatever is left.

    torchrun's workers may sit in process groups (or sessions) of their own, so killpg on the launcher's
    group is not enough: every descendant is found through /proc and signalled by pid as well.
    """
    tree = _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tree |= _descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            if proc.poll() is not None and not any(_alive(p) for p in tree):
                return


def _descendants(root: int) -> set[int]:
    """Pids of every live descendant of `root` (from /proc; empty where /proc is unavailable)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"  # a zombie is dead, only not yet reaped


def first_error(log_text: str) -> str:
    """The first Python traceback's last line (exception type and message) in a torchrun log, or ''.

    torchrun prints its own summary (ChildFailedError) after the workers' tracebacks; the failing rank's
    first traceback is the real cause. Rank prefixes ("[rank1]:") are kept so the message names the rank.
    """
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        prefix = line[: line.index("Traceback")]
        for later in lines[i + 1:]:
            body = later[len(prefix):] if later.startswith(prefix) else later
            if body and not body.startswith((" ", "\t", "Traceback")) and ":" in body:
                if "ChildFailedError" in body or "torch.distributed.elastic" in body:
                    break
                return f"{prefix.strip()} {body.strip()}".strip()
    return ""


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


RankMemory = tuple[int, int | None, int]  # (global rank, pp rank, peak bytes)


def read_metrics(path: Path, not_before: float = 0.0) -> tuple[list[float], list[float], list[RankMemory], str]:
    """(step times, losses, [(rank, pp rank, peak bytes)], memory kind) from the metrics.json train.py writes.

    not_before: a file older than this (epoch seconds) is a previous run's and is refused.
    """
    if not path.is_file() or path.stat().st_mtime < not_before - 1:
        raise RunError(
            f"The training run finished but wrote no {path.name} at {path}. Regenerate the scripts with "
            "`planner emit` so that train.py writes metrics."
        )
    try:
        data: Any = jsonlib.loads(path.read_text(encoding="utf-8"))
        steps = data["steps"]
        step_times = [float(s["step_time_s"]) for s in steps]
        losses = [float(s["loss"]) for s in steps]
        ranks = [
            (int(r["rank"]), int(r["pp"]) if r.get("pp") is not None else None, int(r["peak_memory_bytes"]))
            for r in data.get("ranks", [])
        ]
        memory_kind = str(data.get("memory_kind", "unknown"))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise RunError(
            f"{path} is not the metrics file train.py writes ({type(e).__name__}: {e}). Regenerate the scripts "
            "with `planner emit` and run again."
        ) from None
    if len(step_times) <= WARMUP_STEPS or not all(math.isfinite(t) and t > 0 for t in step_times):
        raise RunError(
            f"{path} records {len(step_times)} step(s); at least {WARMUP_STEPS + 1} with positive times are needed "
            "(the first is warm-up). Run more --steps."
        )
    return step_times, losses, ranks, memory_kind
