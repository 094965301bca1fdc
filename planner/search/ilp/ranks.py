"""An exact branch and bound for several stages per rank (interleaved 1F1B, zero-bubble ZBV) on any unit
sequence, in place of CBC on the interval and assignment forms.

With v > 1 stages per rank and one recomputation mode q for all stages (as in the ILP), the linear
objective (`planner.cost.model.iteration_linear`) is

    m max_r R_r + (p-1) max_s Z_s + sum_s 2 p2p_s + max_r tau_r,

R_r = sum_{rank(s)=r} T_s the rank's time (T_s with its ZeRO-3 gathers), Z_s the stage's time
(interleaved) or forward (zero-bubble), p2p_s its outgoing send and tau_r the rank's tail (exposed
gradient sync behind its first stage's backward, plus the optimizer step of all its parameters). The
stages of a rank are not contiguous, so the rank sums do not decompose along a shortest path over
(stage, units placed). The search places the stages left to right instead: a node is a prefix of the
partition (stages 0..s-1 ending at unit j), its children the ends of stage s. A node's lower bound is
(p-1) times the larger of the largest Z so far and the least largest Z of the units left over the stages
left (a bottleneck dynamic program, computed once), plus the sends so far, plus the larger of

- m times the water level of the work left over the ranks that still get stages (the least possible
  largest rank however the rest is split; without ZeRO-3 gathers raised to the least subset sum of unit
  times at or above it, since a rank holds whole units), plus the least sum of the sends left (a shortest
  path), plus a tail bound: the largest of the largest rank tail so far, the optimizer step of the water
  level of the parameters and, with data parallelism, the water level (the mean while some rank's first
  stage is still to come) of sync - window + step;
- for each rank, m times its time plus its exposed sync and its optimizer step so far plus the least its
  later stages and every later send can add (a shortest path per rank: every stage holds at least one
  unit, which the water levels do not see), as m R_r + tau_r <= m max R + max tau; with data parallelism
  also with the sync less the window unclipped, summed over the rank's stages;

and m times the water level plus, for each rank, its tail alone (sync less window plus optimizer step so
far, plus the least its later stages and every later send add: a third per-rank table), as
m max R + tau_r <= m max R + max tau. Under zero-bubble's rule (`PartitionProblem.stage_ok`) every table
keeps to it for each stage after the first, the rank's own and the other ranks' (CLIP: the rank of the last
stage carries the whole text tower's time and sync, and no other rank can take a share of it).

A rank's tail and memory only grow with its stages, and at a complete partition the bound is its
objective. A rank whose memory row (`constraints.add_memory`, the ILP's own: states and buffers of its
stages plus, at each instant that can be its peak, its stages' counts there times their activations) is
exceeded is dropped.

Order: best first (the open node of least bound), diving from it to a leaf along the children of least
bound, so that good plans come early and the least open bound rises. The search counts its work (never
time, so that the result never depends on the machine): each node expanded, plus one per EFFORT_BOUNDS
(child, rank) bounds it evaluates, so that a budget means about the same time on a model of 20 units and
4 ranks as on one of 100 units and 32 ranks. Past ``max_nodes`` of it, the search stops with the best
plan found and the least bound of the nodes still open, a valid lower bound on the optimum. The start
and a plan stopped so are improved by a local search (one stage boundary moved by one unit, the best move
first, at most POLISH_STEPS moves), which scores partitions as a leaf does (`_Search.objective`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from planner.cost.memory import model_state_bytes_per_param
from planner.cost.model import Candidate, UnitCost
from planner.cost.schedules import rank_stage_counts
from planner.cost.terms import (
    comm_buffer_bytes,
    dp_sync_time,
    linear_form,
    memory_budget,
    model_state_bytes,
    optimizer_step_time,
    p2p_time,
    rank_capacity,
    sync_overlap_window,
    zero3_gather_time,
)
from planner.search.problem import PartitionProblem

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
INF = float("inf")
# Work (nodes, see EFFORT_BOUNDS) the branch and bound may spend (all modes together) before it stops.
MAX_NODES = 20_000
EFFORT_BOUNDS = 128  # (child, rank) bounds that count as one more node
POLISH_STEPS = 64  # moves of the local search that improves the start and the plan found
EPS = 1e-12


@dataclass
class RanksResult:
    """The best plan found (objective, partition, recomputation; None when no plan below the limit fits),
    ``low`` a valid lower bound on the optimum below the limit (equal to the objective when proven), and the
    work spent (`MAX_NODES`)."""

    objective: float | None
    partition: list[list[int]] | None
    recompute: list[str] | None
    low: float
    nodes: int

    @property
    def proven(self) -> bool:
        """Whether the result is the optimum (or, without a plan, whether none exists below the limit)."""
        if self.objective is None:
            return self.low == INF
        return self.low >= self.objective * (1 - 1e-9)


def applies(cand: Candidate) -> bool:
    """Whether the branch and bound solves this candidate: several stages per rank."""
    return cand.virtual_stages > 1 and cand.schedule in ("interleaved-1f1b", "zero-bubble")


def _on_floats(a: float, c: float, x: FloatArray) -> FloatArray:
    """A collective's linear form a x + c on an array, with the cost model's float guard: no bytes, no time."""
    out: FloatArray = np.where(x > 0, a * x + c, 0.0)
    return out


def _span(xs: list[float]) -> FloatArray:
    """span[i, j] = the sum of xs over units i..j-1."""
    pre = np.concatenate([[0.0], np.cumsum(xs)])
    out: FloatArray = pre[None, :] - pre[:, None]
    return out


def _level(new: FloatArray, rem: FloatArray, act_r: list[int]) -> FloatArray:
    """Per row: the least largest rank total once ``rem`` more is spread over the ranks ``act_r`` (``new``:
    the ranks' totals so far), the water level: min over k of (rem + the k least totals) / k."""
    top: FloatArray = new.max(axis=1)
    if not act_r:
        return top
    sub = np.sort(new[:, act_r], axis=1)
    lvl = ((rem[:, None] + np.cumsum(sub, axis=1)) / np.arange(1, len(act_r) + 1)).min(axis=1)
    out: FloatArray = np.maximum(top, lvl)
    return out


# Sums a subset-sum table may hold before it is given up (the bound then uses the water level as it is).
MAX_SUMS = 50_000
GRID = 1e12  # subset sums are kept on a grid of hi / GRID, each rounded down (a lower value stays valid)


def _subset_sums(values: list[float], hi: float) -> tuple[FloatArray, float] | None:
    """The sorted sums at most ``hi`` of the subsets of ``values`` (non-negative), each rounded down to a grid
    of hi / GRID and one step more, and how far below the sum it stands for a rounded one may be (one grid
    step per distinct value, and two); None past MAX_SUMS sums. Equal values are added together (k of them:
    0..k times the value)."""
    if hi <= 0 or not np.isfinite(hi):
        return None
    top = int(GRID)
    keys = np.zeros(1, dtype=np.int64)
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    for v, c in sorted(counts.items()):
        steps = np.floor(np.arange(c + 1) * v / hi * GRID)
        steps = steps[steps <= top].astype(np.int64)
        more = (keys[None, :] + steps[:, None]).ravel()
        keys = np.unique(more[more <= top])
        if len(keys) > MAX_SUMS:
            return None
    # one step lower still, so that the float product never lands above the sum it stands for
    out: FloatArray = np.asarray(np.maximum(keys - 1, 0) * (hi / GRID), dtype=np.float64)
    return out, (len(counts) + 2) * hi / GRID


def _round_up(x: FloatArray, table: tuple[FloatArray, float] | None) -> FloatArray:
    """Each x raised to the least subset sum of ``table`` (`_subset_sums`) that may stand for a sum at or
    above it (relative 1e-9 for the float sums, plus the table's rounding; x itself past the last)."""
    if table is None or not len(table[0]):
        return x
    sums, slack = table
    k = np.searchsorted(sums, x * (1 - 1e-9) - slack)
    out: FloatArray = np.where(k < len(sums), sums[np.minimum(k, len(sums) - 1)], x)
    return np.maximum(x, out)


@dataclass
class _Node:
    """A prefix of the partition: stages 0..s-1 placed, ``cuts`` their starts and the next one's, and
    per rank its time, synced gradient time, parameters, overlap window, fixed bytes and activations at
    each of its peak instants (`rank_stage_counts`); ``zc`` the largest Z, ``sc`` the sends and ``tail`` the
    largest rank tail so far."""

    mode: int
    s: int
    cuts: tuple[int, ...]
    load: FloatArray
    sy: FloatArray
    par: FloatArray
    win: FloatArray
    mem_s: FloatArray
    mem_a: FloatArray
    zc: float
    sc: float
    tail: float


@dataclass
class _Children:
    """A node's children in order of their bounds (``lows``), the next one to take at ``at``."""

    node: _Node
    js: IntArray
    lows: FloatArray
    tails: FloatArray
    at: int = 0


@dataclass
class _Rows:
    """A stage's table entries over its possible ends js (`_Search.rows`): time, fixed bytes and the
    communication buffer, activations at each of its rank's peak instants, synced gradient time, parameters,
    its window where it is its rank's first stage (else None), and what the suffix tables say of the units
    left (``later``: the ranked and the synced tables, per rank); ``z`` the larger of the stage's Z and the
    least largest Z left."""

    js: IntArray
    t: FloatArray
    states: FloatArray
    buf: FloatArray | float
    act: FloatArray
    sync: FloatArray
    params: FloatArray
    win: FloatArray | None
    work_left: FloatArray
    params_left: FloatArray
    slow: FloatArray
    later: FloatArray
    tail_left: FloatArray
    bwd_left: FloatArray
    z: FloatArray
    send: FloatArray | float

    def only(self, keep: npt.NDArray[np.bool_] | slice) -> _Rows:
        """The ends ``keep`` selects (a mask, or a slice of them)."""
        return _Rows(
            js=self.js[keep],
            t=self.t[keep],
            states=self.states[keep],
            buf=self.buf if isinstance(self.buf, float) else self.buf[keep],
            act=self.act[keep],
            sync=self.sync[keep],
            params=self.params[keep],
            win=None if self.win is None else self.win[keep],
            work_left=self.work_left[keep],
            params_left=self.params_left[keep],
            slow=self.slow[keep],
            later=self.later[..., keep],
            tail_left=self.tail_left[keep],
            bwd_left=self.bwd_left[keep],
            z=self.z[keep],
            send=self.send if isinstance(self.send, float) else self.send[keep],
        )


class _Search:
    """The precomputed tables of one candidate (per mode where they depend on it) and the node expansion."""

    def __init__(self, pb: PartitionProblem) -> None:
        graph, cluster, cand, costs, modes, options = pb.graph, pb.cluster, pb.cand, pb.costs, pb.modes, pb.options
        tables, dtype = pb.tables, pb.dtype
        U, S, p, m = len(costs), cand.stages, cand.pp, cand.num_micro_batches
        self.U, self.S, self.p, self.m, self.modes = U, S, p, m, modes
        self.ranks = pb.ranks
        self.first = [self.ranks.index(r) for r in range(p)]  # each rank's first stage (its sync hides there)
        self.active = [sorted(set(self.ranks[s:])) for s in range(S + 1)]  # ranks with a stage from s on
        self.params = _span([c.params_local for c in costs])
        synced = _span([c.sync_params for c in costs])
        a_sync, c_sync = linear_form(lambda x: dp_sync_time(x, cand, cluster, dtype))
        self.c_sync_low = min(0.0, c_sync) if cand.dp_shard > 1 else 0.0
        self.a_step, self.c_step = linear_form(lambda x: optimizer_step_time(x, cand, cluster, dtype))
        self.step_low = min(0.0, self.c_step)  # a_step P + step_low <= the step of any P >= 0 parameters
        a_win, c_win = linear_form(lambda b: sync_overlap_window(b, cand, options))
        self.a_win_up, self.c_win_up = max(0.0, a_win), max(0.0, c_win)  # a window is at most a_win_up b + c_win_up
        a_gat, c_gat = linear_form(lambda x: zero3_gather_time(x, cand, cluster, dtype))
        self.sync = _on_floats(a_sync, c_sync, synced) if cand.dp_shard > 1 else np.zeros_like(self.params)
        self.gathers = cand.zero_stage == 3 and cand.dp_shard > 1
        gather = _on_floats(a_gat, c_gat, synced) if self.gathers else 0.0 * self.params
        self.sums: list[tuple[FloatArray, float] | None] = [None] * len(modes)
        self.states = model_state_bytes(self.params, model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp_shard))
        self.budget = memory_budget(rank_capacity(cluster, cand), options)
        largest = max(c.largest_param_bytes for c in costs)
        out_bytes = np.array([0.0] + [float(u.output_bytes) for u in graph.units])  # [j]: unit j-1's output
        self.buf_mid = np.asarray(comm_buffer_bytes(out_bytes, cand, options, largest), dtype=float)
        self.buf_last = float(comm_buffer_bytes(0.0, cand, options, largest))
        self.send = np.array([2.0 * p2p_time(float(b), cand, cluster) if j else 0.0 for j, b in enumerate(out_bytes)])
        # each rank's peak instants (`rank_stage_counts`), padded to one count per rank with zero rows: per
        # stage, its count at each of its rank's instants (stage_w), and per rank and local stage (counts)
        comps = [rank_stage_counts(cand.schedule, p, m, cand.virtual_stages, r) for r in range(p)]
        nc = max(len(c) for c in comps)
        self.counts = np.zeros((p, cand.virtual_stages, nc))
        for r, cs in enumerate(comps):
            for c, row in enumerate(cs):
                self.counts[r, :, c] = row
        local = [sum(1 for t in range(s) if self.ranks[t] == self.ranks[s]) for s in range(S)]
        self.stage_w = [self.counts[self.ranks[s], local[s]] for s in range(S)]
        self.nc = nc
        valid = tables.valid
        self.T: list[FloatArray] = []
        self.Z: list[FloatArray] = []
        self.win: list[FloatArray] = []
        self.act: list[FloatArray] = []
        self.zlow: list[FloatArray] = []
        self.slow: list[FloatArray] = []
        self.ranked: list[FloatArray] = []
        self.synced: list[FloatArray] = []
        self.tailed: list[FloatArray] = []
        self.work_left: list[FloatArray] = []
        self.params_left = np.where(valid, self.params, 0.0)[:, U]
        # the syncs (without their latency) and optimizer steps of units j..U-1, linear in their parameters
        sync_rate = a_sync if cand.dp_shard > 1 else 0.0
        self.tail_left = sync_rate * np.where(valid, synced, 0.0)[:, U] + self.a_step * self.params_left
        self.bwd_left: list[FloatArray] = []
        self.future_first = [[x for x in range(p) if self.first[x] > s] for s in range(S)]
        self.placed_first = [[x for x in range(p) if self.first[x] <= s] for s in range(S)]
        self.rank_stages = np.array([[st for st in range(S) if self.ranks[st] == r] for r in range(p)])
        self.placed_before = [np.array([self.first[x] < s for x in range(p)]) for s in range(S)]
        self.has_sync = cand.dp_shard > 1  # without data parallelism a rank's tail is its optimizer step
        self.row_memo: dict[tuple[int, int, int], _Rows] = {}
        self.stage_ok = pb.stage_ok  # zero-bubble: the intervals a stage after the first may hold (or None: any)
        no_send = np.zeros(U + 1)
        # zero-bubble: INF where units i..j-1 may not form a stage after the first (or j <= i)
        later_bar: FloatArray | None = None if self.stage_ok is None else np.where(np.triu(self.stage_ok, 1), 0.0, INF)
        # (the starts i where it refuses some end j > i, and their rows of it: elsewhere a suffix minimum is the same)
        barred = [] if later_bar is None else [i for i in range(U) if np.isinf(later_bar[i, i + 1 :]).any()]
        barred_bar = None if later_bar is None else later_bar[barred][None]
        for q in modes:
            T = np.where(valid, np.maximum(tables.t[q], gather), INF)
            Z = T if cand.schedule == "interleaved-1f1b" else np.where(valid, tables.fwd, INF)
            # suffix tables over the units j..U-1 into stages s..S-1: least largest Z, least sum of sends
            zlow = np.full((S + 1, U + 1), INF)
            slow = np.full((S + 1, U + 1), INF)
            zlow[S, U] = slow[S, U] = 0.0
            # per rank: the least m (its time) + its optimizer step over its stages among s..S-1, plus the
            # sends of every stage
            ranked = np.full((p, S + 1, U + 1), INF)
            ranked[:, S, U] = 0.0
            own = m * T + self.a_step * self.params
            # the same with the syncs of the rank's stages less its first stage's window (unclipped)
            synced_r = ranked.copy()
            # and the rank's tail alone: its syncs less its first stage's window (with data parallelism) plus
            # its optimizer step, plus the sends of every stage
            tailed = ranked.copy()
            win_q = a_win * (tables.t[q] - tables.fwd) + c_win
            own_sync = own + self.sync
            own_tail = np.where(np.isfinite(T), self.a_step * self.params + self.sync, INF)
            for s in range(S - 1, -1, -1):
                out = self.send if s < S - 1 else no_send
                # zero-bubble: INF on the intervals a stage after the first may not hold
                bar = later_bar if s > 0 and later_bar is not None else 0.0
                zlow[s] = np.maximum(Z + bar, zlow[s + 1][None, :]).min(axis=1)
                # a stage of another rank adds only its send: min over j > i of out[j] + f[j], a suffix minimum
                # (under zero-bubble's rule, over the ends j the stage may reach from i)
                for tab in (slow[None], ranked, synced_r, tailed):
                    nxt = out[None, :] + tab[:, s + 1]
                    later = np.minimum.accumulate(nxt[:, ::-1], axis=1)[:, ::-1]
                    tab[:, s, :U] = later[:, 1:]
                    tab[:, s, U] = INF
                    if s > 0 and barred_bar is not None:  # the starts whose ends the rule limits
                        tab[:, s, barred] = (nxt[:, None, :] + barred_bar).min(axis=2)
                r = self.ranks[s]
                opens = win_q if self.first[r] == s else 0.0
                ranked[r, s] = (own + bar + out[None, :] + ranked[r, s + 1][None, :]).min(axis=1)
                synced_r[r, s] = (own_sync + bar - opens + out[None, :] + synced_r[r, s + 1][None, :]).min(axis=1)
                mine = own_tail + bar - (opens if self.has_sync else 0.0)
                tailed[r, s] = (mine + out[None, :] + tailed[r, s + 1][None, :]).min(axis=1)
            self.T.append(T)
            self.Z.append(Z)
            self.win.append(win_q)
            self.act.append(_span([c.act[q] for c in costs]))
            self.zlow.append(zlow)
            self.slow.append(slow)
            self.ranked.append(ranked)
            self.synced.append(synced_r)
            self.tailed.append(tailed)
            self.work_left.append(np.where(valid, tables.t[q], 0.0)[:, U])
            self.bwd_left.append(np.where(valid, tables.t[q] - tables.fwd, 0.0)[:, U])

    def integral(self, costs: list[UnitCost], hi: float) -> None:
        """The rank time's possible values below ``hi`` (an upper bound on the largest rank time of a plan
        worth finding): a rank holds whole units, so its time (without ZeRO-3 gathers) is a subset sum of
        the unit times, and the largest rank is at least the least such sum at or above the water level."""
        self.sums = [
            None if self.gathers else _subset_sums([c.fwd + c.bwd[q] for c in costs], hi * (1 + 1e-9))
            for q in self.modes
        ]

    def objective(self, q: int, C: IntArray) -> FloatArray:
        """The linear objective of each row of stage starts C (rows x S+1, C[:, 0] = 0, C[:, S] = U) in mode
        q, as a leaf of the branch and bound counts it; INF where a rank's memory row fails."""
        a, b = C[:, :-1], C[:, 1:]
        T, Z = self.T[q][a, b], self.Z[q][a, b]
        idx = self.rank_stages  # p x v stage indices
        R = T[:, idx].sum(axis=2)
        P = self.params[a, b][:, idx].sum(axis=2)
        sy = self.sync[a, b][:, idx].sum(axis=2)
        win = self.win[q][a, b][:, self.first]
        tau = np.maximum(0.0, sy - win) + np.where(P > 0, self.a_step * P + self.c_step, 0.0)
        send = self.send[b[:, :-1]].sum(axis=1)
        buf = np.concatenate([self.buf_mid[b[:, :-1]], np.full((len(C), 1), self.buf_last)], axis=1)
        acts = np.einsum("xrv,rvc->xrc", self.act[q][a, b][:, idx], self.counts).max(axis=2)
        mem = (self.states[a, b] + buf)[:, idx].sum(axis=2) + acts
        obj = self.m * R.max(axis=1) + (self.p - 1) * Z.max(axis=1) + send + tau.max(axis=1)
        fits = (mem <= self.budget).all(axis=1)
        if self.stage_ok is not None:
            fits &= self.stage_ok[a[:, 1:], b[:, 1:]].all(axis=1)
        out: FloatArray = np.where(fits, obj, INF)
        return out

    def polish(self, q: int, cuts: list[int], steps: int = POLISH_STEPS) -> tuple[list[int], float]:
        """Local search from a partition (its stage starts and U): move one stage boundary by one unit at a
        time, the best move first, while the objective falls (at most ``steps`` moves: a count)."""
        C = np.array([cuts])
        obj = float(self.objective(q, C)[0])
        S = self.S
        for _ in range(steps):
            moves = np.repeat(C, 2 * (S - 1), axis=0)
            k = np.repeat(np.arange(1, S), 2)
            moves[np.arange(len(k)), k] += np.tile([-1, 1], S - 1)
            ok = (np.diff(moves, axis=1) >= 1).all(axis=1)
            moves = moves[ok]
            if not len(moves):
                break
            vals = self.objective(q, moves)
            i = int(np.argmin(vals))
            if not vals[i] < obj * (1 - EPS):
                break
            C, obj = moves[i : i + 1], float(vals[i])
        return [int(x) for x in C[0]], obj

    def root(self, mode: int) -> _Node:
        z = np.zeros(self.p)
        return _Node(mode, 0, (0,), z, z, z, z, z, np.zeros((self.p, self.nc)), 0.0, 0.0, 0.0)

    def rows(self, q: int, s: int, i: int) -> _Rows:
        """The tables' entries for stage s starting at unit i in mode q, over its possible ends (`_Rows`),
        indexed once: every node of that (mode, stage, start) reads the same ones."""
        key = (q, s, i)
        got = self.row_memo.get(key)
        if got is None:
            U, S = self.U, self.S
            last = s == S - 1
            js: IntArray = np.arange(i + 1, U - (S - 1 - s) + 1) if not last else np.array([U])
            r = self.ranks[s]
            first = self.first[r] == s
            got = _Rows(
                js=js,
                t=self.T[q][i, js],
                states=self.states[i, js],
                buf=self.buf_last if last else self.buf_mid[js],
                act=self.act[q][i, js][:, None] * self.stage_w[s][None, :],
                sync=self.sync[i, js],
                params=self.params[i, js],
                win=self.win[q][i, js] if first else None,
                work_left=self.work_left[q][js],
                params_left=self.params_left[js],
                slow=self.slow[q][s + 1, js],
                later=np.stack([tab[q][:, s + 1, js] for tab in (self.ranked, self.synced, self.tailed)]),
                tail_left=self.tail_left[js] + (S - 1 - s) * self.c_sync_low,
                bwd_left=self.bwd_left[q][js],
                z=np.maximum(self.Z[q][i, js], self.zlow[q][s + 1, js]),
                send=0.0 if last else self.send[js],
            )
            if self.stage_ok is not None and s > 0:
                allowed = self.stage_ok[i, js]
                if not allowed.all():
                    got = got.only(allowed)
            self.row_memo[key] = got
        return got

    def expand(self, nd: _Node) -> _Children:
        """The node's children that fit memory, with their lower bounds (see the module docstring)."""
        q, s = nd.mode, nd.s
        p, m, r = self.p, self.m, self.ranks[nd.s]
        row = self.rows(q, s, nd.cuts[-1])
        # the rank's memory row with this stage added (it only grows with the rank's later stages)
        mem = nd.mem_s[r] + row.states + row.buf + (nd.mem_a[r][None, :] + row.act).max(axis=1)
        ok = np.isfinite(row.t) & (mem <= self.budget)
        kept = int(np.count_nonzero(ok))
        if kept < len(ok):
            # (most often the ends up to some unit fit and the later ones do not: then a slice, no copy)
            row = row.only(slice(0, kept) if ok[:kept].all() else ok)
        js, t_ij = row.js, row.t
        n = len(js)
        sy_j = nd.sy[r] + row.sync
        par_j = nd.par[r] + row.params
        w_j = row.win if row.win is not None else nd.win[r]
        exposed_j = np.maximum(0.0, sy_j - w_j)
        tau = exposed_j + np.where(par_j > 0, self.a_step * par_j + self.c_step, 0.0)
        tails = np.maximum(nd.tail, tau)
        load = np.repeat(nd.load[None, :], n, axis=0)
        load[:, r] += t_ij
        par = np.repeat(nd.par[None, :], n, axis=0)
        par[:, r] = par_j
        act_r = self.active[s + 1]
        # the water levels below, of the work, the parameters and (with data parallelism) the tails left, in one
        # array (each row on its own: the same figures as one call each)
        new, rem = [load, par], [row.work_left, row.params_left]

        def per_rank(base: FloatArray, col: FloatArray, later: FloatArray) -> FloatArray:
            """Per row k: max over ranks of base[k] (the other ranks) or col[k] (rank r), each plus its later
            share later[k] (rows x children)."""
            others = base[:, :, None] + later
            others[:, r] = -INF
            out: FloatArray = np.maximum(others.max(axis=1), col + later[:, r])
            return out

        # m R_r + tau_r >= m R_r + exposed sync so far + step_r, per rank plus what its later stages add
        placed = self.placed_before[s]
        exposed = np.where(placed, np.maximum(0.0, nd.sy - nd.win), 0.0)
        time_j = m * (nd.load[r] + t_ij)
        step_j = self.a_step * par_j
        step = self.a_step * nd.par
        load_m = m * nd.load
        own = time_j + exposed_j + step_j
        spread: FloatArray | None = None
        if not self.has_sync:
            # (and max tau >= tau_r: per rank its optimizer step so far plus what its later stages add, and the sends)
            rows = per_rank(np.stack([load_m + exposed + step, step]), np.stack([own, step_j]), row.later[0::2])
            joint, tailed = rows[0], rows[1]
        else:
            # m R_r + sync_r - window_r + step_r <= m R_r + tau_r, every part a sum over the rank's stages
            opened = np.where(placed, nd.win, 0.0)
            base = nd.sy - opened + step
            col = sy_j - w_j + step_j
            # (and the rank's tail alone, sync_r - window_r + step_r <= max tau, in the last row)
            bases = np.stack([load_m + exposed + step, load_m + base, base])
            rows = per_rank(bases, np.stack([own, time_j + col, col]), row.later)
            joint, tailed = np.maximum(rows[0], rows[1]), rows[2]
            # tail >= max_r (sync_r - window_r + step_r): the syncs and steps left add up to tail_left, the
            # windows of the first stages still to come to at most their backward (a water level once every
            # rank's window is known, which makes every addition non-negative; the mean over ranks before)
            x = np.repeat(base[None, :], n, axis=0)
            x[:, r] = col
            future = self.future_first[s]
            rest = row.tail_left
            if future:
                rest = rest - (self.a_win_up * row.bwd_left + len(future) * self.c_win_up)
                known = x[:, self.placed_first[s]].max(axis=1)
                spread = np.maximum(known, (x[:, act_r].sum(axis=1) + rest) / len(act_r))
            else:
                new.append(x)
                rem.append(rest)
        levels = _level(np.concatenate(new), np.concatenate(rem), act_r)
        y = _round_up(levels[:n], self.sums[q])
        tail = np.maximum(tails, self.a_step * levels[n : 2 * n] + self.step_low)
        if self.has_sync:
            tail = np.maximum(tail, (spread if spread is not None else levels[2 * n :]) + self.step_low)
        joint = joint + self.step_low
        z = np.maximum(nd.zc, row.z)
        here = nd.sc + row.send
        lows = np.maximum(m * y + np.maximum(row.slow + tail, tailed + self.step_low), joint) + here + (p - 1) * z
        order = np.argsort(lows, kind="stable")
        return _Children(nd, js[order], lows[order], tails[order])

    def child(self, ch: _Children, c: int) -> _Node:
        """The node of the children's c-th (stage s ending before unit js[c])."""
        nd, j = ch.node, int(ch.js[c])
        q, s, i, r = nd.mode, nd.s, nd.cuts[-1], self.ranks[nd.s]
        load, sy, par, win = nd.load.copy(), nd.sy.copy(), nd.par.copy(), nd.win.copy()
        mem_s, mem_a = nd.mem_s.copy(), nd.mem_a.copy()
        load[r] += self.T[q][i, j]
        sy[r] += self.sync[i, j]
        par[r] += self.params[i, j]
        if self.first[r] == s:
            win[r] = self.win[q][i, j]
        mem_s[r] += self.states[i, j] + self.buf_mid[j]
        mem_a[r] = mem_a[r] + self.act[q][i, j] * self.stage_w[s]
        zc = max(nd.zc, float(self.Z[q][i, j]))
        return _Node(q, s + 1, (*nd.cuts, j), load, sy, par, win, mem_s, mem_a, zc, nd.sc + float(self.send[j]),
                     float(ch.tails[c]))


