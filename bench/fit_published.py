"""Fit a GPU's efficiencies on the calibration rows of bench/published_runs.yaml (role: fit) and nothing else.

Usage:
    python bench/fit_published.py --split h100          # fit H100 on the Megatron-LM README rows, print the block
    python bench/fit_published.py --split h100 --from matmul=0.7,network=0.9

Each calibration row is planned with its published layout pinned (bench/published_runs.plan_run) and its
predicted iteration time set against the published one. The iteration time is affine in the inverse
efficiencies within one plan (the same terms `planner validate --refit` fits) but the pipeline's maxima and
the search's partition make it piecewise so over the whole range, so the fit is Gauss-Newton: at the
current efficiencies read each row's affine form off the planner (planner.measure.refit.
affine_in_inverse_efficiency), solve the bounded least squares in relative error
(planner.measure.refit.fit_efficiencies), and repeat until the efficiencies stop moving. gemm_half_dim is
held at the spec's value; an efficiency the rows do not depend on keeps the spec's value.

The validation rows are never read. Their accuracy is bench/accuracy.py's job, with the fitted block in
hardware_specs/.
"""

from __future__ import annotations

import argparse
import sys
import time

from published_runs import Run, load_runs, plan_run, predicted_iteration_s, run_cluster

from planner.hardware.spec import Efficiencies
from planner.measure.refit import (
    FITTED,
    PHYSICAL_MAX,
    Fit,
    Term,
    affine_in_inverse_efficiency,
    fit_efficiencies,
)

MAX_ROUNDS = 8
TOLERANCE = 0.002  # stop when no efficiency moves by more than this (absolute)


def predict(rows: list[Run], graphs: dict, eff: Efficiencies) -> list[float]:
    return [predicted_iteration_s(run, plan_run(run, graphs, eff)[0]) for run in rows]


def fit_rows(
    rows: list[Run], start: Efficiencies, hold: dict[str, str] | None = None, log=print
) -> tuple[Fit, list[float]]:
    graphs: dict = {}
    eff = start
    fit: Fit | None = None
    for round_ in range(1, MAX_ROUNDS + 1):
        affine = affine_in_inverse_efficiency(lambda e: predict(rows, graphs, e), eff)
        terms = [
            Term(run.id, "iteration", run.published_iteration_s, 1, const, coef)
            for run, (const, coef) in zip(rows, affine, strict=True)
        ]
        fit = fit_efficiencies(eff, terms, hold=hold, upper=PHYSICAL_MAX)
        moved = max(abs(getattr(fit.efficiency, k) - getattr(eff, k)) for k in FITTED)
        log(
            f"round {round_}: "
            + ", ".join(f"{k}={getattr(fit.efficiency, k):.4f}" for k in FITTED)
            + f"  rms {100 * fit.error(eff):.1f}% -> {100 * fit.error(fit.efficiency):.1f}% (linearised)"
        )
        eff = fit.efficiency
        if moved < TOLERANCE:
            break
    assert fit is not None
    final = predict(rows, graphs, eff)
    return fit, final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="h100", help="the split of published_runs.yaml to fit (default h100)")
    ap.add_argument("--from", dest="start", help="start from these efficiencies, e.g. matmul=0.7 (default: spec's)")
    ap.add_argument("--hold", action="append", default=[], metavar="NAME=REASON",
                    help="keep an efficiency at the start value (repeatable), with the reason recorded")
    args = ap.parse_args(argv)
    runs = load_runs()
    if args.split not in runs.splits:
        raise SystemExit(f"--split: {args.split!r} is not one of {', '.join(runs.splits)}")
    split = runs.splits[args.split]
    rows = [r for r in runs.runs if r.gpu in split.gpus and r.role == "fit" and not r.unsupported]
    base = run_cluster(rows[0]).gpu
    start = base.efficiency
    if args.start:
        start = start.model_copy(update={k: float(v) for k, v in (x.split("=") for x in args.start.split(","))})
    print(f"Fitting {base.name} on {len(rows)} calibration rows ({', '.join(split.calibration)}); "
          f"validation sources ({', '.join(split.validation)}) are not read.")
    t0 = time.perf_counter()
    hold = dict(h.split("=", 1) for h in args.hold)
    fit, final = fit_rows(rows, start, hold)
    print(f"\n{'row':<28} {'published s':>12} {'fitted s':>10} {'err %':>7}")
    errs = []
    for run, pred in zip(rows, final, strict=True):
        err = pred / run.published_iteration_s - 1
        errs.append(abs(err))
        print(f"{run.id:<28} {run.published_iteration_s:>12.3f} {pred:>10.3f} {100 * err:>+7.1f}")
    errs.sort()
    print(f"calibration rows: median |err| {100 * errs[len(errs) // 2]:.1f}%, max {100 * errs[-1]:.1f}% "
          f"({time.perf_counter() - t0:.0f} s)")
    if fit.at_bound:
        print(f"\nAT A BOUND (absorbing other terms' error; hold them with --hold or fix the cost model): "
              f"{', '.join(fit.at_bound)}")
    print("\nefficiency block (bench/fit_published.py):")
    for k in ("matmul", "gemm_half_dim", "attention", "memory", "network"):
        why = f"fitted on {len(rows)} rows" if k in fit.fitted else f"kept: {fit.kept.get(k, 'held fixed')}"
        print(f"  {k}: {getattr(fit.efficiency, k):.4g}  # {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
