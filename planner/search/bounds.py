"""Valid lower bounds on a candidate's optimum, cheap enough to compute for every candidate.

The outer search solves ILPs in order of these bounds and stops once the next bound exceeds the k-th
best solved plan, so the tighter the bound the fewer ILPs run; a bound must never exceed the ILP's
optimum, or the search would lose exactness (the hypothesis tests compare the search with brute force).

Two bounds, the larger is used:

- `simple_bound`, for any unit sequence: the whole model's work spread evenly over the stages (no
  bubble beyond the schedule's fill/drain of an average stage), the mean exposed gradient sync and
  optimizer step, and a memory bound (the mean rank's states and activations).
- `block_bound`, for transformer-shaped models (prefix + a run of identical blocks + suffix, the ILP's
  count form): exact minima of the bottleneck terms over *integer* block counts under each stage's (or
  rank's) memory capacity. For a bottleneck value Z each stage can hold at most a computable number of
  blocks (by time, by ZeRO-3 gather time and by memory, for its best recomputation mode); Z is feasible
  when those capacities add up to the number of blocks. The smallest feasible Z is found by binary
  search over the finitely many values a stage time can take. Where the ILP's memory row couples the
  stages of one rank (several stages per rank) the rank's activation peak is relaxed to the mean of its
  stages, which only lowers the bound. The bottleneck terms and the tail (exposed gradient sync plus
  optimizer step, largest over ranks) are then minimised jointly (`_joint`): a rank's tail grows with
  its blocks and shrinks with the backward of its first stage, whose blocks the largest stage time
  caps, so the bound sees that an uneven rank (the one with the embedding or the head) pays a longer
  tail. The ILP adds these bounds as cuts and starts from a solution built from their optimum.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from planner.cost.memory import model_state_bytes_per_param
from planner.cost.model import Candidate, UnitCost
from planner.cost.schedules import in_flight_microbatches, rank_stage_counts, stage_rank
from planner.cost.terms import (
    comm_buffer_bytes,
    dp_sync_time,
    linear_form,
    memory_budget,
    model_state_bytes,
    optimizer_step_time,
    p2p_time,
    pipeline_time,
    rank_capacity,
    rank_peak_bytes,
    sync_overlap_window,
    zero3_gather_time,
)
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.search.problem import BoolArray, FloatArray, PartitionProblem

# PartitionProblem derives these (planner.search.problem); they stay importable from here.
from planner.search.problem import IntervalTables as IntervalTables
from planner.search.problem import Totals as Totals
from planner.search.problem import gather_coefficients as gather_coefficients

INF = float("inf")
# (capacities, minimum counts) per stage or rank for a bottleneck value
Caps = Callable[[float], tuple[FloatArray, FloatArray]]
_Arg = TypeVar("_Arg")


@dataclass
class Bounds:
    time: float
    memory: float  # lower bound on the busiest rank's bytes (compared with the GPU's capacity)
    feasible: bool = True  # False when no partition can fit memory under any allowed recomputation
    block: BlockBounds | None = None  # the count form's bounds, for the ILP's cuts and start
    interval: IntervalBounds | None = None  # the assignment form's


def lower_bounds(pb: PartitionProblem, joint: bool = True, tail: float | None = None) -> Bounds:
    """The best valid bound available for this candidate (see the module docstring); joint=False skips
    the joint minimum with the tail (cheaper, looser: the mean tail is added instead); ``tail``: the
    candidate's `tail_bound`, when the caller has it."""
    cand, costs, run = pb.cand, pb.costs, pb.run
    if tail is None:
        tail = tail_bound(pb)
    b = simple_bound(pb, tail)
    if cand.stages == 1 or b.memory > pb.capacity:
        return b
    if run is None:
        ib = interval_bound(pb)
        if ib is None:
            return Bounds(b.time, b.memory, feasible=False)
        tight = ib.pipeline(cand, costs) + tail
        return Bounds(max(b.time, tight + comm_bound(pb)), b.memory, interval=ib)
    blk = block_bound(pb, joint)
    if blk is None:
        return Bounds(b.time, b.memory, feasible=False)
    tight = blk.total() + comm_bound(pb, run)
    if not joint:
        tight += tail
    return Bounds(max(b.time, tight), b.memory, block=blk)


def simple_bound(pb: PartitionProblem, tail: float | None = None) -> Bounds:
    """Stage times sum to at least the whole model's work W (cheapest recomputation) and, under ZeRO-3,
    to at least the sum of the weight gathers; the largest is at least the mean. The tail is at least the
    mean over ranks of exposed gradient sync plus the optimizer step (``tail``: `tail_bound`'s value, when
    the caller has it). Memory: the busiest rank holds at least the mean of all ranks' bytes."""
    tot, cand, cluster, dtype, options = pb.totals, pb.cand, pb.cluster, pb.dtype, pb.options
    work, fwd, params = tot.work, tot.fwd, tot.params
    S, p, m = cand.stages, cand.pp, cand.num_micro_batches
    work = max(work, zero3_gather_time(tot.sync, cand, cluster, dtype))
    # the stage times sum to `work`; the largest stage is at least the mean, and so is the largest rank
    pipe = pipeline_time(cand, work, work / S, work / p, fwd / S, 0.0)
    states = model_state_bytes(params, model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp_shard))
    min_inflight = _min_in_flight(cand.schedule, p, m, cand.virtual_stages)
    acts = min_inflight * tot.act  # each rank holds at least min_inflight times its activations per micro-batch
    memory = rank_peak_bytes(states / p, acts / p, options)
    if tail is None:
        tail = tail_bound(pb)
    return Bounds(pipe + tail, memory)


