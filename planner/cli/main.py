"""The `planner` command: one typer app, one module per command, one place that turns errors into messages.

Usage:
    planner --help
    planner plan sample_models/gpt.py --gpu cpu --gpus-per-node 4 --global-batch-size 8
    planner report plan_out
    planner --debug plan ...        # full tracebacks

Exit codes: 0 success; 2 a mistake in the input (a PlannerError: model file, spec, options, plan file) or
in the command line (click's usage errors); 1 an internal error (a bug: rerun with --debug and report it).
Importing this module imports neither torch nor the planner's solver: `planner --help` starts at once.
"""

from __future__ import annotations

import gc
import sys
import traceback
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup

from planner import __version__
from planner.cli._options import Settings, examples_epilog, settings
from planner.cli.calibrate import CALIBRATE_EXAMPLES, calibrate
from planner.cli.dry_run import DRY_RUN_EXAMPLES, dry_run
from planner.cli.emit import EMIT_EXAMPLES, emit
from planner.cli.export import EXPORT_EXAMPLES, export
from planner.cli.hardware import hardware_app
from planner.cli.plan import PLAN_EXAMPLES, plan
from planner.cli.profile import PROFILE_EXAMPLES, profile
from planner.cli.replan import REPLAN_EXAMPLES, replan
from planner.cli.report import REPORT_EXAMPLES, report
from planner.cli.sweep import SWEEP_EXAMPLES, sweep
from planner.cli.validate import VALIDATE_EXAMPLES, validate
from planner.errors import ModelLoadError, PlannerError

USER_ERROR = 2
INTERNAL_ERROR = 1
# The cyclic garbage collector's thresholds for the planner's process. Python's defaults (700, 10, 10) run a
# full collection every hundred or so young ones, and each full one walks every object alive: torch's modules,
# the traced graphs, the model. A plan is a short process whose heap is nearly all such long-lived objects, so
# those passes found little and cost about 1 s of a 4 s GPT-3 175B plan and 2.5 s of a Llama-3-70B one. Young
# collections stay as they are; a full one now waits for a thousand of them (memory: +10 MB for Llama-3-70B).
GC_THRESHOLDS = (700, 10, 1000)


class _PlannerGroup(TyperGroup):
    """Runs a command and maps what escapes it to a message and an exit code (see `exit_code_for`).

    Doing it here rather than around `app()` means the mapping also holds under typer's CliRunner.
    """

    # typer builds a typer.Context for every command; the base class annotates click's Context (vendored as
    # typer._click since typer 0.2x), a private name to import.
    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # typer's (click's) own: --help, usage errors (exit 2), Ctrl-C
        except SystemExit as e:
            if isinstance(e.__context__, BrokenPipeError):
                raise  # rich's answer to a reader that went away (`planner plan ... | head`): status 1, quietly
            # click's own exits are typer.Exit (not SystemExit) and the library never exits: this came from
            # the user's model code outside a guard (planner.model.guard). It must not end planner silently.
            error = ModelLoadError(
                f"The model code called sys.exit({e.code!r}) while planner ran it. A model file must not exit "
                "the process: remove the call (or guard script-only code with `if __name__ == \"__main__\":`)."
            )
            raise typer.Exit(report_error(error, settings(ctx).debug)) from e
        except Exception as e:  # noqa: BLE001 - the one place every error is turned into a message
            raise typer.Exit(report_error(e, settings(ctx).debug)) from e


