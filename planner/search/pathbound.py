r"""A lower bound on the simulated pipeline time over every partition, from the schedule's longest paths.

The simulator (`planner.cost.simulate`) runs each rank's actions in a fixed order, each once its rank's
previous action and its input are done; so the simulated time T(x) of a partition is the longest path of
a DAG whose nodes are the actions, weighted by the stages' durations x = (f_s, b_s) (forward and full
backward; zero-bubble runs b_s / 2 as the input-gradient pass and b_s / 2 as the weight pass), plus the
link times on the edges between ranks. Each path P of that DAG has a length c_P . x + d_P, linear in x,
and T(x) >= c_P . x + d_P for every x (`SimResult.rank_paths` gives such paths).

The bound. For weights lambda_P >= 0 summing to 1 over any set of paths,

    T(x) >= sum_P lambda_P (c_P . x + d_P)    for every partition x, hence
    min_x T(x) >= D(lambda) = sum_P lambda_P d_P + min_x (sum_P lambda_P c_P) . x,

and the last minimum is computed exactly over the partitions by an oracle (`CountOracle`: the block
counts of a transformer-shaped model, greedily; `IntervalOracle`: any unit sequence, by a dynamic
program over contiguous partitions). D(lambda) is valid for every lambda, however it was found: the
weights only decide how tight it is. Three relaxations keep it valid, since T never decreases when a
duration or a link grows (tests/test_simulate.py, `test_monotone_in_every_duration`): each stage's
backward is taken in its cheapest recomputation mode, ZeRO-3 weight gathers (which can only lengthen a
stage) are left out, and every link costs the least any boundary can (`link`); memory enters only as
the capacities of the count form's block_bound (a relaxation of the ILP's rows, the mean activation
peak of a rank's stages) and the interval form's per-stage memory rows, so no partition that fits is
lost.

The weights come from a cutting-plane (double-oracle) loop on the matrix game min_x max_P: paths are
taken from the simulation of a query point (a mix of the oracle's partitions, smoothed towards the best
point found), partitions from the oracle; the restricted game is solved exactly by a small simplex
(`solve_game`). The loop stops once D reaches `target` (the candidate cannot beat the plan it is
compared with), once a query point of the relaxation simulates below the target (no D can reach it),
once D is within a relative 1e-6 of the best simulated query point, or after `max_sims` simulations.
Everything is deterministic (fixed orders, counts, no timing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from planner.cost.placement import stage_rank
from planner.cost.simulate import PathCounts, simulate
from planner.cost.terms import p2p_time
from planner.search.bounds import BlockBounds, IntervalBounds, smallest_boundary
from planner.search.problem import PartitionProblem

FloatArray = npt.NDArray[np.float64]
INF = float("inf")
SMOOTHING = 0.7  # the query point's weight on the best point found (in-out stabilisation of the loop)
PATHS_PER_SIM = 4  # the longest rank paths kept from each simulation
# Simulated actions one bound may spend (a count, so that the result does not depend on the machine): as
# many simulations as that allows, at least 2 and at most `max_sims`.
ACTIONS_PER_BOUND = 30_000


@dataclass(frozen=True)
class PathRow:
    """One path's length as a linear form: cf . f + cb . b + d (d: its links at their least)."""

    cf: FloatArray
    cb: FloatArray
    d: float

    def at(self, x: FloatArray) -> float:
        """The length at stage durations x (S x 2: forward, backward)."""
        return float(self.cf @ x[:, 0] + self.cb @ x[:, 1] + self.d)


