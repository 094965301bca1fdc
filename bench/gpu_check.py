"""The GPU path on the local device: measured unit costs, calibration, validation and plan quality, one table.

    python bench/gpu_check.py                     # the local GPU (a 1B-class Llama), else the CPU (a small one)
    python bench/gpu_check.py --device cpu        # the CPU path CI runs (tests/test_gpu_check.py)
    python bench/gpu_check.py --out gpu_check_out --json gpu_check.json

Four steps, each through the planner's own commands, on one device (dp 1):
  1. `planner plan --measure` of sample_models/llama.py: each distinct unit's forward and backward time per
     micro-batch size as measured (the profile the plan used, read back from its cache) beside the spec's
     roofline estimate, and beside the calibrated spec's (step 2).
  2. `planner calibrate` for the local device: the fitted efficiencies and the GEMM-size curve
     (matmul * d / (d + gemm_half_dim)), written to OUT/calibrated.yaml.
  3. `planner validate` of the plan of step 1 for --validate-steps steps: predicted vs measured step time and
     peak memory (torch.cuda.max_memory_allocated; max_memory_reserved beside it; the process's peak RSS on
     a CPU).
  4. Plan quality: every micro-batch size x recomputation choice of the 1-device space (micro-batch sizes that
     divide the global batch, each recomputation mode) planned with the choice pinned, written out and run
     for --quality-steps steps by its train.py; the measured best beside the planner's own choice, planned
     with the uncalibrated spec, the calibrated spec and the measured profile. A choice that fits under
     neither spec is listed with the planner's reason and not run (the planner writes no plan for it).

On a GPU the model is a 1B-class Llama (Llama 3.2 1B's shape: 16 layers, hidden 2048, 32 heads, 8 KV heads,
FFN 8192, vocabulary 128256) at sequence 2048 in bf16, global batch 8; on a CPU the sample model's small
default in fp32, global batch 4. The whole run is sized for at most 8 minutes on one H100. Prints figures;
it asserts nothing (the test asserts the CPU path's table is whole).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "sample_models" / "llama.py"
# Llama 3.2 1B's published shape (Meta's released config.json), at a 2048-token sequence.
GPU_MODEL_ARGS = {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256,
                  "seq": 2048, "rope_theta": 500000.0}
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass
class Setup:
    """What one check runs: the device, the spec planned for, the model and the batch."""

    device: str  # cuda | cpu
    spec: str  # the uncalibrated spec's name (or path), as `--gpu` takes it
    model_args: dict[str, Any]
    dtype: str
    global_batch_size: int
    validate_steps: int
    quality_steps: int
    recompute: tuple[str, ...]
    out: Path
    quick_calibration: bool
    timeout_s: float


@dataclass
class Row:
    """One line of the table: the step, what it is about, the planner's figure, the measured one."""

    step: str
    item: str
    predicted: str = ""
    measured: str = ""
    error: str = ""
    note: str = ""


@dataclass
class Report:
    header: dict[str, str]
    rows: list[Row] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, *args: str, **kwargs: str) -> None:
        self.rows.append(Row(*args, **kwargs))


# ------------------------------------------------------------------------------------------- helpers


def planner_cmd(*args: str) -> list[str]:
    """The planner command of this interpreter's environment, whether or not it is activated."""
    return [sys.executable, "-c", "from planner.cli.main import main; main()", *args]