class _PanelCommand(TyperCommand):
    """click's plain help with the options grouped under their `rich_help_panel` headings (Model, Cluster and
    batch, ...), which typer shows only in its rich mode: one section per panel, in first-use order, the
    options without a panel under "Options"."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            panel = getattr(param, "rich_help_panel", None)
            argument = param.param_type_name == "argument"
            key = "Arguments" if argument else panel or "Options"
            sections.setdefault(key, []).append(record)
        order = sorted(sections, key=lambda k: (k != "Arguments", k == "Options"))  # stable: first use otherwise
        for name in order:
            with formatter.section(name):
                formatter.write_dl(sections[name])


def report_error(error: BaseException, debug: bool) -> int:
    """Print one paragraph about `error` on stderr (the traceback first with --debug); return the exit code."""
    if debug:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    if isinstance(error, PlannerError):
        typer.echo(f"Error: {error}", err=True)
        return USER_ERROR
    typer.echo(
        f"Internal error: {type(error).__name__}: {error}. This is a bug in planner, not in your input"
        + ("." if debug else "; rerun with --debug for the traceback and include it when reporting the bug."),
        err=True,
    )
    return INTERNAL_ERROR


app = typer.Typer(
    name="planner",
    cls=_PlannerGroup,
    help="Auto-parallelization planner for PyTorch training: trace a model, search data/tensor/pipeline "
    "parallelism and ZeRO with an ILP, and emit torchrun scripts.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish and PowerShell
    rich_markup_mode=None,  # click's plain help: paragraphs rewrapped to the terminal, no boxes
    pretty_exceptions_enable=False,  # tracebacks only with --debug, printed by report_error
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"planner {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="PLANNER_DEBUG", help="Show tracebacks and debug logging.")
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="Like each command's --quiet: no report, progress or notes from plan, "
                     "dry-run, emit, validate and profile (errors and --json output still print)."),
    ] = False,
) -> None:
    """Plan the parallel layout of a PyTorch training job and generate the scripts that run it."""
    ctx.obj = Settings(debug=debug, quiet=quiet)
    if debug:
        _debug_logging()


def _debug_logging() -> None:
    """planner's own debug log on stderr (torch's loggers keep their levels: they would drown it)."""
    import logging

    logger = logging.getLogger("planner")
    logger.setLevel(logging.DEBUG)
    if not any(getattr(h, "_planner_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler._planner_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


app.command(cls=_PanelCommand, epilog=examples_epilog(PLAN_EXAMPLES))(plan)
app.command("dry-run", cls=_PanelCommand, epilog=examples_epilog(DRY_RUN_EXAMPLES))(dry_run)
app.command(cls=_PanelCommand, epilog=examples_epilog(REPORT_EXAMPLES))(report)
app.command(cls=_PanelCommand, epilog=examples_epilog(EMIT_EXAMPLES))(emit)
app.command(cls=_PanelCommand, epilog=examples_epilog(EXPORT_EXAMPLES))(export)
app.command(cls=_PanelCommand, epilog=examples_epilog(VALIDATE_EXAMPLES))(validate)
app.command(cls=_PanelCommand, epilog=examples_epilog(REPLAN_EXAMPLES))(replan)
app.command(cls=_PanelCommand, epilog=examples_epilog(PROFILE_EXAMPLES))(profile)
app.command(cls=_PanelCommand, epilog=examples_epilog(CALIBRATE_EXAMPLES))(calibrate)
app.command(cls=_PanelCommand, epilog=examples_epilog(SWEEP_EXAMPLES))(sweep)
app.add_typer(hardware_app, name="hardware")


def main() -> None:
    """Console-script entry point (`planner = "planner.cli.main:main"`)."""
    gc.set_threshold(*GC_THRESHOLDS)
    from planner.processes import defer_collection

    defer_collection()  # until the model is loaded (planner.processes.model_loaded)
    try:
        app(prog_name="planner")
        code: str | int | None = 0
    except SystemExit as e:  # click ends every command with sys.exit
        code = e.code
    exit_now(code)


def exit_now(code: str | int | None) -> NoReturn:
    """Exit with `code` as sys.exit would, without the interpreter's teardown.

    Everything a command writes is written (atomically) before it returns; what is left at exit is the
    atexit handlers (run here: temporary model-source folders, logging's flush) and the teardown of every
    module and object alive, which for a plan is torch, the traced graphs and the model: 0.7 s of a 3.4 s
    GPT-3 175B plan. So the process flushes its streams and ends (as mypy does, for the same reason), unless
    a profiler or tracer runs it (`python -m cProfile -o out -m planner.cli.main ...`, a debugger), which writes its
    results after the program returns."""
    import atexit
    import os

    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (planner plan ... | head) or stream: nothing to flush
            pass
    os._exit(status)


if __name__ == "__main__":
    main()
