"""An exact dynamic program for one stage per rank (GPipe, 1F1B) on any unit sequence.

With one stage per rank the linear objective (`planner.cost.model.iteration_linear`) is

    sum_s (T_s + 2 p2p_s) + (m-1) max_s T_s + max_s tau_s,

T_s the stage's time (with its ZeRO-3 gathers), p2p_s its outgoing send and tau_s its rank's tail
(exposed gradient sync plus optimizer step). Fixing caps B on every T_s and Q on every tau_s turns it
into a shortest path over (stages used, units placed): F(B, Q) = the least sum under the caps, each
stage taking its cheapest recomputation mode that fits the caps and memory (`IntervalTables.mem_ok`, the
ILP's own memory row). The optimum is min over (B, Q) of F(B, Q) + (m-1) B + Q, B and Q ranging over
the finitely many values a stage can take: the classic exact approach for bottleneck-plus-sum
objectives (`planner.search.reference.dp_partition` is its slow reference).

The (B, Q) grid is searched by branch and bound over index rectangles: F falls as the caps grow, so on
a rectangle [b1, b2] x [q1, q2] the objective is at least F(b2, q2) + (m-1) B_b1 + Q_q1, and a rectangle
whose bound reaches the best plan found is dropped. Each point evaluated gives a plan (the DP's path),
whose own objective is at most its point's value. The search stops after MAX_PATHS shortest paths (a
count, so that the result never depends on the machine) and the caller falls back to CBC.

The stage figures are computed as the cost model computes them on floats (a collective over no bytes
costs nothing), and the result is checked by `planner.search.evaluate.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from planner.cost.model import Candidate
from planner.cost.terms import (
    dp_sync_time,
    linear_form,
    optimizer_step_time,
    p2p_time,
    sync_overlap_window,
    zero3_gather_time,
)
from planner.search.problem import PartitionProblem

FloatArray = npt.NDArray[np.float64]
INF = float("inf")
# Shortest paths the branch and bound may compute before the caller falls back to CBC.
MAX_PATHS = 600


@dataclass
class ChainResult:
    """The optimum (objective, partition, recomputation), or none below the limit (`partition` None)."""

    objective: float | None
    partition: list[list[int]] | None
    recompute: list[str] | None
    paths: int  # shortest paths computed


def applies(cand: Candidate) -> bool:
    """Whether the DP solves this candidate: one stage per rank, GPipe or 1F1B (the schedules whose linear
    time is sum + (m-1) max)."""
    return cand.virtual_stages == 1 and cand.schedule in ("gpipe", "1f1b") and cand.stages > 1


def _on_floats(a: float, c: float, x: FloatArray) -> FloatArray:
    """A collective's linear form a x + c on an array, with the cost model's float guard: no bytes, no time."""
    out: FloatArray = np.where(x > 0, a * x + c, 0.0)
    return out


def solve_chain(
    pb: PartitionProblem,
    limit: float | None,
    incumbent: tuple[list[list[int]], list[str], float] | None = None,
    low: float = 0.0,
) -> ChainResult | None:
    """The least objective below ``limit`` (None: no limit) over the partitions that fit memory, with
    ``incumbent`` a known plan (partition, recomputation, objective) to beat and ``low`` a valid lower
    bound on the optimum (a plan within 1e-9 of it is optimal); None when the branch and bound ran out of
    paths (MAX_PATHS)."""
    graph, cluster, cand, costs, modes, options = pb.graph, pb.cluster, pb.cand, pb.costs, pb.modes, pb.options
    tables, dtype = pb.tables, pb.dtype
    U, S, m = len(costs), cand.stages, cand.num_micro_batches

    def span(xs: list[float]) -> FloatArray:
        pre = np.concatenate([[0.0], np.cumsum(xs)])
        out: FloatArray = pre[None, :] - pre[:, None]
        return out

    params = span([c.params_local for c in costs])
    synced = span([c.sync_params for c in costs])
    valid = tables.valid
    a_sync, c_sync = linear_form(lambda x: dp_sync_time(x, cand, cluster, dtype))
    a_step, c_step = linear_form(lambda x: optimizer_step_time(x, cand, cluster, dtype))
    a_win, c_win = linear_form(lambda b: sync_overlap_window(b, cand, options))
    a_gat, c_gat = linear_form(lambda x: zero3_gather_time(x, cand, cluster, dtype))
    sync = _on_floats(a_sync, c_sync, synced) if cand.dp_shard > 1 else np.zeros_like(params)
    gather = _on_floats(a_gat, c_gat, synced) if cand.zero_stage == 3 and cand.dp_shard > 1 else np.zeros_like(params)
    step = np.where(params > 0, a_step * params + c_step, 0.0)
    T: dict[str, FloatArray] = {}
    tau: dict[str, FloatArray] = {}
    for q in modes:
        T[q] = np.where(valid, np.maximum(tables.t[q], gather), INF)
        window = a_win * (tables.t[q] - tables.fwd) + c_win
        tau[q] = np.where(valid, np.maximum(0.0, sync - window) + step, INF)
    # 2 p2p of a stage ending before unit j (its boundary is unit j-1's output), for every stage but the last
    send = np.array([0.0] + [2.0 * p2p_time(float(u.output_bytes), cand, cluster) for u in graph.units])
    # per stage and mode: the stage time where the interval fits memory there
    fits = {(s, q): np.where(tables.mem_ok[s, q] & valid, T[q], INF) for s in range(S) for q in modes}
    if not any(np.isfinite(arr).any() for arr in fits.values()):
        return ChainResult(None, None, None, 0)
    b_vals = np.unique(np.concatenate([T[q][np.isfinite(fits[s, q])] for s in range(S) for q in modes]))
    q_vals = np.unique(np.concatenate([tau[q][np.isfinite(fits[s, q])] for s in range(S) for q in modes]))
    paths = 0

    # Stage s starts at a unit i in [s, U - S + s] (each stage before it and after it holds one) and ends before
    # j in [s + 1, U - S + s + 1]: the rest of the (i, j) table cannot lie on a path to U. Each stage's slice of
    # the tables, stacked over the modes, is cut once for every shortest path.
    slices: list[tuple[slice, slice, FloatArray, FloatArray, FloatArray]] = []
    for s in range(S):
        rows, cols = slice(s, U - S + s + 1), slice(s + 1, U - S + s + 2)
        t_s, tau_s = (np.stack([table[q][rows, cols] for q in modes]) for table in (T, tau))
        slices.append((rows, cols, t_s, tau_s, np.stack([fits[s, q][rows, cols] for q in modes])))
    reach = np.arange(U - S + 1)

    def shortest(B: float, Q: float, path: bool = False) -> tuple[float, list[tuple[int, str]] | None]:
        """F(B, Q), and with ``path`` the (first unit, mode) of each stage of a least path."""
        nonlocal paths
        paths += 1
        f = np.full(U + 1, INF)
        f[0] = 0.0
        choice: list[tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]] = []
        for s, (rows, cols, t_s, tau_s, fit_s) in enumerate(slices):
            per_mode = np.where((t_s <= B) & (tau_s <= Q), fit_s, INF)
            if path:
                best_mode = per_mode.argmin(axis=0)
                cost = np.take_along_axis(per_mode, best_mode[None], axis=0)[0]
            else:
                cost = per_mode.min(axis=0)
            tot = f[rows, None] + cost
            f = np.full(U + 1, INF)
            if path:
                src = tot.argmin(axis=0)
                f[cols] = tot[src, reach]
                choice.append((src + s, best_mode[src, reach]))
            else:
                f[cols] = tot.min(axis=0)
            if s < S - 1:
                f = f + send
        if not np.isfinite(f[U]) or not path:
            return float(f[U]), None
        out: list[tuple[int, str]] = []
        j = U
        for s in range(S - 1, -1, -1):
            k = j - (s + 1)  # j's column in stage s's slice
            i = int(choice[s][0][k])
            out.append((i, modes[int(choice[s][1][k])]))
            j = i
        return float(f[U]), out[::-1]

    def plan_of(stages: list[tuple[int, str]]) -> tuple[list[list[int]], list[str], float]:
        cuts = [i for i, _ in stages] + [U]
        part = [list(range(cuts[s], cuts[s + 1])) for s in range(S)]
        rec = [q for _, q in stages]
        t = [float(T[rec[s]][cuts[s], cuts[s + 1]]) for s in range(S)]
        obj = sum(t) + sum(float(send[cuts[s + 1]]) for s in range(S - 1))
        obj += (m - 1) * max(t) + max(float(tau[rec[s]][cuts[s], cuts[s + 1]]) for s in range(S))
        return part, rec, obj

    base, _ = shortest(INF, INF)
    if not np.isfinite(base):
        return ChainResult(None, None, None, paths)
    best = INF if limit is None else limit
    found: tuple[list[list[int]], list[str], float] | None = None
    if incumbent is not None and incumbent[2] < best:
        best, found = incumbent[2], incumbent
    memo: dict[tuple[int, int], float] = {}

    def F(b: int, q: int) -> float:
        if (b, q) not in memo:
            memo[b, q] = shortest(float(b_vals[b]), float(q_vals[q]))[0]
        return memo[b, q]

    # Rectangles of (B, Q) indices, smallest lower bound first; the lowest corner of each is evaluated.
    stack = [(0, len(b_vals) - 1, 0, len(q_vals) - 1)]
    while stack:
        if best <= low * (1 + 1e-9):
            break
        if paths > MAX_PATHS:
            return None
        b1, b2, q1, q2 = stack.pop()
        low_b, low_q = float(b_vals[b1]), float(q_vals[q1])
        if base + (m - 1) * low_b + low_q >= best:
            continue
        if F(b2, q2) + (m - 1) * low_b + low_q >= best:
            continue
        corner = F(b1, q1)
        if corner + (m - 1) * low_b + low_q < best:
            _, stages = shortest(low_b, low_q, path=True)
            assert stages is not None
            plan = plan_of(stages)
            if plan[2] < best:
                best, found = plan[2], plan
        if b1 == b2 and q1 == q2:
            continue
        # split the longer side; the half nearer the low corner goes last on the stack (searched first)
        if b2 - b1 >= q2 - q1:
            mid = (b1 + b2) // 2
            stack += [(mid + 1, b2, q1, q2), (b1, mid, q1, q2)]
        else:
            mid = (q1 + q2) // 2
            stack += [(b1, b2, mid + 1, q2), (b1, b2, q1, mid)]
    if found is None:
        return ChainResult(None, None, None, paths)
    return ChainResult(found[2], found[0], found[1], paths)