def run(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[3:] if cmd[1] == '-c' else cmd)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def model_arg_options(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in args.items():
        out += ["-a", f"{k}={v!r}"]
    return out


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def err(predicted: float | None, measured: float | None) -> str:
    if not predicted or not measured:
        return "-"
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "-"
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return "-"
    return out[0] if out else "-"


def local_spec(device: str) -> str:
    """The stock spec of the local device: `cpu`, or the spec whose name or alias matches the GPU's name."""
    from planner.errors import SpecError
    from planner.hardware.load import load_cluster
    from planner.measure.profile import local_device_name

    if device == "cpu":
        return "cpu"
    name = local_device_name("cuda")
    bare = name.removeprefix("NVIDIA ").removeprefix("AMD ")
    words = bare.lower().split()
    tries = [name, bare, "-".join(words[:2]), *words]
    for cand in tries:
        try:
            load_cluster(cand, 1)
        except SpecError:
            continue
        return cand
    raise SystemExit(f"No spec under hardware_specs/ matches the local GPU {name!r}: add an alias for it.")


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    from planner.cli._options import parse_model_args as parse

    return parse(items)


def setup_for(args: argparse.Namespace) -> Setup:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible to torch.")
    gpu = device == "cuda"
    return Setup(
        device=device,
        spec=args.spec or local_spec(device),
        model_args={**(GPU_MODEL_ARGS if gpu else {}), **parse_model_args(args.model_arg)},
        dtype="bf16" if gpu else "fp32",
        global_batch_size=args.global_batch_size or (8 if gpu else 4),
        validate_steps=args.validate_steps,
        quality_steps=args.quality_steps,
        recompute=tuple(args.recompute.split(",")) if args.recompute else RECOMPUTE_MODES,
        out=Path(args.out).resolve(),
        quick_calibration=args.quick_calibration if args.quick_calibration is not None else not gpu,
        timeout_s=args.timeout,
    )


def request_for(setup: Setup, spec: str, **pins: Any):
    from planner.pipeline import PlanRequest

    return PlanRequest(
        model_path=str(MODEL), model_args=setup.model_args, dtype=setup.dtype, gpu=spec, nodes=1, gpus_per_node=1,
        global_batch_size=setup.global_batch_size, pins=pins, measure=False, steps=max(setup.validate_steps, 2),
    )


# ------------------------------------------------------------------------------------------- the steps


def step_measured_plan(setup: Setup, env: dict[str, str], report: Report) -> dict[str, Any]:
    """1. `planner plan --measure`: the plan on measured unit times; its plan.json."""
    folder = setup.out / "measured"
    run(planner_cmd("plan", str(MODEL), *model_arg_options(setup.model_args), "--gpu", setup.spec,
                    "--gpus-per-node", "1", "--global-batch-size", str(setup.global_batch_size), "--dtype",
                    setup.dtype, "--measure", "--steps", str(setup.validate_steps), "-o", str(folder), "-f", "-q"),
        env, setup.timeout_s)
    return json.loads((folder / "plan.json").read_text())


def unit_rows(setup: Setup, graph, calibrated: Path | None, report: Report) -> None:
    """Each distinct unit's measured forward/backward beside the spec's (and the calibrated spec's) estimate.

    The profile is the one `plan --measure` measured: the same call (sizes, repeats) answers from its cache."""
    from planner.cost.model import roofline_times
    from planner.hardware.load import load_cluster
    from planner.measure.profile import profile_model
    from planner.model.load import DTYPE_BYTES
    from planner.pipeline import load_request_model

    request = request_for(setup, setup.spec)
    sizes = [b for b in range(1, 9) if setup.global_batch_size % b == 0]  # as planner.pipeline.measure_locally
    result = profile_model(load_request_model(request), sizes, setup.device)
    report.data["profile_from_cache"] = result.from_cache
    specs = {"spec": load_cluster(setup.spec, 1)}
    if calibrated is not None:
        specs["calibrated"] = load_cluster(str(calibrated), 1)
    by_sig = {u.signature: u for u in graph.units}
    scale = DTYPE_BYTES[result.dtype] / graph.dtype_bytes
    units = []
    for up in result.units:
        unit = by_sig.get(up.signature)
        if unit is None:
            continue
        if scale != 1:
            unit = unit.model_copy(update={"memory_bound_bytes": unit.memory_bound_bytes * scale,
                                           "bwd_memory_bound_bytes": unit.bwd_memory_bound_bytes * scale})
        est = {k: roofline_times(unit, up.micro_batch_size, 1, False, c, result.dtype)[:2] for k, c in specs.items()}
        label = f"{up.units[0]}{f' (x{len(up.units)})' if len(up.units) > 1 else ''} mbs {up.micro_batch_size}"
        for i, phase in enumerate(("fwd", "bwd")):
            got = up.fwd_s if i == 0 else up.bwd_s
            cal = est.get("calibrated")
            report.add("1 unit times", f"{label} {phase}", ms(est["spec"][i]), ms(got), err(est["spec"][i], got),
                       f"calibrated {ms(cal[i])} ({err(cal[i], got)})" if cal else "")
            units.append({"unit": label, "phase": phase, "measured_s": got, "spec_s": est["spec"][i],
                          "calibrated_s": cal[i] if cal else None})
    report.data["units"] = units


def step_calibrate(setup: Setup, env: dict[str, str], report: Report) -> Path:
    """2. `planner calibrate`: fitted efficiencies and the GEMM curve, written as a spec."""
    out = setup.out / "calibrated.yaml"
    cmd = planner_cmd("calibrate", "--gpu", setup.spec, "--device", setup.device, "--dtype", setup.dtype,
                      "--world", "1", "--model", str(MODEL), *model_arg_options(setup.model_args), "--out", str(out),
                      "--name", "local-calibrated", "--json")
    if setup.quick_calibration:
        cmd.append("--quick")
    doc = json.loads(run(cmd, env, setup.timeout_s).stdout)
    from planner.hardware.load import load_cluster

    base = load_cluster(setup.spec, 1).gpu.efficiency.model_dump()
    eff = doc["efficiency"] or {}
    for key in ("matmul", "gemm_half_dim", "attention", "memory", "network"):
        if key in eff:
            report.add("2 calibrate", f"efficiency.{key}", f"{base.get(key, 0):.4g}", f"{eff[key]:.4g}", "",
                       "spec -> fitted")
    gemms = sorted((m for m in doc["measurements"] if m["kind"] == "gemm"), key=lambda m: (m["dim"], m["label"]))
    half = eff.get("gemm_half_dim", 0.0)
    for m in gemms:
        d = m["dim"]
        curve = eff.get("matmul", 0.0) * (d / (d + half) if half else 1.0)
        report.add("2 calibrate", f"GEMM {m['label']}", f"curve {curve:.3f}", f"{m['efficiency']:.3f}",
                   err(curve, m["efficiency"]), "achieved / peak")
    report.data["calibration"] = doc
    return out


def step_validate(setup: Setup, env: dict[str, str], report: Report) -> None:
    """3. `planner validate` of the measured plan: predicted vs measured step time and peak memory."""
    folder = setup.out / "measured"
    doc = json.loads(run(planner_cmd("validate", str(folder), "--steps", str(setup.validate_steps), "--json",
                                     "--timeout", str(setup.timeout_s)), env, setup.timeout_s + 60).stdout)
    measured = doc["measured"]
    predicted = doc["predicted"]
    peak = max(measured["peak_memory_bytes"].values())
    reserved = _reserved(folder / "metrics.json")
    report.add("3 validate", f"step time ({len(measured['step_times_s'])} steps after warm-up)",
               ms(predicted["iteration_time_s"]), ms(measured["iteration_time_s"]),
               err(predicted["iteration_time_s"], measured["iteration_time_s"]),
               f"min {ms(min(measured['step_times_s']))} max {ms(max(measured['step_times_s']))}")
    report.add("3 validate", f"peak memory ({measured['memory_kind']})", gib(predicted["peak_memory_bytes"]),
               gib(peak), err(predicted["peak_memory_bytes"], peak),
               f"reserved {gib(reserved)} ({err(predicted['peak_memory_bytes'], reserved)})" if reserved else "")
    report.data["validate"] = {**doc, "peak_reserved_bytes": reserved}


def _reserved(metrics: Path) -> int | None:
    """torch.cuda.max_memory_reserved of the rank, where train.py recorded it (GPU runs)."""
    try:
        ranks = json.loads(metrics.read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        return None
    values = [r.get("peak_reserved_bytes") for r in ranks]
    return max(v for v in values if v is not None) if any(v is not None for v in values) else None


def plan_or_none(request, graph):
    """(plan, search result) of a request, or (None, reason) where the planner finds no plan (it does not fit)."""
    from planner.errors import PlannerError
    from planner.pipeline import plan_model

    try:
        plan, _, result = plan_model(request, graph)
    except PlannerError as e:
        return None, str(e).split(". ")[0]
    return plan, result


def choice_of(plan) -> tuple[int, str]:
    return plan.parallel.micro_batch_size, plan.stages[0].recompute


def step_quality(setup: Setup, env: dict[str, str], graph, calibrated: Path, measured_plan: dict[str, Any],
                 report: Report) -> None:
    """4. Every micro-batch size x recomputation choice planned (pinned), written out, run for a few steps."""
    from planner.cli.emit import write_outputs
    from planner.cli.plan import render_outputs
    from planner.cli.validate import first_error, read_metrics

    specs = {"spec": setup.spec, "calibrated": str(calibrated)}
    choices: dict[str, tuple[int, str] | None] = {}
    for name, spec in specs.items():
        plan, _ = plan_or_none(request_for(setup, spec), graph)
        choices[name] = choice_of(plan) if plan is not None else None
    mp = measured_plan
    choices["measured profile"] = (mp["parallel"]["micro_batch_size"], mp["stages"][0]["recompute"])

    sizes = [b for b in range(1, setup.global_batch_size + 1) if setup.global_batch_size % b == 0]
    grid: list[dict[str, Any]] = []
    for mbs in sizes:
        for mode in setup.recompute:
            entry: dict[str, Any] = {"micro_batch_size": mbs, "recompute": mode}
            plans = {}
            for name, spec in specs.items():
                plan, result = plan_or_none(request_for(setup, spec, micro_batch_size=mbs, recompute=mode), graph)
                plans[name] = (plan, result)
                entry[f"{name}_predicted_s"] = plan.predicted.iteration_time_s if plan else None
                entry[f"{name}_predicted_bytes"] = plan.predicted.peak_memory_bytes if plan else None
                if plan is None:
                    entry[f"{name}_refused"] = result
            runnable = next(((p, r) for p, r in plans.values() if p is not None), None)
            if runnable is None:  # the planner writes no plan it finds does not fit
                entry["measured"] = "not run: no spec fits it"
                grid.append(entry)
                continue
            plan, result = runnable
            folder = setup.out / "grid" / f"mbs{mbs}-{mode}"
            write_outputs(folder, render_outputs(plan, result), force=True)
            metrics = folder / "metrics.json"
            started = time.time()
            proc = subprocess.run([sys.executable, "train.py", "--steps", str(setup.quality_steps), "--metrics",
                                   str(metrics), "--device", setup.device], cwd=folder, env=env, capture_output=True,
                                  text=True, timeout=setup.timeout_s)
            (folder / "run.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                entry["measured"] = "failed: " + (first_error(proc.stdout + proc.stderr) or f"exit {proc.returncode}")
                grid.append(entry)
                continue
            times, _, ranks, _ = read_metrics(metrics, started)
            entry["measured_s"] = statistics.mean(times[1:])
            entry["measured_bytes"] = max(b for _, _, b in ranks)
            entry["measured_reserved_bytes"] = _reserved(metrics)
            grid.append(entry)

    ran = [e for e in grid if "measured_s" in e]
    best = min(ran, key=lambda e: e["measured_s"]) if ran else None
    for e in grid:
        label = f"mbs {e['micro_batch_size']} x {e['recompute']}"
        if "measured_s" not in e:
            report.add("4 quality grid", label, ms(e.get("spec_predicted_s")), e["measured"], "",
                       e.get("spec_refused", ""))
            continue
        mark = " <- measured best" if e is best else ""
        picked = [n for n, c in choices.items() if c == (e["micro_batch_size"], e["recompute"])]
        note = f"calibrated {ms(e['calibrated_predicted_s'])} ({err(e['calibrated_predicted_s'], e['measured_s'])})"
        note += f"; mem {gib(e['spec_predicted_bytes'])} vs {gib(e['measured_bytes'])}"
        note += mark + (f" <- chosen by {', '.join(picked)}" if picked else "")
        report.add("4 quality grid", label, ms(e["spec_predicted_s"]), ms(e["measured_s"]),
                   err(e["spec_predicted_s"], e["measured_s"]), note)
    summary = {}
    for name, choice in choices.items():
        hit = next((e for e in ran if (e["micro_batch_size"], e["recompute"]) == choice), None)
        if choice is None or best is None or hit is None:
            report.add("4 quality", f"choice of {name}", str(choice), "-", "", "not measured")
            continue
        gap = hit["measured_s"] / best["measured_s"] - 1
        summary[name] = {"choice": choice, "measured_s": hit["measured_s"], "gap": gap}
        report.add("4 quality", f"choice of {name}: mbs {choice[0]} x {choice[1]}", ms(best["measured_s"]),
                   ms(hit["measured_s"]), f"{gap * 100:+.1f}%",
                   f"vs measured best mbs {best['micro_batch_size']} x {best['recompute']} (goal: within 5%)")
    report.data["grid"] = grid
    report.data["choices"] = summary


# ------------------------------------------------------------------------------------------- the table


def render(report: Report) -> str:
    lines = [f"{k}: {v}" for k, v in report.header.items()]
    lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()))
    cols = ("step", "item", "planner", "measured", "error", "note")
    rows = [cols] + [(r.step, r.item, r.predicted, r.measured, r.error, r.note) for r in report.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols) - 1)]
    for n, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
        if n == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
    return "\n".join(line.rstrip() for line in lines)


