"""A valid cut on the ILP's tail variable with one stage per rank (GPipe, 1F1B).

There each rank holds one stage, and the tail is the largest over stages of
tau(i, j, q) = max(0, sync(Q_ij) - window(B_ij^q)) + step(P_ij), with P_ij the parameters of units
i..j-1, Q_ij the same as the data-parallel sync counts them (`UnitCost.sync_params`: experts sync over
fewer replicas), B_ij^q their backward in mode q, and sync / step / window the terms of
`planner.cost.terms` (`dp_sync_time`, `optimizer_step_time`, `sync_overlap_window`) as
`constraints.add_tail` writes them.
Any plan the ILP allows gives each stage an interval and a mode that fits memory there, so

    tail >= tau* = min over contiguous partitions of max_s min_{q fits at s} tau(i_s, j_s, q),

the least largest tail over partitions, found like `bounds.interval_bound`'s stage maximum: a dynamic
program over (stage, units placed) decides whether a value is feasible, a binary search over the finitely
many tau values finds the least. The mean over ranks (`bounds.tail_bound`) is far weaker when a few units
hold most of the parameters (heterogeneous models): there CBC could not close the gap in 5000 nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.cost.terms import dp_sync_time, linear_form, optimizer_step_time, sync_overlap_window
from planner.search.problem import PartitionProblem


@dataclass
class TailFloor:
    """Lower bounds with one stage per rank: ``tail`` on the tail (tau*), ``joint`` on (m-1) Z + tail."""

    tail: float
    joint: float


# Stage-maximum values tried for the joint bound before it settles for the separate minima beyond them.
MAX_JOINT_STEPS = 64


def tail_floor(pb: PartitionProblem, limit: float | None = None) -> TailFloor | None:
    """tau* and the joint bound J = min over partitions of (m-1) max_s T_s + max_s tau_s (see the module
    docstring), or None with several stages per rank or when no partition fits. ``limit``: an upper bound
    on J (a feasible plan's (m-1) Z + tail); only stage maxima that could beat it are tried."""
    tables, costs, cand, cluster, options, modes, dtype = (
        pb.tables, pb.costs, pb.cand, pb.cluster, pb.options, pb.modes, pb.dtype
    )
    if cand.virtual_stages != 1:
        return None
    U, S, m = len(costs), cand.stages, cand.num_micro_batches
    def span(xs: list[float]) -> np.ndarray:  # span[i, j] = the sum over units i..j-1
        pre = np.concatenate([[0.0], np.cumsum(xs)])
        out: np.ndarray = pre[None, :] - pre[:, None]
        return out

    params = span([c.params_local for c in costs])
    synced = span([c.sync_params for c in costs])  # as the data-parallel sync counts them (experts)
    a_sync, c_sync = linear_form(lambda x: dp_sync_time(x, cand, cluster, dtype))
    a_step, c_step = linear_form(lambda x: optimizer_step_time(x, cand, cluster, dtype))
    a_win, c_win = linear_form(lambda b: sync_overlap_window(b, cand, options))
    tau, time = {}, {}
    for q in modes:
        window = a_win * (tables.t[q] - tables.fwd) + c_win
        tau[q] = np.maximum(0.0, a_sync * synced + c_sync - window) + a_step * params + c_step
        time[q] = np.maximum(tables.t[q], tables.gather)  # T_s >= the stage's time and its ZeRO-3 gathers
    taus = np.unique(np.concatenate([tau[q][tables.valid] for q in modes]))
    times = np.unique(np.concatenate([time[q][tables.valid] for q in modes]))
    eps = 1 + 1e-12

    def feasible(z: float, t: float) -> bool:
        reach = np.zeros(U + 1, dtype=bool)
        reach[0] = True
        for s in range(S):
            fits = np.zeros_like(tables.valid)
            for q in modes:
                fits |= (time[q] <= z * eps) & (tau[q] <= t * eps) & tables.mem_ok[s, q]
            reach = (reach[:, None] & fits & tables.valid).any(axis=0)
        return bool(reach[U])

    def least(vals: np.ndarray, ok: Callable[[float], bool]) -> int | None:
        """Index of the least value of the sorted ``vals`` for which the monotone ``ok`` holds."""
        if len(vals) == 0 or not ok(float(vals[-1])):
            return None
        lo, hi = 0, len(vals) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(float(vals[mid])):
                hi = mid
            else:
                lo = mid + 1
        return lo

    inf = float("inf")
    it = least(taus, lambda t: feasible(inf, t))
    iz = least(times, lambda z: feasible(z, inf))
    if it is None or iz is None:
        return None
    tau_min, z_min = float(taus[it]), float(times[iz])
    # J = min over Z of (m-1) Z + tau*(Z), tau*(Z) non-increasing in Z and >= tau_min: scan Z upwards
    # from its least feasible value while (m-1) Z + tau_min can still beat the best (and the limit).
    best = inf if limit is None else limit
    hi = len(taus)
    for step, k in enumerate(range(iz, len(times))):
        z = float(times[k])
        if (m - 1) * z + tau_min >= best:
            break
        if step == MAX_JOINT_STEPS:
            best = min(best, (m - 1) * z + tau_min)  # every larger Z gives at least this
            break
        j = least(taus[:hi], functools.partial(feasible, z))
        if j is None:
            continue
        hi = j + 1
        best = min(best, (m - 1) * z + float(taus[j]))
    floor = (m - 1) * z_min + tau_min
    # with a limit nothing beat, every partition gives at least the limit
    return TailFloor(tail=tau_min, joint=max(floor, best if best < inf else floor))
