"""Run a plan's generated training script for a few steps and compare measured with predicted figures.

Usage:
    planner validate --help

    # Five steps of the plan in plan_out (CPU plans: torchrun with world-size gloo processes)
    planner validate plan_out

    # More steps, a longer timeout, machine-readable output
    planner validate plan_out --steps 20 --timeout 1800 --json

    # Time each stage's forward/backward and the plan's collectives, and refit the spec's efficiencies
    planner validate plan_out --refit --out measured.yaml --note "2026-12-03, node a17"
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
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from planner.cli._options import JsonOpt, QuietOpt, is_quiet, stderr_console, stdout_console
from planner.errors import ConfigError, PlannerError

VALIDATE_EXAMPLES = [
    "planner validate plan_out",
    "planner validate plan_out --steps 20 --timeout 1800 --json",
    'planner validate plan_out --refit --out measured.yaml --note "2026-12-03, node a17"',
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
    refit: Annotated[
        bool,
        typer.Option(
            "--refit",
            help="Time each stage's forward and backward and the plan's collectives in the run, compare them "
            "with the plan's predictions and fit the spec's efficiencies to them (written to --out).",
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(help="With --refit: where to write the refit spec YAML (default: PLAN_DIR/SPEC-refit.yaml).",
                     show_default=False),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="With --refit: the spec to refit, a name or a YAML path (default: the plan's).",
                     show_default=False),
    ] = None,
    note: Annotated[
        str | None,
        typer.Option(help="With --refit: a note recorded with every fitted number (e.g. the date and machine).",
                     show_default=False),
    ] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run launch.sh for a few steps on this machine and print predicted vs measured step time and memory.

    CPU plans start world-size processes with torchrun (gloo); GPU plans need the GPUs of one node here.
    The run's output goes to validate.log and its metrics to metrics.json in the plan folder; the first
    step is treated as warm-up and left out of the comparison. With --refit the same run is timed per
    stage and per collective and the spec's efficiencies are refit to the measurements.
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
    # This run writes its metrics to a path named by a fresh run id, so what is measured below can only be
    # what this run wrote (never a previous run's metrics.json); it becomes metrics.json once read.
    run_id = uuid.uuid4().hex[:12]
    final_metrics = (plan_dir / METRICS_FILE).resolve()
    metrics_path = final_metrics.with_name(f".{METRICS_FILE}.run-{run_id}")
    log_path = plan_dir / LOG_FILE
    quiet = is_quiet(ctx, quiet)
    if not refit and (out is not None or gpu is not None or note is not None):
        raise ConfigError("--out, --gpu and --note go with --refit: add --refit or drop them.")
    cmd = ["bash", "launch.sh", "--steps", str(steps), "--metrics", str(metrics_path)]
    session = None
    if refit:
        session = RefitSession.prepare(plan, plan_dir, gpu, out, steps)
        cmd = session.command(metrics_path)
    started = time.time()
    console = stderr_console()
    if not quiet and console.is_terminal:
        with console.status(f"Running {steps} steps on {plan.parallel.world_size} processes (log: {log_path})"):
            code = _run(cmd, plan_dir, log_path, timeout, session.env if session else None)
    else:
        code = _run(cmd, plan_dir, log_path, timeout, session.env if session else None)
    if code is None or code != 0:
        metrics_path.unlink(missing_ok=True)  # a half-written run's file: nothing of it is measured
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
    try:
        step_times, losses, ranks, memory_kind = read_metrics(
            metrics_path, started, name=f"{METRICS_FILE} (this run's)"
        )
        os.replace(metrics_path, final_metrics)
    finally:
        metrics_path.unlink(missing_ok=True)
    metrics_path = final_metrics
    measured = step_times[WARMUP_STEPS:]
    if session is not None:
        result = session.finish(started, note)
        if json:
            document = {**result.document(), "measured_step_times_s": measured,
                        "predicted_iteration_time_s": plan.predicted.iteration_time_s}
            sys.stdout.write(jsonlib.dumps(document, indent=2, sort_keys=True) + "\n")
        elif not quiet:
            from planner.report.tables import validation_table

            console_out = stdout_console()
            console_out.print(validation_table(plan, measured, ranks, memory_kind))
            result.print(console_out)
        return
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

    console = stdout_console()
    console.print(validation_table(plan, measured, ranks, memory_kind))
    console.print(f"Loss: {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {len(losses)}. Metrics: {metrics_path}")


def _run(
    cmd: list[str], cwd: Path, log_path: Path, timeout: float, extra_env: dict[str, str] | None = None
) -> int | None:
    """Run cmd in its own process group with output to log_path; None when it ran past timeout."""
    env = {**os.environ, **(extra_env or {})}
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


def _stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
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


def read_metrics(
    path: Path, not_before: float = 0.0, name: str | None = None
) -> tuple[list[float], list[float], list[RankMemory], str]:
    """(step times, losses, [(rank, pp rank, peak bytes)], memory kind) from the metrics.json train.py writes.

    not_before: a file older than this (epoch seconds) is a previous run's and is refused. name: what the file
    is called in messages (this run's own path carries a run id).
    """
    if not path.is_file() or path.stat().st_mtime < not_before - 1:
        raise RunError(
            f"The training run finished but wrote no {name or path.name} at {path}. Regenerate the scripts with "
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


# --------------------------------------------------------------------------------------------- refit

PROBE_FILE = "probe.json"  # what the probe inside the run times; its timings go to probe.json.rank<R>.json


class RefitSession:
    """`--refit`: the plan's expected terms before the run, the probe's command, the fit after it."""

    def __init__(self, plan: Any, plan_dir: Path, spec_name: str, spec_path: Path, cluster: Any,
                 expected: list[Any], out: Path, steps: int) -> None:
        self.plan, self.plan_dir, self.spec_name, self.spec_path = plan, plan_dir, spec_name, spec_path
        self.cluster, self.expected, self.out, self.steps = cluster, expected, out, steps
        self.config_path = (plan_dir / PROBE_FILE).resolve()
        self.env = {"PLANNER_PROBE": str(self.config_path)}

    @classmethod
    def prepare(cls, plan: Any, plan_dir: Path, gpu: str | None, out: Path | None, steps: int) -> RefitSession:
        from planner.cost.candidate import Candidate
        from planner.hardware.load import load_cluster
        from planner.io import atomic_write_text
        from planner.measure.calibrate import gpu_spec_and_file
        from planner.measure.refit import plan_terms, probe_config
        from planner.pipeline import PlanRequest, analyse

        spec, spec_path = gpu_spec_and_file(gpu or plan.cluster.gpu)
        cluster = load_cluster(spec_path, plan.cluster.nodes, plan.cluster.gpus_per_node)
        src = plan.model
        if not Path(src.path).is_file():
            raise ConfigError(
                f"--refit re-analyses the plan's model, but {src.path} (plan.json's model.path) does not exist. "
                "Run validate where the model file is, or re-plan here."
            )
        request = PlanRequest(
            model_path=src.path, model_args=src.model_args, build_fn=src.build_fn, inputs_fn=src.inputs_fn,
            loss_fn=src.loss_fn, batch_fn=src.batch_fn, dtype=src.dtype, gpu=str(spec_path),
            global_batch_size=plan.parallel.global_batch_size,
        )
        graph = analyse(request)
        index = {u.name: i for i, u in enumerate(graph.units)}
        missing = [u for s in plan.stages for u in s.units if u not in index]
        if missing:
            raise ConfigError(
                f"The plan's stages name units the model no longer has ({missing[:3]}): the model changed "
                "since it was planned. Re-plan it, then validate --refit."
            )
        par = plan.parallel
        cand = Candidate(par.dp, par.tp, par.pp, par.virtual_stages, par.micro_batch_size, par.num_micro_batches,
                         par.schedule, par.zero_stage, par.sequence_parallel, ep=par.ep, cp=par.cp,
                         tp_overlap=par.tp_overlap)
        partition = [[index[u] for u in s.units] for s in plan.stages]
        expected = plan_terms(
            graph, cluster, cand, partition, [s.recompute for s in plan.stages],
            [s.recompute_full_blocks for s in plan.stages],
        )
        out = out if out is not None else plan_dir / f"{spec.name}-refit.yaml"
        session = cls(plan, plan_dir, spec.name, spec_path, cluster, expected, out, steps)
        for old in plan_dir.glob(f"{PROBE_FILE}.rank*.json"):
            old.unlink()  # a previous run's timings must not be read as this one's
        config = probe_config(expected, str(session.config_path), par.pp > 1)
        atomic_write_text(session.config_path, jsonlib.dumps(config, indent=2, sort_keys=True) + "\n")
        return session

    def command(self, metrics_path: Path) -> list[str]:
        """torchrun with the probe in place of train.py (one node: launch.sh's own rule)."""
        world = self.plan.parallel.world_size
        if self.plan.cluster.nodes > 1:
            raise ConfigError(
                f"--refit runs the plan on this machine, but it spans {self.plan.cluster.nodes} nodes. Plan the "
                "model for one node (--nodes 1) to refit, then use the refit spec for the large plan."
            )
        device = "cpu" if self.plan.cluster.gpu.lower() == "cpu" else "cuda"  # codegen's launch.sh rule
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "planner.measure.probe", "train.py", "--device", device,
            "--steps", str(self.steps), "--metrics", str(metrics_path),
        ]

    def finish(self, started: float, note: str | None) -> RefitResult:
        from planner.io import atomic_write_text
        from planner.measure.refit import fit_efficiencies, measured_terms, refit_yaml

        docs = []
        for path in sorted(self.plan_dir.glob(f"{PROBE_FILE}.rank*.json")):
            if path.stat().st_mtime >= started - 1:
                docs.append(jsonlib.loads(path.read_text(encoding="utf-8")))
        if len(docs) != self.plan.parallel.world_size:
            raise RunError(
                f"The run finished but {len(docs)} of {self.plan.parallel.world_size} ranks wrote their timings "
                f"({self.plan_dir / PROBE_FILE}.rank<R>.json). See {self.plan_dir / LOG_FILE}."
            )
        terms = measured_terms(self.expected, docs)
        base = self.cluster.gpu.efficiency
        fit = fit_efficiencies(base, terms)
        device = docs[0].get("device", "cpu")
        samples = sum(t.samples for t in terms)
        provenance = (
            f"planner validate {self.plan_dir.name} --refit --steps {self.steps} ({self.plan.parallel.world_size} "
            f"ranks, {device}): {samples} timed samples over {len(terms)} terms; note: {note or 'none'}"
        )
        text = refit_yaml(self.spec_path.read_text(encoding="utf-8"), fit, f"{self.spec_name}-refit", provenance)
        atomic_write_text(self.out, text)
        return RefitResult(fit, self.out, device, self.spec_name)


class RefitResult:
    def __init__(self, fit: Any, out: Path, device: str, spec_name: str) -> None:
        self.fit, self.out, self.device, self.spec_name = fit, out, device, spec_name

    def document(self) -> dict[str, Any]:
        fit = self.fit
        return {
            "spec": str(self.out),
            "base_efficiency": fit.base.model_dump(),
            "efficiency": fit.efficiency.model_dump(),
            "fitted": fit.fitted,
            "kept": fit.kept,
            "rms_error_before": fit.error(fit.base),
            "rms_error_after": fit.error(fit.efficiency),
            "terms": [
                {
                    "term": t.name, "kind": t.kind, "stage": t.stage, "measured_s": t.measured_s,
                    "samples": t.samples, "predicted_s": t.predicted(fit.base),
                    "refit_predicted_s": t.predicted(fit.efficiency),
                }
                for t in fit.terms
            ],
        }

    def print(self, console: Any) -> None:
        from rich.table import Table

        fit = self.fit
        clock = "CUDA events" if self.device == "cuda" else "perf_counter"
        table = Table(title=f"Per-stage and per-collective times: predicted ({self.spec_name}) vs measured",
                      title_justify="left")
        for col in ("term", "predicted ms", "measured ms", "error", "refit ms", "refit error", "source"):
            table.add_column(col, justify="left" if col in ("term", "source") else "right")
        for t in fit.terms:
            before, after = t.predicted(fit.base), t.predicted(fit.efficiency)
            how = (f"{clock}, median of {t.samples}" if t.kind in ("forward", "backward")
                   else f"re-run on the run's group, median of {t.samples} rank(s)")
            table.add_row(t.name, f"{1e3 * before:.3f}", f"{1e3 * t.measured_s:.3f}",
                          f"{100 * (before / t.measured_s - 1):+.1f}%", f"{1e3 * after:.3f}",
                          f"{100 * (after / t.measured_s - 1):+.1f}%", how)
        console.print(table)
        changes = ", ".join(
            f"{k} {getattr(fit.base, k):.4g} -> {getattr(fit.efficiency, k):.4g}" for k in fit.fitted
        )
        console.print(f"Refit: {changes or 'nothing identifiable'}; rms error {100 * fit.error(fit.base):.1f}% -> "
                      f"{100 * fit.error(fit.efficiency):.1f}%.")
        for k, why in fit.kept.items():
            console.print(f"  {k} kept: {why}")
        console.print(f"wrote {self.out} (use it with --gpu {self.out})")