def check(setup: Setup) -> Report:
    import torch

    from planner import __version__
    from planner.measure.profile import local_device_name
    from planner.pipeline import analyse

    setup.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PLANNER_CACHE_DIR": str(setup.out / "cache"), "PYTHONPATH": str(ROOT)}
    os.environ["PLANNER_CACHE_DIR"] = env["PLANNER_CACHE_DIR"]  # this process reads the same profile cache
    report = Report(header={
        "device": local_device_name(setup.device),
        "driver": driver_version(),
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda or '-'})",
        "planner": __version__,
        "python": platform.python_version(),
        "spec": setup.spec,
        "model": f"sample_models/llama.py {setup.model_args or '(default: small)'} {setup.dtype}, "
                 f"global batch {setup.global_batch_size}, 1 device",
    })
    t0 = time.perf_counter()
    measured_plan = step_measured_plan(setup, env, report)
    report.seconds["plan --measure"] = time.perf_counter() - t0
    t = time.perf_counter()
    calibrated = step_calibrate(setup, env, report)
    report.seconds["calibrate"] = time.perf_counter() - t
    t = time.perf_counter()
    graph = analyse(request_for(setup, setup.spec))
    unit_rows(setup, graph, calibrated, report)
    report.seconds["unit table"] = time.perf_counter() - t
    t = time.perf_counter()
    step_validate(setup, env, report)
    report.seconds["validate"] = time.perf_counter() - t
    t = time.perf_counter()
    step_quality(setup, env, graph, calibrated, measured_plan, report)
    report.seconds["quality"] = time.perf_counter() - t
    report.seconds["total"] = time.perf_counter() - t0
    report.rows.sort(key=lambda r: r.step[0])  # table in step order (the units are listed after calibration)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--spec", help="the uncalibrated spec (default: the local device's)")
    parser.add_argument("-a", "--model-arg", action="append", metavar="KEY=VALUE",
                        help="override the model's arguments (e.g. -a layers=2 for a smoke run on a GPU)")
    parser.add_argument("--global-batch-size", type=int, help="default 8 on a GPU, 4 on a CPU")
    parser.add_argument("--validate-steps", type=int, default=10)
    parser.add_argument("--quality-steps", type=int, default=4, help="steps per grid run (the first is warm-up)")
    parser.add_argument("--recompute", help="comma-separated recomputation modes of the grid (default: all)")
    parser.add_argument("--quick-calibration", action=argparse.BooleanOptionalAction, default=None,
                        help="planner calibrate --quick (default: on a CPU)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command")
    parser.add_argument("--out", default="gpu_check_out", help="folder for the plans, spec and runs")
    parser.add_argument("--json", help="also write every figure as JSON to this file")
    args = parser.parse_args(argv)
    if args.quality_steps < 2 or args.validate_steps < 2:
        parser.error("--quality-steps and --validate-steps must be at least 2 (the first step is warm-up)")
    sys.path.insert(0, str(ROOT))
    setup = setup_for(args)
    report = check(setup)
    print(render(report))
    if args.json:
        doc = {"header": report.header, "seconds": report.seconds, "setup": {**asdict(setup), "out": str(setup.out)},
               "rows": [asdict(r) for r in report.rows], **report.data}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
