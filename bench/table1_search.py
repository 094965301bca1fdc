"""SC21 Table 1 (Narayanan et al.) degrees pinned versus the free search, on the planner's cost model.

    python bench/table1_search.py

For every GPT row the sample GPT (the row's preset) is planned on the row's DGX A100 cluster and batch
twice: with the row's tensor, pipeline and data-parallel degrees pinned (everything else searched), and
with nothing pinned. Prints both layouts, their predicted (simulated) iteration times and the free
search's gain. tests/test_megatron_rows.py asserts that the pinned plan is feasible and that the free
one is no slower; this prints the figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy import ROWS, degrees_request  # noqa: E402

from planner.pipeline import analyse, plan_model  # noqa: E402


def layout(plan) -> str:
    p = plan.parallel
    v = f"x{p.virtual_stages}" if p.virtual_stages > 1 else ""
    return f"dp{p.dp} tp{p.tp} pp{p.pp}{v} mbs{p.micro_batch_size} {p.schedule} z{p.zero_stage}"


def main() -> None:
    print(f"{'row':>5}  {'pinned (t, p, dp of Table 1)':<44} {'s/iter':>7}  {'free search':<44} {'s/iter':>7}  gain")
    for row in ROWS:
        t0 = time.perf_counter()
        graph = analyse(degrees_request(row, False))
        pinned, _, _ = plan_model(degrees_request(row, True), graph)
        free, _, _ = plan_model(degrees_request(row, False), graph)
        a, b = pinned.predicted.iteration_time_s, free.predicted.iteration_time_s
        print(
            f"{row.name:>5}  {layout(pinned):<44} {a:7.2f}  {layout(free):<44} {b:7.2f}  {a / b - 1:+5.1%}"
            f"   ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
