"""Discrete-event simulation of one pipeline-parallel iteration under a given schedule.

Each rank runs its actions in the order torch.distributed.pipelining would (the order generators below
mirror torch's schedules.py); an action starts once its rank is free and its input has arrived. The
result gives the iteration time, per-rank busy time, the full event list (for the timeline picture) and
the activation high-water mark per stage (for the memory model).

Model: one action runs at a time per rank; point-to-point sends are asynchronous and never contend
(a transfer only delays its receiver by p2p seconds); nothing else (optimizer step, gradient reduction)
is counted. Pure Python, no torch import: the cost model stays free of torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple

from planner.cost.placement import schedule_violation, stage_rank

# Action kinds. B is the full backward, or only the input-gradient pass when the schedule splits W off.
F, B, W = 0, 1, 2
KIND_NAMES = ("F", "B", "W")

Action = tuple[int, int, int]  # (kind, stage, micro-batch)


class Event(NamedTuple):
    """One compute action as simulated; kind is "F", "B" (full or input-gradient backward) or "W"."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


class Transfer(NamedTuple):
    """A point-to-point send between ranks: activations ("F", stage -> stage+1) or gradients ("B", back)."""

    src_rank: int
    dst_rank: int
    stage: int  # the sending stage
    microbatch: int
    kind: str
    start: float
    end: float


class PathCounts(NamedTuple):
    """A path of the iteration's DAG as counts: per stage, how many of its forward, backward (full, or the
    input-gradient pass under zero-bubble) and weight-gradient actions lie on it; per stage boundary
    s -> s+1, how many times it crosses that link between two ranks. Its length is the sum of those
    counts times the durations (and link times): linear in them."""

    fwd: list[int]
    bwd: list[int]
    wgt: list[int]
    links: list[int]


@dataclass(frozen=True)
class SimResult:
    """Outcome of `simulate`. Times are in the unit of the inputs (seconds throughout the planner)."""

    schedule: str
    p: int
    m: int
    v: int
    iteration_time: float
    busy: list[float]  # per rank: seconds spent computing
    bubble_fraction: float  # idle share of the iteration, 1 - mean(busy) / iteration_time
    peak_in_flight: list[int]  # per stage: most micro-batches with forward done and backward not finished
    rank_peak_in_flight: list[int]  # per rank: the same, summed over the rank's stages at one instant
    stage_ranks: list[int]  # per stage: the rank that runs it
    p2p: list[float]  # per stage boundary s -> s+1 (p*v - 1 entries)
    # Per rank, (kind, stage, micro-batch, start, end) in execution order; `events` dresses it up lazily
    # because the search simulates many candidates and draws few.
    log: list[list[tuple[int, int, int, float, float]]] = field(repr=False, compare=False)

    @property
    def bubble_ratio(self) -> float:
        """Idle over ideal time, iteration_time / mean(busy) - 1: Narayanan et al.'s (p-1)/m quantity."""
        work = sum(self.busy) / self.p
        return self.iteration_time / work - 1.0 if work > 0 else 0.0

    @cached_property
    def events(self) -> list[Event]:
        """Every compute action, rank by rank, each rank's in execution order."""
        return [
            Event(r, s, j, KIND_NAMES[k], a, b) for r, log in enumerate(self.log) for k, s, j, a, b in log
        ]

    @cached_property
    def transfers(self) -> list[Transfer]:
        """Point-to-point sends between different ranks with non-zero duration, in the order of `events`."""
        return _transfers(self.log, self.stage_ranks, self.p2p)

    def rank_paths(self) -> list[PathCounts]:
        """For each rank, a longest path of the iteration ending at the rank's last action (`PathCounts`).

        The simulated time is the longest path of a DAG whose nodes are the actions, weighted by their
        durations, and whose edges join each action to the next of its rank and to the actions that wait
        for it (a forward to the next stage's, a backward to the previous stage's, a stage's last forward
        to its backward, an input-gradient pass to its weight pass), the edges between ranks weighted by
        the link's time. Walking back from an action to the predecessor that finished last gives such a
        path; any path of the DAG (ties broken either way) is at most the iteration time for every
        choice of durations and links, which is what `planner.search.pathbound` uses."""
        n, m = len(self.stage_ranks), self.m
        size = n * m
        end = [0.0] * (3 * size)
        at: dict[int, tuple[int, int]] = {}
        for r, log in enumerate(self.log):
            for i, (k, s, j, _, t) in enumerate(log):
                key = k * size + s * m + j
                end[key] = t
                at[key] = (r, i)
        ranks, link = self.stage_ranks, self.p2p
        out = []
        for r0, log0 in enumerate(self.log):
            if not log0:
                continue
            counts = PathCounts([0] * n, [0] * n, [0] * n, [0] * max(n - 1, 0))
            r, i = r0, len(log0) - 1
            while True:
                k, s, j, _, _ = self.log[r][i]
                (counts.fwd, counts.bwd, counts.wgt)[k][s] += 1
                best: tuple[float, int, int] | None = None  # (ready time, action key, boundary crossed or -1)
                if i > 0:
                    pk, ps, pj, _, pt = self.log[r][i - 1]
                    best = (pt, pk * size + ps * m + pj, -1)
                deps: list[tuple[int, int]] = []  # (action key, boundary crossed or -1)
                if k == F and s > 0:
                    deps.append((F * size + (s - 1) * m + j, s - 1 if ranks[s - 1] != ranks[s] else -1))
                elif k == B:
                    deps.append((F * size + s * m + j, -1))
                    if s < n - 1:
                        deps.append((B * size + (s + 1) * m + j, s if ranks[s + 1] != ranks[s] else -1))
                elif k == W:
                    deps.append((B * size + s * m + j, -1))
                for key, cross in deps:
                    t = end[key] + (link[cross] if cross >= 0 else 0.0)
                    if best is None or t > best[0]:
                        best = (t, key, cross)
                if best is None:
                    break
                _, key, cross = best
                if cross >= 0:
                    counts.links[cross] += 1
                r, i = at[key]
            out.append(counts)
        return out