class CountOracle:
    """Partitions of the count form: stage s holds its extras (the prefix in the first stage, the suffix
    in the last) and n_s identical blocks, lo_s <= n_s <= stage_cap_s, sum_s n_s = L, and the blocks of a
    rank's stages at most rank_cap_r. The box and the rank caps form a laminar family, so taking the
    cheapest blocks first (each stage up to what its cap and its rank's cap leave) is exact for a linear
    cost: the least (cf . f + cb . b) over those partitions."""

    def __init__(
        self,
        ext: FloatArray,
        blk: tuple[float, float],
        lo: Sequence[int],
        L: int,
        stage_cap: Sequence[float],
        rank_of: Sequence[int],
        rank_cap: Sequence[float],
    ) -> None:
        self.ext, self.blk, self.L = ext, np.array(blk, dtype=float), L
        self.lo = np.array(lo, dtype=float)
        self.stage_cap = np.array(stage_cap, dtype=float)
        self.rank_of = list(rank_of)
        self.rank_cap = np.array(rank_cap, dtype=float)
        self.stages = len(lo)

    def key(self) -> tuple[object, ...]:
        """Everything `best` and `start` read: equal keys, equal answers (`path_bound`'s memo)."""
        arrays = (self.ext, self.blk, self.lo, self.stage_cap, self.rank_cap)
        return ("count", self.L, tuple(self.rank_of), *(a.tobytes() for a in arrays))

    def start(self) -> FloatArray | None:
        """A fractional partition inside the caps with the blocks spread as evenly as they allow (the first
        query point), or None when the caps leave no partition."""
        free = float(self.L - self.lo.sum())
        if free < 0:
            return None
        n = self.lo.copy()
        room = np.minimum(self.stage_cap, float(self.L)) - self.lo
        rank_room = self.rank_cap.copy()
        for s in range(self.stages):
            rank_room[self.rank_of[s]] -= self.lo[s]
        if (room < 0).any() or (rank_room < 0).any():
            return None
        # water-filling: each stage takes an equal share, capped, the rest goes round again
        for _ in range(self.stages + 1):
            if free <= 1e-9:
                break
            open_ = [s for s in range(self.stages) if room[s] > 1e-12 and rank_room[self.rank_of[s]] > 1e-12]
            if not open_:
                return None
            share = free / len(open_)
            for s in open_:
                take = min(share, room[s], rank_room[self.rank_of[s]])
                n[s] += take
                room[s] -= take
                rank_room[self.rank_of[s]] -= take
                free -= take
        if free > 1e-6:
            return None
        return self.features(n)

    def features(self, n: FloatArray) -> FloatArray:
        out: FloatArray = self.ext + n[:, None] * self.blk[None, :]
        return out

    def best(self, cf: FloatArray, cb: FloatArray) -> tuple[float, FloatArray] | None:
        unit = cf * self.blk[0] + cb * self.blk[1]
        n = self.lo.copy()
        rank_room = self.rank_cap.copy()
        for s in range(self.stages):
            rank_room[self.rank_of[s]] -= self.lo[s]
        free = float(self.L - self.lo.sum())
        if free < 0 or (rank_room < 0).any() or (self.stage_cap < self.lo).any():
            return None
        for s in sorted(range(self.stages), key=lambda s: (unit[s], s)):
            if free <= 0:
                break
            r = self.rank_of[s]
            take = max(0.0, min(free, float(self.stage_cap[s] - self.lo[s]), float(rank_room[r])))
            n[s] += take
            rank_room[r] -= take
            free -= take
        if free > 0:
            return None
        x = self.features(n)
        return float(cf @ x[:, 0] + cb @ x[:, 1]), x


class IntervalOracle:
    """Contiguous partitions of any unit sequence into S non-empty stages: the least
    sum_s cf_s f_s + cb_s b_s by a dynamic program over (stage, units placed); `allowed[s]` (optional,
    [i, j] indexed) says whether stage s may hold units i..j-1 (the ILP's memory row in some mode)."""

    def __init__(
        self, fwd: Sequence[float], bwd: Sequence[float], stages: int, allowed: Sequence[npt.NDArray[np.bool_]] | None
    ) -> None:
        self.F = np.concatenate([[0.0], np.cumsum(fwd)])
        self.B = np.concatenate([[0.0], np.cumsum(bwd)])
        self.U, self.stages = len(fwd), stages
        valid = np.triu(np.ones((self.U + 1, self.U + 1), dtype=bool), 1)
        self.allowed = [valid & allowed[s] if allowed is not None else valid for s in range(stages)]
        self.span_f: FloatArray = self.F[None, :] - self.F[:, None]
        self.span_b: FloatArray = self.B[None, :] - self.B[:, None]

    def key(self) -> tuple[object, ...]:
        """Everything `best` and `start` read: equal keys, equal answers (`path_bound`'s memo)."""
        return ("interval", self.stages, self.F.tobytes(), self.B.tobytes(), *(a.tobytes() for a in self.allowed))

    def start(self) -> FloatArray | None:
        """Every stage an equal share of the work (a fractional point, the first query)."""
        S = self.stages
        return np.tile(np.array([self.F[-1] / S, self.B[-1] / S]), (S, 1))

    def best(self, cf: FloatArray, cb: FloatArray) -> tuple[float, FloatArray] | None:
        U, S = self.U, self.stages
        row = np.full(U + 1, INF)
        row[0] = 0.0
        arg = []
        for s in range(S):
            cost = np.where(self.allowed[s], cf[s] * self.span_f + cb[s] * self.span_b, INF)
            total = row[:, None] + cost
            i = np.argmin(total, axis=0)
            row = total[i, np.arange(U + 1)]
            arg.append(i)
        if not np.isfinite(row[U]):
            return None
        x = np.zeros((S, 2))
        j = U
        for s in range(S - 1, -1, -1):
            i = int(arg[s][j])
            x[s] = (self.F[j] - self.F[i], self.B[j] - self.B[i])
            j = i
        return float(cf @ x[:, 0] + cb @ x[:, 1]), x


