"""SC21 Table 1 (Narayanan et al.): pinning each row's degrees gives a feasible plan, and the free search
finds a plan whose predicted throughput is at least the pinned one's (the free space contains it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from accuracy import CLUSTER, GPUS_PER_NODE, ROWS, degrees_request  # noqa: E402

from planner.hardware.load import load_cluster  # noqa: E402
from planner.pipeline import analyse, plan_model  # noqa: E402


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_pinned_row_is_feasible_and_free_search_is_no_worse(row):
    graph = analyse(degrees_request(row, False))
    pinned, _, res_pinned = plan_model(degrees_request(row, True), graph)
    free, _, res_free = plan_model(degrees_request(row, False), graph)
    assert (pinned.parallel.tp, pinned.parallel.pp, pinned.parallel.dp) == (row.t, row.p, row.dp)
    # The free space holds every v whose chunks split the blocks with the embedding and head counted (issue 26):
    # on 530B (105 + 2 units) one ILP of the many more candidates stops at its node limit, 2e-5 from its bound.
    # Pinned too since a rank's memory is counted at its schedule's instants (the last stage's loss held for one
    # micro-batch): interleaved pp35 x 3 fits in memory, its bound (33.9 s) is below the best plan (36.4 s, the
    # same plan as before) and its ILP stops at the node limit: the search reports a gap of 0.1%.
    assert res_pinned.status == "optimal" or (res_pinned.status == "node_limit" and res_pinned.gap <= 2e-3)
    assert res_free.status == "optimal" or (res_free.status == "node_limit" and res_free.gap <= 1e-4)
    cap = load_cluster(CLUSTER, row.gpus // GPUS_PER_NODE).gpu.memory_bytes
    assert 0 < pinned.predicted.peak_memory_bytes <= cap
    # the search's objective is exact, so the free optimum is no worse than the pinned one ...
    assert res_free.best.objective <= res_pinned.best.objective * (1 + 1e-9)
    # ... and so is the predicted (simulated) throughput the plans report
    assert free.predicted.samples_per_s >= pinned.predicted.samples_per_s * (1 - 1e-9)