# --- per-rank action orders, mirroring torch.distributed.pipelining.schedules ---------------------------


def _gpipe_order(p: int, m: int, rank: int) -> list[Action]:
    # ScheduleGPipe: fill with every forward, then drain with every backward, micro-batch 0 first.
    return [(F, rank, j) for j in range(m)] + [(B, rank, j) for j in range(m)]


def _1f1b_order(p: int, m: int, rank: int) -> list[Action]:
    # Schedule1F1B._step_microbatches: min(m, p - rank) warm-up forwards, then 1B1F, then the remaining B.
    # (Its _get_pipeline_order is only a drawing aid and starts the last rank at micro-batch 1.)
    warmup = min(m, p - rank)
    ops: list[Action] = [(F, rank, j) for j in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < m:
        ops.append((B, rank, bwd))
        bwd += 1
        if fwd < m:
            ops.append((F, rank, fwd))
            fwd += 1
    return ops


def _interleaved_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    # ScheduleInterleaved1F1B._calculate_single_rank_operations + _get_1f1b_rank_ops (no zero bubble),
    # with the idle (None) slots dropped: they only align torch's lock-step picture.
    rounds = max(1, m // p)
    per_round = m // rounds
    # _get_warmup_ops: (v-1) rounds for the last rank, two more forwards per hop towards the first rank.
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    total = m * v
    fwd_bwd = total - warmup
    fwd_mb = [0] * (p * v)
    bwd_mb = [0] * (p * v)
    ops: list[Action] = []

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            s = fwd_stage(op)
            ops.append((F, s, fwd_mb[s]))
            fwd_mb[s] += 1
        if op >= warmup:
            s = bwd_stage(op)
            ops.append((B, s, bwd_mb[s]))
            bwd_mb[s] += 1
    return ops


def _zbv_order(p: int, m: int, rank: int) -> list[Action]:
    # ScheduleZBVZeroBubble._calculate_single_rank_operations: built for max(2p - 1, m) micro-batches,
    # then the actions on micro-batches >= m are dropped (torch turns them into idle slots).
    n = max(2 * p - 1, m)
    s0, s1 = rank, 2 * p - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append((F, s0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [(F, s1, f1), (F, s0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        ops += [(F, s1, f1), (B, s1, b1), (W, s1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append((F, s0, f0))
            f0 += 1
        ops += [(B, s0, b0), (W, s0, b0), (F, s1, f1), (B, s1, b1), (W, s1, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(B, s0, b0), (B, s1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        ops += [(B, s0, b0), (W, s0, w0)]
        b0 += 1
        w0 += 1
    ops += [(W, s1, j) for j in range(w1, b1)]
    ops += [(W, s0, j) for j in range(w0, b0)]
    return [a for a in ops if a[2] < m]


def rank_actions(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's compute actions (kind, stage, micro-batch) in the order the schedule runs them."""
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
    return [_rank_order(schedule, p, m, v, r) for r in range(p)]


def rank_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[Action]:
    """One rank's actions of `rank_actions`."""
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
    return _rank_order(schedule, p, m, v, rank)


def _rank_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[Action]:
    if schedule == "gpipe":
        return _gpipe_order(p, m, rank)
    if schedule == "1f1b":
        return _1f1b_order(p, m, rank)
    if schedule == "interleaved-1f1b":
        return _interleaved_order(p, m, v, rank)
    return _zbv_order(p, m, rank)


@lru_cache(maxsize=16)
def _schedule_orders(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """`rank_actions`, frozen and cached: the search simulates many partitions of one (schedule, p, m, v)."""
    return tuple(tuple(acts) for acts in rank_actions(schedule, p, m, v))


@lru_cache(maxsize=16)
def _schedule_in_flight(schedule: str, p: int, m: int, v: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`_in_flight` of the schedule's orders, cached: it depends on the orders only, not on the times."""
    peak, rank_peak = _in_flight(_schedule_orders(schedule, p, m, v), p * v, split=schedule == "zero-bubble")
    return tuple(peak), tuple(rank_peak)


# --- the simulation --------------------------------------------------------------------------------------


def _per_stage(name: str, values: list[float], n: int) -> list[float]:
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries; expected one per pipeline stage ({n})")
    out = [float(x) for x in values]
    if not all(0.0 <= x < float("inf") for x in out):
        raise ValueError(f"{name} must hold finite times >= 0, got {values}")
    return out


def _p2p_list(p2p: list[float] | float, n: int) -> list[float]:
    # p2p[s] is the link from stage s to s+1; a list of n entries is accepted with the last one unused.
    if isinstance(p2p, (int, float)):
        out = [float(p2p)] * max(n - 1, 0)
    elif len(p2p) in (n - 1, n):
        out = [float(x) for x in p2p[: n - 1]]
    else:
        raise ValueError(f"p2p has {len(p2p)} entries; expected one per stage boundary ({n - 1}) or a number")
    if not all(0.0 <= x < float("inf") for x in out):
        raise ValueError(f"p2p must hold finite times >= 0, got {p2p}")
    return out


def simulate(
    schedule: str,
    p: int,
    m: int,
    v: int,
    stage_fwd: list[float],
    stage_bwd: list[float],
    stage_bwd_weight: list[float] | None = None,
    p2p: list[float] | float = 0.0,
) -> SimResult:
    """Simulate one iteration of `schedule` on p ranks with m micro-batches and v stages per rank.

    stage_fwd[s], stage_bwd[s]: forward and full backward time of one micro-batch on stage s (p*v
    entries). stage_bwd_weight[s]: the weight-gradient part of stage_bwd[s]; only zero-bubble runs it as
    its own W pass (then B takes the rest; other schedules run one fused backward, event kind "B"); None
    means half of the backward, the matmul split the zero-bubble paper assumes (Qi et al. 2024, sec. 2:
    input and weight gradients of a matmul each cost one forward matmul).
    p2p[s]: time to send stage s's output to stage s+1, and its gradient back; paid only between ranks.
    """
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
    n = p * v
    fwd = _per_stage("stage_fwd", stage_fwd, n)
    bwd = _per_stage("stage_bwd", stage_bwd, n)
    if stage_bwd_weight is None:
        wgt = [x / 2 for x in bwd]
    else:
        wgt = _per_stage("stage_bwd_weight", stage_bwd_weight, n)
        if any(w > b for w, b in zip(wgt, bwd, strict=True)):
            raise ValueError(
                "stage_bwd_weight[s] is the weight-gradient part of stage_bwd[s]: it cannot exceed it"
            )
    if schedule == "zero-bubble":
        bin_ = [b - w for b, w in zip(bwd, wgt, strict=True)]
    else:  # one fused backward pass; no W actions are scheduled
        bin_, wgt = bwd, [0.0] * n
    link = _p2p_list(p2p, n)
    ranks = [stage_rank(schedule, p, v, s) for s in range(n)]
    # Delay on the edge into stage s from s-1 (forward) and into stage s from s+1 (backward).
    f_in = [0.0] + [link[s - 1] if ranks[s - 1] != ranks[s] else 0.0 for s in range(1, n)]
    b_in = [link[s] if ranks[s + 1] != ranks[s] else 0.0 for s in range(n - 1)] + [0.0]
    duration = (fwd, bin_, wgt)

    orders = _schedule_orders(schedule, p, m, v)
    size = n * m
    # end[kind * size + stage * m + j]: completion time, -1 while not done.
    end = [-1.0] * (3 * size)
    waiter = [-1] * (3 * size)  # the rank blocked on that action, if any
    ptr = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    done: list[list[tuple[int, int, int, float, float]]] = [[] for _ in range(p)]
    # Each rank advances until its next action waits on another rank's; that rank wakes it when done.
    stack = list(range(p - 1, -1, -1))
    last = n - 1
    while stack:
        r = stack.pop()
        acts = orders[r]
        n_acts = len(acts)
        i, t, work, log = ptr[r], free[r], busy[r], done[r]
        while i < n_acts:
            k, s, j = acts[i]
            idx = s * m + j
            if k == F:
                if s:
                    dep = idx - m
                    ready = end[dep]
                    if ready < 0:
                        waiter[dep] = r
                        break
                    ready += f_in[s]
                else:
                    ready = 0.0
            elif k == B:
                dep = idx if s == last else size + idx + m
                ready = end[dep]
                if ready < 0:
                    waiter[dep] = r
                    break
                if end[idx] < 0:  # own forward: same rank, so only a malformed order can miss it
                    waiter[idx] = r
                    break
                ready += b_in[s]
            else:
                dep = size + idx
                ready = end[dep]
                if ready < 0:
                    waiter[dep] = r
                    break
            start = t if t > ready else ready
            d = duration[k][s]
            t = start + d
            work += d
            key = k * size + idx
            end[key] = t
            log.append((k, s, j, start, t))
            i += 1
            w = waiter[key]
            if w >= 0:
                waiter[key] = -1
                stack.append(w)
        ptr[r], free[r], busy[r] = i, t, work
    stuck = [r for r in range(p) if ptr[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        raise RuntimeError(
            f"{schedule} order deadlocks at rank {r}, action {orders[r][ptr[r]]} (p={p}, m={m}, v={v})"
        )

    iteration = max(free) if p else 0.0
    peak_t, rank_peak_t = _schedule_in_flight(schedule, p, m, v)
    peak, rank_peak = list(peak_t), list(rank_peak_t)
    return SimResult(
        schedule=schedule,
        p=p,
        m=m,
        v=v,
        iteration_time=iteration,
        busy=busy,
        bubble_fraction=1.0 - sum(busy) / p / iteration if iteration > 0 else 0.0,
        peak_in_flight=peak,
        rank_peak_in_flight=rank_peak,
        stage_ranks=ranks,
        p2p=link,
        log=done,
    )


def _transfers(
    done: list[list[tuple[int, int, int, float, float]]], ranks: list[int], link: list[float]
) -> list[Transfer]:
    n = len(ranks)
    out = []
    for r, log in enumerate(done):
        for k, s, j, _, t in log:
            if k == F and s < n - 1 and ranks[s + 1] != r and link[s] > 0:
                out.append(Transfer(r, ranks[s + 1], s, j, "F", t, t + link[s]))
            elif k == B and s > 0 and ranks[s - 1] != r and link[s - 1] > 0:
                out.append(Transfer(r, ranks[s - 1], s, j, "B", t, t + link[s - 1]))
    return out


def _in_flight(orders: Sequence[Sequence[Action]], n: int, split: bool) -> tuple[list[int], list[int]]:
    # A rank runs its actions one at a time, so counting along its order is exact whatever the timing.
    # Activations are held from the forward until the last backward pass that reads them (W when split).
    release = W if split else B
    count = [0] * n
    peak = [0] * n
    rank_peak = []
    for acts in orders:
        held = top = 0
        for k, s, _ in acts:
            if k == F:
                count[s] += 1
                held += 1
                if count[s] > peak[s]:
                    peak[s] = count[s]
                if held > top:
                    top = held
            elif k == release:
                count[s] -= 1
                held -= 1
        rank_peak.append(top)
    return peak, rank_peak