Oracle = CountOracle | IntervalOracle


def pipeline_bound(
    pb: PartitionProblem,
    tight: BlockBounds | IntervalBounds | None,
    target: float | None,
    max_sims: int = 24,
) -> float:
    """`path_bound` of a pipelined candidate: a valid lower bound on the simulated pipeline time (the
    reported figure without its tail) of every partition and recomputation that fits memory. `tight`:
    the candidate's block or interval bounds (their memory capacities); `target`: stop once reached."""
    graph, costs, cand, cluster, modes, run = pb.graph, pb.costs, pb.cand, pb.cluster, pb.modes, pb.run
    S, p, v = cand.stages, cand.pp, cand.virtual_stages
    if S == 1:
        return 0.0
    link = p2p_time(smallest_boundary(graph, run), cand, cluster)
    fwd = [c.fwd for c in costs]
    bwd = [min(c.bwd[r] for r in modes) for c in costs]
    oracle: Oracle
    if run is not None:
        start, end, n = run
        ext = np.zeros((S, 2))
        ext[0] = (sum(fwd[:start]), sum(bwd[:start]))
        ext[S - 1] += (sum(fwd[end + 1 :]), sum(bwd[end + 1 :]))
        lo = [0 if (s == 0 and start > 0) or (s == S - 1 and end < n - 1) else 1 for s in range(S)]
        L = end - start + 1
        block = tight if isinstance(tight, BlockBounds) else None
        stage_cap = block.block_caps if block is not None and block.block_caps else [INF] * S
        rank_cap = block.rank_block_caps if block is not None and block.rank_block_caps else [INF] * p
        rank_of = [stage_rank(cand.schedule, p, v, s) for s in range(S)]
        oracle = CountOracle(ext, (fwd[start], bwd[start]), lo, L, stage_cap, rank_of, rank_cap)
    else:
        allowed = None
        tables = tight.tables if isinstance(tight, IntervalBounds) else None
        if tables is not None and tables.mem_ok:
            allowed = [
                np.logical_or.reduce([tables.mem_ok[s, r] for r in modes if (s, r) in tables.mem_ok]) for s in range(S)
            ]
        ok = pb.stage_ok  # zero-bubble: the intervals a stage after the first may hold
        if ok is not None:
            given = allowed or [np.ones_like(ok)] * S
            allowed = [a if s == 0 else a & ok for s, a in enumerate(given)]
        oracle = IntervalOracle(fwd, bwd, S, allowed)
    return path_bound(cand.schedule, p, cand.num_micro_batches, v, oracle, link, target, max_sims)


# path_bound's answers by their whole input: the search bounds candidates that differ only where the bound
# does not look (the ZeRO-1 and ZeRO-2 twins of one layout have the same stage times, caps and target).
_MEMO: dict[tuple[object, ...], float] = {}
MEMO_SIZE = 256


def path_bound(
    schedule: str,
    p: int,
    m: int,
    v: int,
    oracle: Oracle,
    link: float,
    target: float | None,
    max_sims: int = 24,
) -> float:
    """A valid lower bound on the simulated pipeline time of every partition the oracle covers (module
    docstring); 0.0 when the oracle has none. With a `target`, stops once the bound reaches it or cannot;
    None: as tight as `max_sims` simulations allow. A pure function of its arguments, remembered for the
    last MEMO_SIZE of them."""
    key = (schedule, p, m, v, oracle.key(), link, target, max_sims)
    got = _MEMO.get(key)
    if got is None:
        got = _path_bound(schedule, p, m, v, oracle, link, target, max_sims)
        if len(_MEMO) >= MEMO_SIZE:
            del _MEMO[next(iter(_MEMO))]
        _MEMO[key] = got
    return got