def solve_ranks(
    pb: PartitionProblem,
    limit: float | None,
    incumbent: tuple[list[list[int]], list[str], float] | None = None,
    max_nodes: int | None = MAX_NODES,
) -> RanksResult:
    """The least objective below ``limit`` (None: no limit) over the partitions that fit memory, one
    recomputation mode for every stage, ``incumbent`` a known plan (partition, recomputation, objective) to
    beat; past ``max_nodes`` the best plan found and a valid lower bound (see the module docstring)."""
    cand, costs, modes = pb.cand, pb.costs, pb.modes
    bb = _Search(pb)
    best_obj = INF if limit is None else limit
    best: tuple[list[list[int]], list[str], float] | None = None
    if incumbent is not None and incumbent[2] < best_obj:
        best_obj, best = incumbent[2], incumbent

    def polished(part: list[list[int]], rec: list[str]) -> None:
        """Keep the local search's improvement of a plan (one mode for every stage) when it beats the best."""
        nonlocal best_obj, best
        if len(set(rec)) != 1 or rec[0] not in modes:
            return
        q = modes.index(rec[0])
        cuts, obj = bb.polish(q, [units[0] for units in part] + [bb.U])
        if obj < best_obj * (1 - EPS):
            best_obj = obj
            best = ([list(range(cuts[t], cuts[t + 1])) for t in range(bb.S)], [rec[0]] * bb.S, obj)

    if best is not None:
        polished(best[0], best[1])
    nodes = 0
    # open nodes' children lists, keyed by their next child's bound (then by a counter: deterministic)
    heap: list[tuple[float, int, _Children]] = []
    seq = 0

    def push(ch: _Children) -> None:
        nonlocal seq
        if ch.at < len(ch.js) and ch.lows[ch.at] < best_obj * (1 - EPS):
            heapq.heappush(heap, (float(ch.lows[ch.at]), seq, ch))
            seq += 1

    if best_obj < INF:
        bb.integral(costs, best_obj / cand.num_micro_batches)
    for q in range(len(modes)):
        top = bb.expand(bb.root(q))
        nodes += 1 + len(top.js) * bb.p // EFFORT_BOUNDS
        push(top)
    while heap:
        low, _, ch = heapq.heappop(heap)
        if low >= best_obj * (1 - EPS):
            heap.clear()
            break
        if max_nodes is not None and nodes >= max_nodes:
            heapq.heappush(heap, (low, -1, ch))
            break
        # dive: take the least child, put its siblings back, go on with its own least child
        while True:
            c = ch.at
            ch.at += 1
            push(ch)
            if ch.node.s == bb.S - 1:
                # a complete partition: its bound is its objective (every term is exact at a leaf)
                obj = float(ch.lows[c])
                if obj < best_obj:
                    cuts = (*ch.node.cuts, bb.U)
                    part = [list(range(cuts[t], cuts[t + 1])) for t in range(bb.S)]
                    best_obj, best = obj, (part, [modes[ch.node.mode]] * bb.S, obj)
                break
            nxt = bb.expand(bb.child(ch, c))
            nodes += 1 + len(nxt.js) * bb.p // EFFORT_BOUNDS
            if not len(nxt.js) or nxt.lows[0] >= best_obj * (1 - EPS):
                break
            ch = nxt
            if max_nodes is not None and nodes >= max_nodes:
                push(ch)
                break
    if heap and best is not None:
        polished(best[0], best[1])  # stopped early: the plan found, improved where a move helps
    open_low = min((h[0] for h in heap if h[0] < best_obj * (1 - EPS)), default=INF)
    if best is None:
        return RanksResult(None, None, None, open_low if open_low < INF else INF, nodes)
    return RanksResult(best[2], best[0], best[1], min(open_low, best[2]), nodes)
