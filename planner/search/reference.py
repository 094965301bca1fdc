"""Exact reference solvers for the stage-partition problem, used to check the ILP (tests and benches).

- `brute_force_partition`: every contiguous partition and every per-stage recomputation, evaluated with
  the cost model itself (`planner.search.search.evaluate`) and its memory check; exact for any schedule.
- `brute_force_reported`: the same enumeration, minimising the figure the plan reports
  (`Evaluated.reported`: simulated pipeline plus tail); the search uses it for small candidates.
- `dp_partition`: a dynamic program for one stage per rank (GPipe/1F1B). The objective
  sum_s T_s + (m-1) max_s T_s + 2 sum p2p + max_r tail_r has two maxima; enumerating the bottleneck B
  and the tail Q over the finitely many values a stage can take turns it into a shortest-path DP over
  (units placed, stages used) with stage times <= B and tails <= Q, the classic exact approach for
  bottleneck-plus-sum objectives.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from planner.cost.model import (
    Candidate,
    largest_param_bytes,
    rank_memory,
    rank_tail_parts,
    stage_costs,
    stage_state_bytes,
    stage_time_with_gathers,
    stages_by_rank,
)
from planner.cost.schedules import in_flight_microbatches, rank_stage_counts, stage_rank
from planner.cost.terms import comm_buffer_bytes, rank_peak_bytes
from planner.search.evaluate import Evaluated, evaluate_fitting
from planner.search.problem import BoolArray, FloatArray, PartitionProblem, prefix_sums

IntArray = npt.NDArray[np.int64]

# (objective, partition, recompute per stage)
ReferenceResult = tuple[float, list[list[int]], list[str]]


def _partitions(n_units: int, n_stages: int, bounds: IntArray | None = None) -> Iterator[list[list[int]]]:
    """Every contiguous partition, in lexicographic order of the cuts; `bounds`: `_bounds(n_units, n_stages)`,
    where the caller has it."""
    rows = _bounds(n_units, n_stages) if bounds is None else bounds
    for row in rows.tolist():
        yield [list(range(row[i], row[i + 1])) for i in range(n_stages)]


def _fitting(pb: PartitionProblem) -> Iterator[tuple[Evaluated, list[list[int]], list[str]]]:
    """Every partition and recomputation that fits memory, evaluated, in lexicographic order of the cuts."""
    choices = _choices(pb.cand, pb.modes)
    n_units, n_stages = len(pb.graph.units), pb.cand.stages
    bounds = _bounds(n_units, n_stages)
    may_fit = _may_fit(pb, bounds, choices)
    for i, part in enumerate(_partitions(n_units, n_stages, bounds)):
        if not may_fit[i].any() or not pb.stages_ok(part):
            continue  # zero-bubble's weight step would leave a weight of a later stage without its gradient
        for j, rec in enumerate(choices):
            if not may_fit[i, j]:
                continue  # a rank's memory is over the capacity (`_may_fit`): evaluate_fitting says None
            ev = evaluate_fitting(pb, part, list(rec), pb.capacity)
            if ev is not None:
                yield ev, part, list(rec)


def _bounds(n_units: int, n_stages: int) -> IntArray:
    """`_partitions` as an array: row i the stage bounds (0, cuts..., n_units) of the i-th partition."""
    cuts = list(itertools.combinations(range(1, n_units), n_stages - 1))
    out = np.empty((len(cuts), n_stages + 1), dtype=np.int64)
    out[:, 0], out[:, -1] = 0, n_units
    if n_stages > 1:
        out[:, 1:-1] = np.array(cuts, dtype=np.int64).reshape(len(cuts), n_stages - 1)
    return out


# A rank counts as over the capacity in `_may_fit` only this far above it: its sums run in another order than
# `stage_costs`' and `rank_memory`'s (differences of prefix sums, a matrix product), so they may differ in the
# last bits, and what is that near the capacity is left to `evaluate_fitting`, which decides.
SCREEN_MARGIN = 1e-9


def _may_fit(pb: PartitionProblem, bounds: IntArray, choices: list[tuple[str, ...]]) -> BoolArray:
    """[partition, choice]: False where some rank's memory (`rank_memory`) is surely over the capacity. Most
    partitions of a small candidate do not fit; their ranks' memory is computed here for every partition at
    once, from the stages' memory terms as `stage_cost` computes them (`stage_state_bytes`, `comm_buffer_bytes`,
    in-flight activations) on sums over unit intervals, so that only those that may fit are evaluated (their
    times, one stage at a time, cost more than all of this)."""
    cand, options, costs = pb.cand, pb.options, pb.costs
    p, m, v, n_stages = cand.pp, cand.num_micro_batches, cand.virtual_stages, cand.stages
    largest = largest_param_bytes(costs)
    modes = sorted({r for rec in choices for r in rec})

    params, held, frozen, counted = (
        prefix_sums([getattr(c, f) for c in costs])
        for f in ("params_local", "experts_held", "frozen_local", "experts_counted")
    )
    act = {r: prefix_sums([c.act[r] for c in costs]) for r in modes}
    out_bytes = np.array([u.output_bytes for u in pb.graph.units], dtype=float)
    states: list[FloatArray] = []
    acts: dict[tuple[int, str], FloatArray] = {}  # per stage and mode; per micro-batch where a rank holds several
    for s in range(n_stages):
        lo, hi = bounds[:, s], bounds[:, s + 1]
        weights, gradients, optimizer = stage_state_bytes(
            cand, pb.dtype, params[hi] - params[lo], held[hi] - held[lo], frozen[hi] - frozen[lo],
            counted[hi] - counted[lo],
        )
        boundary = out_bytes[hi - 1] if s < n_stages - 1 else 0.0
        states.append(weights + gradients + optimizer + comm_buffer_bytes(boundary, cand, options, largest))
        inflight = in_flight_microbatches(cand.schedule, p, m, v, s)
        for r in modes:
            stage_acts = inflight * (act[r][hi] - act[r][lo])
            acts[s, r] = stage_acts / max(1, inflight) if v > 1 else stage_acts
    limit = pb.capacity * (1 + SCREEN_MARGIN)
    out = np.ones((len(bounds), len(choices)), dtype=bool)
    ranks = [[s for s in range(n_stages) if stage_rank(cand.schedule, p, v, s) == r] for r in range(p)]
    for j, rec in enumerate(choices):
        for rank, mine in enumerate(ranks):
            held_bytes = sum(states[s] for s in mine)
            if v > 1:
                per_mb = np.stack([acts[s, rec[s]] for s in mine], axis=1)  # [partition, the rank's stages]
                counts = np.array(rank_stage_counts(cand.schedule, p, m, v, rank), dtype=float)
                peak = (per_mb @ counts.T).max(axis=1)
            else:
                peak = acts[mine[0], rec[mine[0]]]
            out[:, j] &= rank_peak_bytes(held_bytes, peak, options) <= limit
    return out


def brute_force_partition(pb: PartitionProblem) -> ReferenceResult | None:
    """(objective, partition, recompute) minimising the cost model over every partition; None if none fits."""
    best: ReferenceResult | None = None
    for ev, part, rec in _fitting(pb):
        if best is None or ev.objective < best[0] - 1e-12:
            best = (ev.objective, part, rec)
    return best


def _choices(cand: Candidate, modes: tuple[str, ...]) -> list[tuple[str, ...]]:
    # With several stages per rank the search uses one recomputation mode for all stages (see ilp/).
    if cand.virtual_stages > 1:
        return [(mode,) * cand.stages for mode in modes]
    return list(itertools.product(modes, repeat=cand.stages))


def choices_count(n_units: int, cand: Candidate, modes: tuple[str, ...]) -> int:
    """How many (partition, recomputation) choices the brute-force functions go through."""
    rec = len(modes) if cand.virtual_stages > 1 else len(modes) ** cand.stages
    return math.comb(n_units - 1, cand.stages - 1) * rec


def brute_force_reported(pb: PartitionProblem) -> tuple[Evaluated, float] | None:
    """(the evaluated partition with the least reported figure, the least linear objective), both over
    every partition and recomputation that fits memory; None if none fits. Ties keep the first found
    (partitions in lexicographic order of their cuts), so the result is deterministic.

    The reported figure needs a simulation; a partition whose `busy_bound` is above the best figure found
    so far is not simulated. The partitions are simulated in the order of that bound (ties in the order
    found), so that the best comes early and the rest end at once."""
    fitting = [ev for ev, _, _ in _fitting(pb)]
    if not fitting:
        return None
    least_linear = min(ev.objective for ev in fitting)
    bounds = [busy_bound(ev) for ev in fitting]
    best: Evaluated | None = None
    best_at = -1
    for i in sorted(range(len(fitting)), key=lambda i: (bounds[i], i)):
        if best is not None and bounds[i] > best.reported * (1 + 1e-9):
            break  # its figure is at least that bound (to float rounding): above the best, as are the rest
        ev = fitting[i]
        if best is None or (ev.reported, i) < (best.reported, best_at):
            best, best_at = ev, i
    assert best is not None
    return best, least_linear


def busy_bound(ev: Evaluated) -> float:
    """A lower bound on `ev.reported` without simulating: the busiest rank runs each of its stages' forward
    and backward (`simulate_evaluated`'s times) for every micro-batch, one op at a time, before the tail."""
    busy = max(sum(stage_time_with_gathers(st) for st in mine) for mine in stages_by_rank(ev.stages, ev.cand.pp))
    return ev.cand.num_micro_batches * busy + ev.tail


def dp_partition(pb: PartitionProblem) -> ReferenceResult | None:
    """Exact optimum for GPipe/1F1B (one stage per rank) by bottleneck/tail enumeration plus DP."""
    cand, modes = pb.cand, pb.modes
    if cand.virtual_stages != 1 or cand.schedule not in ("gpipe", "1f1b"):
        raise ValueError("dp_partition handles one stage per rank (gpipe, 1f1b)")
    U, S = len(pb.graph.units), cand.stages
    cap = pb.capacity
    values_b: set[float] = set()
    values_q: set[float] = set()
    table: dict[tuple[int, int, int, str], tuple[float, float, float, bool]] = {}
    for s in range(S):
        for i in range(U):
            for j in range(i + 1, U + 1):
                for mode in modes:
                    t, p2p, tail, mem = _stage(pb, i, j, s, mode)
                    table[i, j, s, mode] = (t, p2p, tail, mem <= cap)
                    if mem <= cap:
                        values_b.add(t)
                        values_q.add(tail)
    best: ReferenceResult | None = None
    for B in sorted(values_b):
        for Q in sorted(values_q):
            # f[s][j]: min sum of (T + 2 p2p) placing units 0..j-1 in stages 0..s-1
            INF = float("inf")
            # each entry: (value, (first unit, recomputation) of the last stage placed, or None)
            f: list[list[tuple[float, tuple[int, str] | None]]] = [[(INF, None)] * (U + 1) for _ in range(S + 1)]
            f[0][0] = (0.0, None)
            for s in range(S):
                for i in range(U):
                    if f[s][i][0] == INF:
                        continue
                    for j in range(i + 1, U + 1):
                        for mode in modes:
                            t, p2p, tail, ok = table[i, j, s, mode]
                            if not ok or t > B or tail > Q:
                                continue
                            val = f[s][i][0] + t + p2p
                            if val < f[s + 1][j][0]:
                                f[s + 1][j] = (val, (i, mode))
            if f[S][U][0] == INF:
                continue
            obj = f[S][U][0] + (cand.num_micro_batches - 1) * B + Q
            if best is None or obj < best[0] - 1e-12:
                part: list[list[int]] = []
                rec: list[str] = []
                j = U
                for s in range(S, 0, -1):
                    prev = f[s][j][1]
                    assert prev is not None  # f[s][j] is finite, so a stage ends there
                    i, mode = prev
                    part.append(list(range(i, j)))
                    rec.append(mode)
                    j = i
                best = (obj, part[::-1], rec[::-1])
    return best


def _stage(pb: PartitionProblem, i: int, j: int, s: int, mode: str) -> tuple[float, float, float, float]:
    """Units i..j-1 as stage s: (time with ZeRO-3 gathers, doubled p2p, tail, rank memory), as the cost
    model counts them. The other stages of the placeholder partition do not affect stage s's figures."""
    graph, cluster, cand, options = pb.graph, pb.cluster, pb.cand, pb.options
    part = [[0] for _ in range(cand.stages)]
    part[s] = list(range(i, j))
    sc = stage_costs(graph, cluster, cand, part, [mode] * cand.stages, pb.costs, options)[s]
    p2p = 0.0 if s == cand.stages - 1 else 2.0 * sc.p2p
    tail = sum(rank_tail_parts([sc], cand, options, cluster, graph.source.dtype))
    mem = rank_memory([sc], cand, options)[sc.rank]
    return max(sc.compute, sc.zero3_gather), p2p, tail, mem