def _path_bound(
    schedule: str,
    p: int,
    m: int,
    v: int,
    oracle: Oracle,
    link: float,
    target: float | None,
    max_sims: int,
) -> float:
    S = p * v
    zb = schedule == "zero-bubble"
    max_sims = min(max_sims, max(2, ACTIONS_PER_BOUND // (S * m * (3 if zb else 2))))
    x0 = oracle.start()
    if x0 is None:
        return 0.0
    rows: list[PathRow] = []
    seen: set[tuple[object, ...]] = set()
    cols: list[FloatArray] = []
    # the restricted game's matrix, rows x cols: each entry computed once, as the rows and columns arrive
    grid: list[list[float]] = []
    lower, upper = 0.0, INF
    best_x: FloatArray | None = None
    query, inside = x0, isinstance(oracle, CountOracle)
    for _ in range(max_sims):
        sim = simulate(schedule, p, m, v, list(query[:, 0]), list(query[:, 1]), None, link)
        if inside and sim.iteration_time < upper:
            upper, best_x = sim.iteration_time, query
        if target is not None and upper < target:
            break  # a point of the relaxation is below the target: no weights can lift D above it
        for path in _longest(sim.rank_paths(), query, zb, link):
            key = (tuple(path.cf), tuple(path.cb), path.d)
            if key not in seen:
                seen.add(key)
                rows.append(path)
        if cols:
            for row, r in zip(grid, rows, strict=False):  # the newest column on the rows already there
                row.extend(r.at(x) for x in cols[len(row) :])
            grid.extend([r.at(x) for x in cols] for r in rows[len(grid) :])  # the new rows
            lam, mix = solve_game(np.array(grid))
        else:
            lam, mix = np.full(len(rows), 1.0 / len(rows)), np.zeros(0)
        cf = sum((w * r.cf for w, r in zip(lam, rows, strict=True)), np.zeros(S))
        cb = sum((w * r.cb for w, r in zip(lam, rows, strict=True)), np.zeros(S))
        d = float(sum(w * r.d for w, r in zip(lam, rows, strict=True)))
        found = oracle.best(cf, cb)
        if found is None:
            return 0.0
        lower = max(lower, found[0] + d)
        if (target is not None and lower >= target) or lower >= upper * (1 - 1e-6):
            break
        point = found[1] if not cols else sum((w * x for w, x in zip(mix, cols, strict=True)), np.zeros((S, 2)))
        cols.append(found[1])
        inside = True
        query = point if best_x is None else SMOOTHING * best_x + (1 - SMOOTHING) * point
    return lower


def _longest(paths: list[PathCounts], x: FloatArray, zb: bool, link: float) -> list[PathRow]:
    """The PATHS_PER_SIM longest of the simulation's rank paths as linear forms (the longest first)."""
    half = 0.5 if zb else 1.0
    rows = []
    for pc in paths:
        cf = np.array(pc.fwd, dtype=float)
        cb = np.array(pc.bwd, dtype=float) * half + np.array(pc.wgt, dtype=float) * 0.5
        rows.append(PathRow(cf, cb, float(sum(pc.links)) * link))
    rows.sort(key=lambda r: -r.at(x))
    return rows[:PATHS_PER_SIM]


def solve_game(M: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Optimal mixed strategies of the zero-sum game max over row weights, min over column weights of
    lambda^T M y: (lambda, y). Solved on the smaller side: the transposed game -M^T swaps the players."""
    if M.shape[0] > M.shape[1]:
        y, lam = _solve_game(-M.T)
        return lam, y
    return _solve_game(M)


def _solve_game(M: FloatArray) -> tuple[FloatArray, FloatArray]:
    """`solve_game` by the simplex method (Bland's rule) on the column player's LP max 1.w s.t. P w <= 1,
    w >= 0, P = M shifted positive (one row per row of M): y = w / sum w, lambda from the slacks' reduced
    costs. Only the quality of the bound depends on its accuracy: D(lambda) is evaluated exactly later."""
    K, N = M.shape
    P = M - M.min() + 1.0
    P = P / float(P.max())
    T = np.zeros((K + 1, N + K + 1))
    T[:K, :N] = P
    T[:K, N : N + K] = np.eye(K)
    T[:K, -1] = 1.0
    T[K, :N] = -1.0
    basis = list(range(N, N + K))
    eps = 1e-12
    for _ in range(50 * (K + N)):
        neg = np.flatnonzero(T[K, :-1] < -eps)
        if len(neg) == 0:
            break
        e = int(neg[0])
        col = T[:K, e]
        ok = col > eps
        if not ok.any():
            break  # cannot happen for P > 0; the strategies so far are still usable
        ratios = np.where(ok, np.maximum(T[:K, -1], 0.0) / np.where(ok, col, 1.0), INF)
        ties = np.flatnonzero(ratios <= ratios.min() * (1 + 1e-12))
        i = int(min(ties, key=lambda t: basis[t]))
        pivot = T[i] / T[i, e]
        T -= np.outer(T[:, e], pivot)
        T[i] = pivot
        basis[i] = e
    w = np.zeros(N)
    for i, b in enumerate(basis):
        if b < N:
            w[b] = max(0.0, T[i, -1])
    u = np.maximum(T[K, N : N + K], 0.0)
    lam = u / u.sum() if u.sum() > 0 else np.full(K, 1.0 / K)
    y = w / w.sum() if w.sum() > 0 else np.full(N, 1.0 / N)
    return lam, y