def interval_vars(pb: PartitionProblem, limit: float | None, rest: float) -> dict[int, list[tuple[int, int, str]]]:
    """The (i, j, mode) each stage s of the interval-form ILP needs: every stage keeps at least one unit
    and the order; with one stage per rank, the memory row fits at s; and, given `limit` (an upper bound
    on the optimum: a feasible plan's objective, or the cutoff) and `rest` (a lower bound on the
    objective's other terms: work, point-to-point and tail), the stage time (the forward for zero-bubble)
    stays within what the limit leaves for the largest stage. An optimal plan uses no other interval."""
    cand, modes, tables, U = pb.cand, pb.modes, pb.tables, len(pb.graph.units)
    S, p, m = cand.stages, cand.pp, cand.num_micro_batches
    cap = INF
    if limit is not None:
        coef = m - 1 if cand.virtual_stages == 1 else p - 1
        if coef > 0:
            cap = (limit - rest) / coef
            cap += 1e-9 * max(abs(cap), abs(limit))
    out: dict[int, list[tuple[int, int, str]]] = {}
    stage_ok = pb.stage_ok  # zero-bubble: the intervals a stage after the first may hold
    for s in range(S):
        firsts = [0] if s == 0 else range(s, U - S + s + 1)
        keep = []
        for i in firsts:
            for j in [U] if s == S - 1 else range(i + 1, U - S + s + 2):
                if s > 0 and stage_ok is not None and not stage_ok[i, j]:
                    continue
                for r in modes:
                    size = tables.fwd[i, j] if cand.schedule == "zero-bubble" else tables.t[r][i, j]
                    if size > cap:
                        continue
                    if cand.virtual_stages == 1 and not tables.mem_ok[s, r][i, j]:
                        continue
                    keep.append((i, j, r))
        out[s] = keep
    # Only intervals on a complete path matter: stage s must start where stages 0..s-1 can end and end
    # where stages s+1.. can start and still reach the last unit.
    starts: list[set[int]] = [{0}] + [set() for _ in range(S)]
    for s in range(S):
        starts[s + 1] = {j for i, j, _ in out[s] if i in starts[s]}
    ends: list[set[int]] = [set() for _ in range(S - 1)] + [{U}]
    for s in range(S - 1, 0, -1):
        ends[s - 1] = {i for i, j, _ in out[s] if j in ends[s] and i in starts[s]}
    return {s: [(i, j, r) for i, j, r in out[s] if i in starts[s] and j in ends[s]] for s in range(S)}


def tail_coefficients(cand: Candidate, cluster: ClusterSpec, dtype: str) -> tuple[float, float, float]:
    """(a, c, r): one stage's gradient sync is a * params + c and the optimizer step r * params, the linear
    forms of `planner.cost.terms.dp_sync_time` and `optimizer_step_time`."""
    opt_rate, _ = linear_form(lambda x: optimizer_step_time(x, cand, cluster, dtype))
    a, c = linear_form(lambda x: dp_sync_time(x, cand, cluster, dtype))
    return a, c, opt_rate


