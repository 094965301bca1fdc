"""The dry-run cost report of a saved plan.

Usage:
    planner report --help

    # The report of the plan in a folder written by `planner plan --out`
    planner report plan_out

    # The validated plan document, canonical JSON
    planner report plan_out/plan.json --json
"""

from __future__ import annotations

import contextlib
import sys

from planner.cli._options import JsonOpt, PlanPathArg, stdout_console
from planner.errors import ConfigError

REPORT_EXAMPLES = [
    "planner report plan_out",
    "planner report plan_out/plan.json --json",
]


def report(
    plan_path: PlanPathArg,
    json: JsonOpt = False,
) -> None:
    """Print the cost report of a saved plan: layout, per-stage time and memory, communication, runners-up.

    The plan is validated first (schema version included); a malformed or outdated plan is refused with
    a message saying how to regenerate it. --json prints the validated plan in canonical form.
    """
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    try:
        if json:
            sys.stdout.write(plan.to_json())
            sys.stdout.flush()
            return
        from planner.report.tables import plan_report

        folder = plan_path if plan_path.is_dir() else plan_path.parent
        timeline = folder / "timeline.svg"
        console = stdout_console()
        console.print(plan_report(plan, timeline=timeline if timeline.is_file() else None, width=console.width))
        console.file.flush()
    except BrokenPipeError:  # a reader that went away (`| head`): nothing to tell it; status 1, as rich's path
        _quiet_stdout()
        raise SystemExit(1) from None
    except OSError as e:  # stdout on a full device (/dev/full), ...
        _quiet_stdout()
        raise ConfigError(
            f"Cannot write the report to standard output: {e.strerror or e}. Redirect it to a file on a device "
            "with free space (or to a pipe that stays open)."
        ) from None


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail a second time."""
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
