"""Train every model of the real-model corpus with every layout, as planned by `planner plan` for 4 CPU ranks,
and compare with one process: a table arch x layout of trained / refused(reason) / failed, the largest loss
difference over 3 steps and the largest relative gradient-norm difference.

    python bench/corpus_train.py                      # the full matrix (16 models x dp4, pp2xdp2)
    python bench/corpus_train.py --models t5,bart --layouts pp2xdp2,tp2xdp2 --keep /tmp/corpus
    python bench/corpus_train.py --zoo                # 23 more HF architectures x dp4, pp2xdp2, tp2xdp2
    python bench/corpus_train.py --models t5,bart,gpt2,gemma --layouts pp2v2xdp2,pp2zbvxdp2  # tied, one rank
    python bench/corpus_train.py --authored           # models as their authors write them x dp4, pp2xdp2,
                                                      # tp2xdp2 (and dp4ep2 for the MoE ones)

CI plans and checks all of this matrix and trains the cases no other e2e file trains
(tests/e2e/test_corpus_e2e.py; test_hf_e2e.py, test_tp_e2e.py and test_moe_e2e.py train the rest of the
corpus); this script trains all of it. Each plan runs in-process (the CLI), each launch.sh under torchrun
with 4 processes on the CPU (gloo); the single-process reference is trained once per model (the same
global batch and seed for every layout). `--zoo` runs the architectures of tests/fixtures/models/hf_zoo.py
instead (not in CI), with tp2xdp2 too. "trained": loss within 2e-5 of one process at every step and the
gradient norm within 1e-4 relative (tests/e2e/hf_plans.py's LOSS_TOL and NORM_TOL). A benchmark: it prints, it
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    import os

    os.environ.setdefault("PLANNER_NO_CACHE", "1")
    from e2e.hf_plans import (
        AUTHORED,
        AUTHORED_MOE,
        CORPUS,
        EP_LAYOUT,
        INTERLEAVED_LAYOUT,
        LAYOUTS,
        LOSS_TOL,
        NORM_TOL,
        TP_LAYOUT,
        ZOO,
        corpus_plan_args,
    )
    from e2e.plans import reference_of
    from e2e.test_train_e2e import STEPS, run, train
    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.plan import load_plan

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated (default: the corpus; any of {', '.join(ZOO)} too)")
    parser.add_argument(
        "--layouts", help=f"comma-separated, of {', '.join([*LAYOUTS, *TP_LAYOUT, *INTERLEAVED_LAYOUT])}"
    )
    parser.add_argument("--zoo", action="store_true", help="the zoo's architectures with tp2xdp2 too")
    parser.add_argument("--authored", action="store_true",
                        help="tests/e2e/hf_plans.py's AUTHORED models with tp2xdp2 too (and dp4ep2 for MoE)")
    parser.add_argument("--keep", type=Path, help="keep the plan directories here (default: a temporary folder)")
    args = parser.parse_args()
    args.models = args.models or ",".join(AUTHORED if args.authored else ZOO if args.zoo else CORPUS)
    args.layouts = args.layouts or ",".join([*LAYOUTS, *TP_LAYOUT] if args.zoo or args.authored else LAYOUTS)
    work = args.keep or Path(tempfile.mkdtemp(prefix="corpus-"))
    rows = []
    began = time.perf_counter()
    for name in args.models.split(","):
        reference = None
        extra = list(EP_LAYOUT) if args.authored and name in AUTHORED_MOE and "--layouts" not in sys.argv else []
        for layout in [*args.layouts.split(","), *extra]:
            out = work / f"{name}-{layout}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            result = CliRunner().invoke(app, corpus_plan_args(name, layout, out))
            planned = time.perf_counter() - start
            row = {"model": name, "layout": layout, "plan_s": planned, "status": "", "loss": "", "norm": "",
                   "train_s": 0.0}
            rows.append(row)
            if result.exit_code != 0:
                reason = " ".join(result.output.split()).removeprefix("Error: ")
                row["status"] = ("refused: " if result.exit_code == 2 else "failed (plan): ") + reason[:240]
                print(row, flush=True)
                continue
            plan = load_plan(out)
            start = time.perf_counter()
            try:
                run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], work)
                got = json.loads((out / "metrics.json").read_text())["steps"]
                if reference is None:
                    reference = train(reference_of(plan), work / f"{name}-reference", 1)["steps"]
            except BaseException as e:  # noqa: BLE001 - pytest.fail's exception is a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                row["status"] = "failed (launch): " + " ".join(str(e).split())[-300:]
                row["train_s"] = time.perf_counter() - start
                print(row, flush=True)
                continue
            row["train_s"] = time.perf_counter() - start
            loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, reference, strict=True))
            norm = max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(got, reference, strict=True))
            row["loss"], row["norm"] = f"{loss:.1e}", f"{norm:.1e}"
            row["status"] = "trained" if loss <= LOSS_TOL and norm <= NORM_TOL else "failed (differs from one process)"
            print(row, flush=True)
    print()
    print(f"{'model':<22} {'layout':<8} {'plan s':>6} {'train s':>7} {'loss diff':>9} {'norm rel':>8}  status")
    for r in rows:
        print(f"{r['model']:<22} {r['layout']:<8} {r['plan_s']:>6.1f} {r['train_s']:>7.1f} {r['loss']:>9} "
              f"{r['norm']:>8}  {r['status']}")
    counts = {s: sum(r["status"].startswith(s) for r in rows) for s in ("trained", "refused", "failed")}
    print(f"{len(rows)} cases: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f"; {time.perf_counter() - began:.0f} s wall")


if __name__ == "__main__":
    main()