def _least(vals: Sequence[float] | FloatArray, ok: Callable[[float], bool]) -> float | None:
    """The least value of the sorted `vals` for which the monotone predicate `ok` holds, or None."""
    lo, hi = 0, len(vals)
    if hi == 0 or not ok(vals[-1]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(vals[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(vals[lo])


def _joint(
    A: float,
    a_vals: list[float],
    a_start: float,
    caps: Caps,
    C: float,
    c_vals: list[float],
    c_start: float,
    tails_at: Callable[[float], FloatArray],
    L: int,
) -> tuple[float, tuple[float, float, float] | None]:
    """min over a >= a_start in a_vals and c >= c_start in c_vals of A a + C c + Q(a, c): Q is the least
    max over ranks of the tail when rank r holds N_r blocks, lo_r <= N_r <= cap_r(a), sum N_r = L
    (caps(a) gives the (cap, lo) arrays) and its tails are tails_at(c) (ranks x 0..L blocks; c bounds the
    blocks of a rank's first stage). Each rank's tail is convex in N_r, so the N_r that keep it <= Q form
    an interval.

    a is the bottleneck term (the largest stage with one stage per rank, the largest rank otherwise), c
    the largest stage (forward, for zero-bubble) when a rank holds several. Q falls as a or c grow, so the
    loops stop once A a + C c + (Q at the largest a, this c) cannot beat the best: the result is the
    exact minimum of this relaxation (or, past 32 steps, a smaller and still valid value). Returns it
    with its (a, c, Q) when that was evaluated (the values a start solution is built from)."""
    idx = np.arange(L + 1)

    def qmin(a: float, tails: FloatArray) -> float:
        hi, lo = caps(a)
        hi = np.minimum(hi, L)
        T = np.where((idx[None, :] >= lo[:, None]) & (idx[None, :] <= hi[:, None]), tails, INF)
        vals_q = np.unique(T[np.isfinite(T)])
        if len(vals_q) == 0:
            return INF

        def ok(Q: float) -> bool:
            m = T <= Q
            if not m.any(axis=1).all():
                return False
            first = m.argmax(axis=1)
            last = L - m[:, ::-1].argmax(axis=1)
            return bool(first.sum() <= L <= last.sum())

        q = _least(vals_q, ok)
        return INF if q is None else float(q)

    q_floor = qmin(a_vals[-1], tails_at(c_vals[-1]))
    if q_floor == INF:
        return INF, None

    def over_a(c: float, best: float) -> tuple[float, tuple[float, float, float] | None]:
        tails = tails_at(c)
        q_c = qmin(a_vals[-1], tails)

        def at(a: float, _best: float) -> tuple[float, tuple[float, float, float] | None]:
            q = qmin(a, tails)
            return A * a + C * c + q, (a, c, q)

        return _scan_min(a_vals, a_start, 32, lambda a: A * a + C * c + q_c, at, best)

    return _scan_min(c_vals, c_start, 16, lambda c: C * c + A * a_start + q_floor, over_a)


def _scan_min(
    vals: list[float],
    start: float,
    max_steps: int,
    lower: Callable[[float], float],
    value: Callable[[float, float], tuple[float, _Arg | None]],
    best: float = INF,
) -> tuple[float, _Arg | None]:
    """min of `best` and value(v, best so far)[0] over the sorted vals from start on, where lower(v) <=
    value(v)[0] and lower grows with v: stops once lower reaches the best; past max_steps the next lower
    bounds all the rest. Returns (best, the argument value(v)[1] of the best evaluated v, or None)."""
    arg: _Arg | None = None
    i0 = bisect.bisect_left(vals, start)
    for k in range(len(vals) - i0):
        v = vals[i0 + k]
        lo = lower(v)
        if lo >= best:
            break
        if k >= max_steps:
            best = min(best, lo)
            break
        val, a = value(v, best)
        if val < best:
            best = val
            arg = a if a is not None else arg
    return best, arg


def _distribute(
    tails: FloatArray, lo: FloatArray, hi: FloatArray, Q: float, L: int, ext_t: float | FloatArray, t: float
) -> list[int] | None:
    """Block counts per rank with lo <= N <= hi, tail <= Q and sum L: each rank's least allowed count,
    then the rest one by one to the rank with the least time (ext_t + N t)."""
    ok = (tails <= Q * (1 + 1e-12)) & (np.arange(tails.shape[1])[None, :] >= lo[:, None])
    ok &= np.arange(tails.shape[1])[None, :] <= hi[:, None]
    if not ok.any(axis=1).all():
        return None
    first = ok.argmax(axis=1)
    last = tails.shape[1] - 1 - ok[:, ::-1].argmax(axis=1)
    n = [int(x) for x in first]
    ext_t = np.broadcast_to(np.asarray(ext_t, dtype=float), (len(n),))
    while sum(n) < L:
        room = [r for r in range(len(n)) if n[r] < last[r]]
        if not room:
            return None
        r = min(room, key=lambda r: (ext_t[r] + (n[r] + 1) * t, r))
        n[r] += 1
    return n if sum(n) == L else None


def _split_ranks(n_rank: list[int], mine: dict[int, list[_Stage]], stage_cap: FloatArray, S: int) -> list[int] | None:
    """Split each rank's blocks over its stages: the first stage (whose backward hides the gradient
    sync) as many as its cap allows, the others evenly, each within its cap and minimum."""
    counts = [0] * S
    for r, sts in mine.items():
        n = n_rank[r]
        others = sts[1:]
        need = sum(st.min_blocks for st in others)
        first = int(min(n - need, stage_cap[sts[0].index]))
        if first < sts[0].min_blocks:
            return None
        counts[sts[0].index] = first
        rest = n - first
        for st in others:
            counts[st.index] = st.min_blocks
            rest -= st.min_blocks
        while rest > 0:
            room = [st for st in others if counts[st.index] < stage_cap[st.index]]
            if not room:
                return None
            st = min(room, key=lambda st: (counts[st.index], st.index))
            counts[st.index] += 1
            rest -= 1
    return counts


@functools.lru_cache(maxsize=4096)
def _min_in_flight(schedule: str, p: int, m: int, v: int) -> float:
    """A factor every rank's activation peak is at least, times the sum of its stages' activations per micro-batch
    however they are split: the least over ranks of `_rank_holds`. One stage per rank: the least in-flight count."""
    return min(_rank_holds(schedule, p, m, v))


@functools.lru_cache(maxsize=4096)
def _rank_holds(schedule: str, p: int, m: int, v: int) -> tuple[float, ...]:
    """Per rank, 1 / sum_j 1/k_j with k_j its stages' own peaks (`in_flight_microbatches`; 0 where a stage holds
    none): the largest h with max_j k_j a_j >= h sum_j a_j for every a >= 0 (equality where every k_j a_j is the
    same), so the rank's peak is at least h times the sum of its stages' activations per micro-batch."""
    ranks: list[list[int]] = [[] for _ in range(p)]
    for s in range(p * v):
        ranks[stage_rank(schedule, p, v, s)].append(in_flight_microbatches(schedule, p, m, v, s))
    return tuple(0.0 if min(ks) == 0 else 1.0 / sum(1.0 / k for k in ks) for ks in ranks)


@functools.lru_cache(maxsize=1024)
def _rank_memory_forms(schedule: str, p: int, m: int, v: int) -> tuple[FloatArray, FloatArray]:
    """Lower bounds on each rank's activation peak linear in its stages' activations a_j per micro-batch when
    its blocks' part is known only as their sum A: (on_blocks f x p, on_ext f x p x v), form f of rank r being
    on_blocks[f, r] * A + sum_j on_ext[f, r, j] * ext_j. Per rank: h (A + sum_j ext_j) with h its `_rank_holds`
    factor, and at each peak instant c (`rank_stage_counts`) min_j c_j A + c . ext; ranks with fewer forms repeat
    their first."""
    forms: list[list[tuple[float, tuple[float, ...]]]] = []
    for r, h in enumerate(_rank_holds(schedule, p, m, v)):
        counts = rank_stage_counts(schedule, p, m, v, r)
        forms.append([(h, (h,) * v)] + [(float(min(c)), tuple(map(float, c))) for c in counts])
    n = max(len(f) for f in forms)
    on_blocks = np.array([[f[i][0] if i < len(f) else f[0][0] for f in forms] for i in range(n)])
    on_ext = np.array([[f[i][1] if i < len(f) else f[0][1] for f in forms] for i in range(n)])
    return on_blocks, on_ext


def tail_bound(pb: PartitionProblem) -> float:
    """Mean over ranks of (exposed sync + optimizer step): at most the largest rank's. Each of the p
    ranks pays the sync's latency at least once (the constant of its linear form)."""
    tot, cand, cluster, dtype, options = pb.totals, pb.cand, pb.cluster, pb.dtype, pb.options
    p = cand.pp
    params = tot.params
    a_sync, c_sync = linear_form(lambda x: dp_sync_time(x, cand, cluster, dtype))
    sync = a_sync * tot.sync + p * c_sync
    windows = sync_overlap_window(tot.bwd_max, cand, options)
    out: float = (max(0.0, sync - windows) + p * optimizer_step_time(params / p, cand, cluster, dtype)) / p
    return out


def linear_bounds_reported(cand: Candidate) -> bool:
    """Whether the linear objective is at most the reported figure (simulated pipeline plus the same
    tail) for every partition, so that every bound on the linear optimum is also one on the reported.

    One stage: both are m times the stage's time. GPipe with one stage per rank: let r be the stage of
    the largest t_r = f_r + b_r. The actions F(0..r-1, 0), F(r, 0..m-1), F(r+1..p-1, m-1),
    B(p-1..r+1, 0), B(r, 0..m-1), B(r-1..0, m-1) each wait for the one before (same rank in GPipe's
    order, or its input), so the simulation takes at least their sum,
    sum_s t_s + (m-1) t_r plus every link once each way: the linear form. Under 1F1B, interleaving and
    zero-bubble the simulation can be shorter (1F1B hides part of the fill behind an early bottleneck),
    so `reported_bound` is used for them. tests/test_reported_exact.py checks this on random times."""
    return cand.stages == 1 or (cand.schedule == "gpipe" and cand.virtual_stages == 1)


def backward_share(costs: list[UnitCost], cand: Candidate) -> float:
    """An upper bound on b_s / t_s for any stage s: the simulator's backward b_s = t_s - f_s, and t_s is a
    sum of unit times (a mediant of the units' shares), unless ZeRO-3 gathers make it longer (then 1)."""
    if cand.zero_stage == 3:
        return 1.0
    share = 0.0
    for c in costs:
        b = max(c.bwd.values())
        if c.fwd + b > 0:
            share = max(share, b / (c.fwd + b))
    return share


def one_f_one_b_bound(costs: list[UnitCost], cand: Candidate, beta: float) -> float:
    """1F1B with one stage per rank: a lower bound, over every contiguous partition, on
    max_r c_r t_r with c_r = m - 1 - (min(m, p - r) - 1) beta, the part of `reported_bound`'s path bound
    beyond the work W (stages with c_r < 0 are left out, which only lowers it).

    t_r is at least the sum of its units' cheapest times (memory and ZeRO-3 gathers ignored, which only
    lowers it). For a value Y stage r can hold the longest run of units with c_r t_r <= Y; taking the
    longest run at each stage in turn is optimal for contiguous partitions, so Y is feasible when that
    greedy pass places every unit. The least feasible Y is found by bisection and the largest infeasible
    value returned, so the result never exceeds it."""
    p, m = cand.pp, cand.num_micro_batches
    coef = [m - 1 - (min(m, p - r) - 1) * beta for r in range(p)]
    times = [c.fwd + min(c.bwd.values()) for c in costs]
    total = sum(times)
    if total <= 0 or max(coef) <= 0:
        return 0.0

    def feasible(Y: float) -> bool:
        i, n = 0, len(times)
        for r in range(p):
            if coef[r] <= 0:
                return True  # every later unit may go to this unconstrained stage
            room = Y / coef[r]
            acc = 0.0
            while i < n and acc + times[i] <= room:
                acc += times[i]
                i += 1
            if i == n:
                return True
        return False

    lo, hi = 0.0, max(c for c in coef) * total
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo


def reported_bound(
    pb: PartitionProblem,
    linear_bound: float,
    beta: float = 1.0,
    comm: float = 0.0,
    tight: BlockBounds | IntervalBounds | None = None,
    path: float = 0.0,
    tail: float | None = None,
) -> float:
    """A valid lower bound on the figure the plan reports (simulated pipeline plus the tail) over every
    partition of the candidate that fits memory, given `linear_bound`, a valid bound on its linear
    objective; `beta`: `backward_share`; `comm`: `comm_bound` (2 sum p2p is at least it); `tight`: the
    block or interval bounds of the candidate, when computed; `path`: `one_f_one_b_bound`, when computed;
    `tail`: `tail_bound`'s value, when computed.

    Where the linear objective bounds the simulation (`linear_bounds_reported`) that bound holds.
    Otherwise, with W >= the work (the stage times' sum, at least the model's cheapest work and, under
    ZeRO-3, its weight gathers) and Z the largest stage time (at least W / S and the tight bound's):

    - every rank computes m times its stages' time, and the busiest at least m max(W / p, the tight
      bound's least largest stage (one stage per rank) or rank (several));
    - one micro-batch passes every stage forward and backward in turn: W plus the links (under
      zero-bubble only the forward and the input-gradient half of the backward are on that chain:
      (W + F) / 2, and the V placement keeps one boundary on a rank, so no links are counted);
    - 1F1B, one stage per rank: rank r starts after stages 0..r-1 forwarded micro-batch 0 and its last
      backward must pass back through them: T >= sum_{s<r} t_s + m t_r for every r; over t >= 0 summing
      to W the least maximum equalises them, t_r = t_0 q^r with q = (m-1)/m, T = m W / sum_r q^r;
    - 1F1B, one stage per rank, with r the largest stage and w = min(m, p - r) its warm-up forwards:
      rank r's actions up to its last forward (m forwards and m - w backwards), then F(r+1..p-1, m-1),
      B(p-1..r, m-1), B(r-1..0, m-1) wait each for the one before, so T >= W + (m-1) t_r - (w-1) b_r +
      2 sum p2p >= W + (m - 1 - (min(m, p) - 1) beta) Z + comm when that coefficient is >= 0, and, as
      b_r <= beta t_r for every r, >= W + max_r c_r t_r + comm >= W + `path` + comm.

    Plus the same mean tail as the linear bounds (`tail_bound`). tests/test_reported_exact.py checks the
    bound against the brute-force minimum of the reported figure on random instances.
    """
    tot, cand, cluster, dtype = pb.totals, pb.cand, pb.cluster, pb.dtype
    if linear_bounds_reported(cand):
        return linear_bound
    S, p, m, v = cand.stages, cand.pp, cand.num_micro_batches, cand.virtual_stages
    work = max(tot.work, zero3_gather_time(tot.sync, cand, cluster, dtype))
    if cand.schedule == "zero-bubble":
        chain = (tot.fwd + work) / 2
    else:
        chain = work + (comm if v == 1 else 0.0)
    busiest = work / p
    largest = work / S
    if isinstance(tight, BlockBounds):
        by_mode = tight.stage_max if v == 1 else tight.rank_max
        busiest = max(busiest, min(by_mode.values(), default=0.0))
        if v == 1:
            largest = max(largest, min(tight.stage_max.values(), default=0.0))
    elif isinstance(tight, IntervalBounds) and v == 1:
        busiest = max(busiest, min(tight.stage_max.values(), default=0.0))
        largest = max(largest, min(tight.stage_max.values(), default=0.0))
    pipe = max(m * busiest, chain)
    if cand.schedule == "1f1b" and v == 1:
        q = (m - 1) / m
        pipe = max(pipe, m * work / sum(q**r for r in range(p)))
        coef = m - 1 - (min(m, p) - 1) * beta
        if coef >= 0:
            pipe = max(pipe, work + coef * largest + comm)
        pipe = max(pipe, work + path + comm)
    out: float = pipe + (tail_bound(pb) if tail is None else tail)
    return out


def comm_bound(pb: PartitionProblem, run: tuple[int, int, int] | None = None) -> float:
    """Fill/drain point-to-point: one forward and one backward send per stage boundary, each at least the
    smallest tensor a boundary can carry (in the count form a block's output or the prefix's; otherwise
    the output of any unit but the last)."""
    cand = pb.cand
    out: float = 2.0 * (cand.stages - 1) * p2p_time(smallest_boundary(pb.graph, run), cand, pb.cluster)
    return out


def smallest_boundary(graph: ModelGraph, run: tuple[int, int, int] | None = None) -> float:
    """The fewest bytes a stage boundary can carry: in the count form a block's output or the prefix's,
    otherwise the output of any unit but the last."""
    if run is None:
        return min(u.output_bytes for u in graph.units[:-1])
    start = run[0]
    return min(graph.units[u].output_bytes for u in range(max(0, start - 1), start + 1))


@dataclass
class BlockBounds:
    """Per recomputation mode (the uniform mode when a rank holds several stages; with one stage per
    rank the same value for every mode, valid for any mix): lower bounds on the ILP's maxima."""

    cand: Candidate
    work: float = 0.0  # sum of stage times (one stage per rank)
    stage_max: dict[str, float] = field(default_factory=dict)  # Z: the largest stage time
    rank_max: dict[str, float] = field(default_factory=dict)  # Y: the largest rank time (v > 1)
    fwd_max: dict[str, float] = field(default_factory=dict)  # F: the largest stage forward (zero-bubble)
    # min over integer block counts of (m-1) Z + tail (one stage per rank), m Y + (p-1) Z + tail
    # (interleaved) or m Y + (p-1) F + tail (zero-bubble)
    joint: dict[str, float] = field(default_factory=dict)
    # block counts per stage and recomputation per stage built from the relaxation's optimum: starting
    # points for CBC (they may not fit memory; the ILP checks)
    starts: list[tuple[list[int], list[str]]] = field(default_factory=list)
    # the most blocks memory lets a stage (one stage per rank) or a rank (several, their activation peak
    # relaxed to the mean of the rank's stages) hold in some recomputation mode: `pathbound`'s caps
    block_caps: list[float] = field(default_factory=list)
    rank_block_caps: list[float] = field(default_factory=list)

    def total(self) -> float:
        """Lower bound on `iteration_linear` without point-to-point time (pipeline plus tail)."""
        c = self.cand
        if c.virtual_stages == 1:
            return self.work + min(self.joint.values())
        return min(self.joint[r] for r in self.rank_max)


@dataclass
class _Stage:
    """What a stage of the count form holds besides blocks, per recomputation mode."""

    index: int
    rank: int
    min_blocks: int
    ext_time: dict[str, float]
    ext_fwd: float
    ext_act: dict[str, float]
    ext_params: float
    ext_sync: float  # `UnitCost.sync_params` of the extras
    buffers: float  # comm buffers (bytes)


def _stages(pb: PartitionProblem, run: tuple[int, int, int]) -> list[_Stage]:
    graph, costs, cand, options = pb.graph, pb.costs, pb.cand, pb.options
    start, end, n = run
    S = cand.stages
    pre, post = list(range(0, start)), list(range(end + 1, n))
    modes = tuple(costs[start].bwd)
    out_blk = graph.units[start].output_bytes
    smallest = min(out_blk, graph.units[start - 1].output_bytes) if pre else out_blk
    largest = max(c.largest_param_bytes for c in costs)
    def stage(s: int, holds: list[int]) -> _Stage:
        ext = [costs[u] for u in holds]
        return _Stage(
            index=s,
            rank=stage_rank(cand.schedule, cand.pp, cand.virtual_stages, s),
            min_blocks=0 if holds else 1,
            ext_time={r: sum(c.fwd + c.bwd[r] for c in ext) for r in modes},
            ext_fwd=sum(c.fwd for c in ext),
            ext_act={r: sum(c.act[r] for c in ext) for r in modes},
            ext_params=sum(c.params_local for c in ext),
            ext_sync=sum(c.sync_params for c in ext),
            buffers=comm_buffer_bytes(smallest if s < S - 1 else 0.0, cand, options, largest),
        )

    stages = []
    middle: _Stage | None = None  # the stages between the first and the last hold blocks only: one figure
    for s in range(S):
        holds = (pre if s == 0 else []) + (post if s == S - 1 else [])
        if holds or s == 0 or s == S - 1:
            stages.append(stage(s, holds))
            continue
        if middle is None:
            middle = stage(s, [])
        m, rank = middle, stage_rank(cand.schedule, cand.pp, cand.virtual_stages, s)
        stages.append(_Stage(s, rank, 1, m.ext_time, m.ext_fwd, m.ext_act, m.ext_params, m.ext_sync, m.buffers))
    return stages


def block_bound(pb: PartitionProblem, joint: bool = True) -> BlockBounds | None:
    """Lower bounds on the pipeline terms of the count-form ILP (largest stage time, largest rank time,
    largest stage forward, per recomputation mode); None if no integer block distribution fits memory."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _block_bound(pb, joint)


def _block_bound(pb: PartitionProblem, joint: bool = True) -> BlockBounds | None:
    """`block_bound` (numpy's divide and invalid warnings off: capacities divide by zero-time blocks)."""
    costs, cand, cluster, options, modes, run = pb.costs, pb.cand, pb.cluster, pb.options, pb.modes, pb.run
    assert run is not None, "block_bound needs a run of identical blocks (the count form)"
    start, end, _ = run
    L = end - start + 1
    S, p, m, v = cand.stages, cand.pp, cand.num_micro_batches, cand.virtual_stages
    blk = costs[start]
    dtype = pb.dtype
    state = model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp_shard)
    per_param = model_state_bytes(1.0, state)
    budget = memory_budget(rank_capacity(cluster, cand), options)
    stages = _stages(pb, run)
    a_sync, c_sync, opt_rate = tail_coefficients(cand, cluster, dtype)
    blocks = np.arange(L + 1)

    def tail_of(
        ext_params: float,
        ext_sync: float,
        n_stages: int,
        ext_window: float,
        blk_window: float,
        others_min: int,
        first_cap: float | FloatArray = INF,
    ) -> FloatArray:
        """Lower bound on a rank's tail for N = 0..L blocks: exposed sync (sync minus the first stage's
        backward, which holds at most N - others_min and at most first_cap blocks) plus the optimizer
        step."""
        params = ext_params + blocks * blk.params_local
        synced = ext_sync + blocks * blk.sync_params
        sync = a_sync * synced + n_stages * c_sync if cand.dp_shard > 1 else 0.0 * params
        n_first = np.minimum(np.maximum(0, blocks - others_min), first_cap)
        window = sync_overlap_window(ext_window + n_first * blk_window, cand, options)
        out: FloatArray = np.maximum(0.0, sync - window) + opt_rate * params
        return out

    # ZeRO-3: a stage's time is at least its weight gathers, linear in its parameters
    gc = gather_coefficients(cand, cluster, dtype)
    g_blk: float | None = None
    g_ext = np.zeros(S)
    if gc is not None:
        g_blk = gc[0] * blk.sync_params
        g_ext = np.array([gc[0] * st.ext_sync + gc[1] for st in stages])
    inf = np.full(S, INF)
    min_blocks = np.array([st.min_blocks for st in stages], dtype=float)

    def per(total: float | FloatArray, ext: float | FloatArray, unit: float | FloatArray) -> FloatArray:
        """Blocks that fit when each costs `unit` and `ext` is already taken out of `total` (arrays; called
        under `block_bound`'s errstate: inf - inf is nan, then -inf blocks)."""
        if isinstance(unit, float):  # one cost for every stage or rank: the same values, fewer array passes
            q = (total - ext) / unit if unit > 0 else np.where(total >= ext, INF, -INF)
        else:
            q = np.where(unit > 0, (total - ext) / np.where(unit > 0, unit, 1.0), np.where(total >= ext, INF, -INF))
        out: FloatArray = np.floor(q + 1e-9 * np.maximum(1.0, np.abs(np.where(np.isfinite(q), q, 0.0))))
        return out

    def gather_cap(Z: float) -> FloatArray:
        return inf if g_blk is None else per(Z, g_ext, g_blk)

    def values(ext_of: Sequence[float], t_of: Sequence[float]) -> list[float]:
        """Every value a stage (or rank) time can take: its extras plus n blocks, n = 0..L."""
        pairs = set(zip(ext_of, t_of))
        if g_blk is not None:
            pairs |= {(float(e), g_blk) for e in g_ext}
        ext_a, t_a = np.array(sorted(pairs)).T
        out: list[float] = np.unique(ext_a[:, None] + blocks[None, :] * t_a[:, None]).tolist()
        return out

    def smallest_feasible(vals: list[float], caps: Caps) -> float | None:
        """The least Z in vals with sum of capacities >= L (capacities grow with Z)."""

        def ok(Z: float) -> bool:
            hi, lo = caps(Z)
            return bool((hi >= lo).all()) and float(np.minimum(hi, L).sum()) >= L

        return _least(vals, ok)

    if v == 1:
        # One stage per rank, its own recomputation mode: capacity is the best over modes.
        k = np.array([in_flight_microbatches(cand.schedule, p, m, 1, s) for s in range(S)], dtype=float)
        t_q = {r: blk.fwd + blk.bwd[r] for r in modes}
        ext_tq = {r: np.array([st.ext_time[r] for st in stages]) for r in modes}
        mem = {
            r: per(
                budget,
                np.array([st.buffers + per_param * st.ext_params for st in stages])
                + k * np.array([st.ext_act[r] for st in stages]),
                per_param * blk.params_local + k * blk.act[r],
            )
            for r in modes
        }

        def caps(Z: float) -> tuple[FloatArray, FloatArray]:
            g = gather_cap(Z)
            best: FloatArray = np.max(
                [np.minimum(np.minimum(per(Z, ext_tq[r], t_q[r]), mem[r]), g) for r in modes], axis=0
            )
            return best, min_blocks

        ext_of = [st.ext_time[r] for st in stages for r in modes]
        t_of = [t_q[r] for st in stages for r in modes]
        Z = smallest_feasible(values(ext_of, t_of), caps)
        if Z is None:
            return None
        work = L * min(t_q.values()) + sum(min(st.ext_time[r] for r in modes) for st in stages)
        mem_caps = [float(x) for x in np.max([mem[r] for r in modes], axis=0)]
        # the window of a stage's sync is its own backward: at most that of the slowest mode
        win_blk = max(blk.bwd[r] for r in modes)
        tails = np.array(
            [
                tail_of(st.ext_params, st.ext_sync, 1, max(st.ext_time[r] - st.ext_fwd for r in modes), win_blk, 0)
                for st in stages
            ]
        )
        if not joint:
            out = BlockBounds(cand, work=work, stage_max={r: Z for r in modes}, joint={r: (m - 1) * Z for r in modes})
            out.block_caps = mem_caps
            return out
        value, arg = _joint(m - 1, values(ext_of, t_of), Z, caps, 0.0, [0.0], 0.0, lambda c: tails, L)
        out = BlockBounds(cand, work=work, stage_max={r: Z for r in modes}, joint={r: value for r in modes})
        out.block_caps = mem_caps
        if arg is not None:
            # a start for the ILP: block counts inside the relaxation's optimum, each stage's fastest
            # recomputation mode that still fits its time and memory caps
            hi, lo = caps(arg[0])
            counts = _distribute(tails, lo, np.minimum(hi, L), arg[2], L, ext_tq[modes[0]], t_q[modes[0]])
            if counts is not None:
                per_mode = {r: np.minimum(per(arg[0], ext_tq[r], t_q[r]), mem[r]) for r in modes}
                order = sorted(modes, key=lambda r: t_q[r])
                rec = [next((r for r in order if counts[s] <= per_mode[r][s]), order[-1]) for s in range(S)]
                out.starts.append((counts, rec))
        return out

    # Several stages per rank, one recomputation mode for all stages (as in the ILP).
    out = BlockBounds(cand)
    ranks = range(p)
    mine = {r: sorted((st for st in stages if st.rank == r), key=lambda st: st.index) for r in ranks}
    on_blocks, on_ext = _rank_memory_forms(cand.schedule, p, m, v)
    rank_min = np.array([sum(st.min_blocks for st in mine[r]) for r in ranks], dtype=float)
    rank_fixed = np.array([sum(st.buffers + per_param * st.ext_params for st in mine[r]) for r in ranks])
    ext_f = np.array([st.ext_fwd for st in stages])
    for r_mode in modes:
        t = blk.fwd + blk.bwd[r_mode]
        ext_t = np.array([st.ext_time[r_mode] for st in stages])
        rank_ext_t = np.array([sum(st.ext_time[r_mode] for st in mine[r]) for r in ranks])
        # memory: states + activations at least as each of the rank's forms counts them (the tightest cap)
        ext_acts = np.array([[st.ext_act[r_mode] for st in mine[r]] for r in ranks])
        rank_mem = per(
            budget,
            rank_fixed[None, :] + np.einsum("fpv,pv->fp", on_ext, ext_acts),
            per_param * blk.params_local + on_blocks * blk.act[r_mode],
        ).min(axis=0)

        def stage_caps(Z: float, t: float = t, ext_t: FloatArray = ext_t) -> tuple[FloatArray, FloatArray]:
            return np.minimum(per(Z, ext_t, t), gather_cap(Z)), min_blocks

        def fwd_caps(F: float) -> tuple[FloatArray, FloatArray]:
            return per(F, ext_f, blk.fwd), min_blocks

        def rank_caps(
            Y: float, t: float = t, rank_ext_t: FloatArray = rank_ext_t, rank_mem: FloatArray = rank_mem
        ) -> tuple[FloatArray, FloatArray]:
            return np.minimum(per(Y, rank_ext_t, t), rank_mem), rank_min

        y_vals = values(list(rank_ext_t), [t] * p)
        Y = smallest_feasible(y_vals, rank_caps)
        if Y is None:
            continue
        Z = smallest_feasible(values(list(ext_t), [t] * S), stage_caps)
        # the largest value lets every stage hold every block: Z (and F) exist once Y does
        assert Z is not None
        c_vals: list[float]
        first_ext: FloatArray
        if cand.schedule == "zero-bubble":
            F = smallest_feasible(values(list(ext_f), [blk.fwd] * S), fwd_caps)
            assert F is not None
            out.fwd_max[r_mode] = F
            # the last term is the largest forward: it caps the first stage's blocks through its forward
            c_vals, c_start, first_ext, first_unit = values(list(ext_f), [blk.fwd] * S), F, ext_f, blk.fwd
        else:
            c_vals, c_start, first_ext, first_unit = values(list(ext_t), [t] * S), Z, ext_t, t

        def tails_at(
            c: float, r_mode: str = r_mode, first_ext: FloatArray = first_ext, first_unit: float = first_unit
        ) -> FloatArray:
            caps_first = per(c, first_ext, first_unit)
            rows = []
            for r in ranks:
                sts = mine[r]
                first = sts[0]
                rows.append(
                    tail_of(
                        sum(st.ext_params for st in sts),
                        sum(st.ext_sync for st in sts),
                        len(sts),
                        first.ext_time[r_mode] - first.ext_fwd,
                        blk.bwd[r_mode],
                        sum(st.min_blocks for st in sts[1:]),
                        float(caps_first[first.index]),
                    )
                )
            return np.array(rows)

        out.rank_max[r_mode] = Y
        out.stage_max[r_mode] = Z
        caps_r = [float(x) for x in rank_mem]
        out.rank_block_caps = caps_r if not out.rank_block_caps else list(map(max, out.rank_block_caps, caps_r))
        if not joint:
            out.joint[r_mode] = m * Y + (p - 1) * c_start
            continue
        out.joint[r_mode], arg = _joint(m, y_vals, Y, rank_caps, p - 1, c_vals, c_start, tails_at, L)
        if arg is not None:
            hi, lo = rank_caps(arg[0])
            n_rank = _distribute(tails_at(arg[1]), lo, np.minimum(hi, L), arg[2], L, rank_ext_t, t)
            if n_rank is not None:
                stage_cap = per(arg[1], first_ext, first_unit)
                counts = _split_ranks(n_rank, mine, stage_cap, S)
                if counts is not None:
                    out.starts.append((counts, [r_mode] * S))
    return out if out.rank_max else None


# ------------------------------------------------------------------------ any unit sequence (assign form)


@dataclass
class IntervalBounds:
    """Interval and assignment forms: per recomputation mode, a lower bound on the largest stage time
    (the same value for every mode with one stage per rank, where stages choose modes freely), start
    partitions, and the interval tables they came from (the ILP reuses them)."""

    stage_max: dict[str, float] = field(default_factory=dict)
    starts: list[tuple[list[list[int]], list[str]]] = field(default_factory=list)
    tables: IntervalTables | None = None

    def pipeline(self, cand: Candidate, costs: list[UnitCost]) -> float:
        """Lower bound on the pipeline term without point-to-point time: the stage times sum to the work
        W of their modes, a rank's to at least W / p, the largest stage to at least the bound."""
        S, p = cand.stages, cand.pp
        out = INF
        for r, Z in self.stage_max.items():
            if cand.virtual_stages == 1:
                W = sum(c.fwd + min(c.bwd[q] for q in self.stage_max) for c in costs)
            else:
                W = sum(c.fwd + c.bwd[r] for c in costs)
            out = min(out, pipeline_time(cand, W, Z, W / p, sum(c.fwd for c in costs) / S, 0.0))
        return out


def interval_bound(pb: PartitionProblem) -> IntervalBounds | None:
    """The least largest stage time over contiguous partitions of the units into the candidate's stages.

    Stage s may hold units i..j-1 when, in some mode, its time (and ZeRO-3 gathers) stays within Z and,
    with one stage per rank, its memory row of the ILP fits at that position; a dynamic program over
    (stage, units placed) decides whether Z is feasible, and a binary search over the finitely many
    interval times finds the least feasible Z. With several stages per rank memory is a rank's row and
    is left out here (a relaxation). None when no partition fits memory.
    """
    costs, cand, modes = pb.costs, pb.cand, pb.modes
    U, S = len(costs), cand.stages
    tb = pb.tables
    t, gather, valid, mem_ok = tb.t, tb.gather, tb.valid, tb.mem_ok
    stage_ok = pb.stage_ok  # zero-bubble: the intervals a stage after the first may hold (None: any)
    values = np.unique(np.concatenate([np.maximum(t[r], gather)[valid] for r in modes]))

    def reach(Z: float, only: tuple[str, ...]) -> tuple[list[BoolArray], dict[int, BoolArray]]:
        """reach[s][j]: units 0..j-1 fit in stages 0..s-1 (with the mode and start of each stage)."""
        fits: dict[int, BoolArray] = {}
        under = {r: t[r] <= Z * (1 + 1e-12) for r in only}
        common = valid & (gather <= Z * (1 + 1e-12))
        later: BoolArray | None = None  # what fits a stage after the first
        for s in range(S):
            if cand.virtual_stages > 1 and later is not None:
                fits[s] = later  # no memory row per stage: the same intervals fit every stage after the first
                continue
            f = np.zeros_like(valid)
            for r in only:
                f |= under[r] & mem_ok[s, r] if cand.virtual_stages == 1 else under[r]
            f &= common
            later = f if stage_ok is None else f & stage_ok
            fits[s] = f if s == 0 else later
        rows: list[BoolArray] = [np.zeros(U + 1, dtype=bool)]
        rows[0][0] = True
        for s in range(S):
            # the stages that can start where stages 0..s-1 end
            rows.append(np.asarray(fits[s][rows[-1]].any(axis=0)))
        return rows, fits

    def least(only: tuple[str, ...]) -> float | None:
        return _least(values, lambda Z: bool(reach(Z, only)[0][S][U]))

    def partition(Z: float, only: tuple[str, ...]) -> tuple[list[list[int]], list[str]]:
        rows, fits = reach(Z, only)
        cuts, j = [U], U
        for s in range(S - 1, -1, -1):
            i = int(np.flatnonzero(rows[s] & fits[s][:, j])[-1])
            cuts.append(i)
            j = i
        cuts = cuts[::-1]
        part = [list(range(cuts[s], cuts[s + 1])) for s in range(S)]
        rec = []
        for s in range(S):
            i, j = cuts[s], cuts[s + 1]
            ok = [r for r in only if t[r][i, j] <= Z * (1 + 1e-12) and (cand.virtual_stages > 1 or mem_ok[s, r][i, j])]
            rec.append(min(ok, key=lambda r: t[r][i, j]))
        return part, rec

    out = IntervalBounds(tables=tb)
    if cand.virtual_stages == 1:
        Z = least(modes)
        if Z is None:
            return None
        out.stage_max = {r: float(Z) for r in modes}
        out.starts.append(partition(Z, modes))
    else:
        for r in modes:
            Z = least((r,))
            if Z is not None:
                out.stage_max[r] = float(Z)
                out.starts.append(partition(Z, (r,)))
        if not out.stage_max:
            return None
    for r in modes:
        if len(out.starts) and cand.virtual_stages == 1:
            Zr = least((r,))
            if Zr is not None:
                out.starts.append(partition(Zr, (r,)))
    return out
