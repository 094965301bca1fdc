"""Pipeline schedules: closed forms for uniform stages and the in-flight micro-batch counts of each order.

Names follow `planner.names.Schedule`; placement and the rules torch imposes are in
`planner.cost.placement`. Notation: p pipeline ranks, m micro-batches per iteration, v stages per rank
(p*v stages in all). The closed forms assume uniform stages and free communication; the discrete-event
simulator in `planner.cost.simulate` agrees with them exactly in that case (tests check it) and is what
to use for uneven stages or non-zero point-to-point time.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt

from planner.cost.placement import check_stage, raise_if_refused, schedule_violation, stage_rank
from planner.cost.simulate import B, F, W, rank_order, simulate
from planner.names import SCHEDULES

__all__ = ["SCHEDULES", "schedule_violation", "stage_rank"]

IntArray = npt.NDArray[np.int64]


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble as idle time over ideal time, (T - m t) / (m t) (Narayanan et al., SC21, sec. 2.2).

    GPipe and 1F1B: (p-1)/m (sec. 2.2.1). Interleaved 1F1B: (p-1)/(v*m) for m >= p (sec. 2.2.2); torch
    also runs m < p, where it is (v(p-m) + m - 1)/(v*m). Zero-bubble (ZBV, Qi et al. 2024, sec. 6)
    assumes forward, input-gradient and weight-gradient passes of equal length and m >= 2p; torch's order
    then idles only the unavoidable start-up of p-1 stage forwards: (p-1)/(6m), about 0 (exact from
    m >= 3p/2; below that, the simulated value of the same case). All with free communication. This is
    idle/ideal, as in the paper; the simulator's `bubble_fraction` is idle/total, b / (1 + b) of this.
    """
    if schedule in ("gpipe", "1f1b"):
        raise_if_refused(schedule, p, m, v)
        return (p - 1) / m
    # The others follow from their iteration time; per-stage F : B : W = 1 : 1 : 1 as ZBV assumes.
    t_f, t_b = float(v), 2.0 * v
    t_w = t_f if schedule == "zero-bubble" else 0.0
    return iteration_time_uniform(schedule, p, m, v, t_f, t_b, t_w) / (m * (t_f + t_b)) - 1.0


def iteration_time_uniform(
    schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float = 0.0
) -> float:
    """Iteration time of one pipeline for uniform stages and free communication.

    t_f, t_b: forward and full backward time of one micro-batch on one rank, summed over the rank's v
    stages (each stage takes t_f/v and t_b/v). t_w: the weight-gradient part of t_b; only zero-bubble
    runs it as its own pass (its input-gradient pass then takes t_b - t_w), the others ignore it.

    GPipe and 1F1B: (m + p - 1)(t_f + t_b) (Narayanan et al., SC21, sec. 2.2.1). Interleaved 1F1B:
    (m + (p-1)/v)(t_f + t_b) for m >= p (sec. 2.2.2, also for m not a multiple of p in torch's flexible
    order); for m < p torch's order takes (p + (m-1)/v)(t_f + t_b). Zero-bubble under its paper's
    assumption (Qi et al. 2024, sec. 6: per-stage F, B, W of equal length, here t_f = t_b - t_w = t_w)
    and m >= 3p/2: m(t_f + t_b) + (p-1) t_f/2, which is optimal since the last rank cannot start before
    p-1 stage forwards have run. Outside that assumption torch's ZBV order has no simple closed form and
    this returns the simulated uniform case. All derived from torch's orders and checked by the tests.
    """
    raise_if_refused(schedule, p, m, v)
    if min(t_f, t_b, t_w) < 0 or t_w > t_b:
        raise ValueError(f"need t_f >= 0 and 0 <= t_w <= t_b, got t_f={t_f}, t_b={t_b}, t_w={t_w}")
    if schedule in ("gpipe", "1f1b"):
        return (m + p - 1) * (t_f + t_b)
    if schedule == "interleaved-1f1b":
        return (max(m, p) + (min(m, p) - 1) / v) * (t_f + t_b)
    if t_f == t_b - t_w == t_w and m >= 3 * p // 2:
        return m * (t_f + t_b) + (p - 1) * t_f / 2
    n = 2 * p
    return simulate(schedule, p, m, 2, [t_f / 2] * n, [t_b / 2] * n, [t_w / 2] * n).iteration_time


@functools.lru_cache(maxsize=65536)  # a pure function of five ints, asked for every stage of every partition
def in_flight_microbatches(schedule: str, p: int, m: int, v: int, stage: int) -> int:
    """Peak number of micro-batches whose activations `stage` holds at once (forward run, backward not).

    The memory model multiplies it by the stage's activation bytes per micro-batch. GPipe: m (every
    forward before the first backward, Huang et al. 2019). 1F1B: min(p - s, m), the warm-up of stage s
    (Narayanan et al., SC21, sec. 2.2.1). Zero-bubble: min(2p - s, m), the same along the V (the
    activations count as held until the weight-gradient pass W has read them). Interleaved 1F1B: counted
    from torch's warm-up, (v-1)k + 2(p-1-r) forwards on rank r with k micro-batches per round, see
    `_interleaved_stage_peak`. Equal to the simulator's `peak_in_flight` (checked by the tests).
    """
    raise_if_refused(schedule, p, m, v)
    check_stage(p, v, stage)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    if schedule == "zero-bubble":
        return min(2 * p - stage, m)
    return _interleaved_stage_peak(p, m, v, stage)


@functools.lru_cache(maxsize=65536)
def rank_in_flight_microbatches(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Peak number of (stage, micro-batch) activation sets held at once by all of `rank`'s stages.

    With v stages per rank each holding 1/v of the rank's layers, the rank's activation memory at peak
    is this count times one stage's activations per micro-batch. Interleaved: the warm-up plus the first
    steady-state forward, min((v-1)k + 2(p-1-r) + 1, m*v) (torch _get_warmup_ops; Narayanan et al.
    sec. 2.2.2). Zero-bubble: min(2p, m + r + 1, 2m), so 2p half-rank stage activations once m >= 2p - 1,
    the p full-rank ones rank 0 of 1F1B holds, on every rank (derived from torch's ZBV order).
    """
    raise_if_refused(schedule, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} out of range for p = {p}")
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule == "zero-bubble":
        return min(2 * p, m + rank + 1, 2 * m)
    return min(_interleaved_warmup(p, m, v, rank) + 1, m * v)


@functools.lru_cache(maxsize=4096)
def rank_stage_counts(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """The micro-batches each of `rank`'s stages (in stage order) holds at the instants that can be the rank's
    activation peak: its memory is max over these c of sum_j c_j a_j, with a_j stage j's activations per
    micro-batch, exactly (the counts come from the schedule's order, as `rank_in_flight_microbatches`'s).

    The stages of a rank do not peak together and do not hold the same: interleaved, the last rank's first
    stage holds k + 1 micro-batches while its last (the head and the loss) holds one, so counting the rank
    as its in-flight total times its largest stage (k + 2 times the loss's logits) overstates it by the
    loss's memory k + 1 times over. Only the instants after a forward can be a peak; of those, the counts
    no other instant's counts exceed (or equal) in every stage, and of a run of such counts on one line only
    its two ends (a linear function is largest at an end): a few vectors per rank. One stage per rank: its
    own in-flight count."""
    raise_if_refused(schedule, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} out of range for p = {p}")
    if v == 1:
        return ((in_flight_microbatches(schedule, p, m, 1, rank),),)
    if schedule == "interleaved-1f1b":
        k = m // max(1, m // p)
        w = _interleaved_warmup(p, m, v, rank)
        return _interleaved_counts(k, v, w, min(m * v, w + k * v + 1))
    # zero-bubble (ZBV): past its warm-up each micro-batch repeats the same counts, so every m above 2p has the
    # instants of m = 2p (the test walks both)
    return _walked_counts(schedule, p, min(m, 2 * p) if schedule == "zero-bubble" else m, v, rank)


@functools.lru_cache(maxsize=4096)
def _walked_counts(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple[int, ...], ...]:
    return tuple(_line_ends(_undominated(_walked_instants(schedule, p, m, v, rank))))


def _walked_instants(schedule: str, p: int, m: int, v: int, rank: int) -> set[tuple[int, ...]]:
    """The rank's stage counts after each of its forwards, along its order (`simulate.rank_order`)."""
    acts = rank_order(schedule, p, m, v, rank)
    mine = sorted({s for _, s, _ in acts})
    where = {s: j for j, s in enumerate(mine)}
    release = W if schedule == "zero-bubble" else B
    count = [0] * len(mine)
    seen: set[tuple[int, ...]] = set()
    for kind, s, _ in acts:
        if kind == F:
            count[where[s]] += 1
            seen.add(tuple(count))
        elif kind == release:
            count[where[s]] -= 1
    return seen


@functools.lru_cache(maxsize=4096)
def _interleaved_counts(k: int, v: int, w: int, end: int) -> tuple[tuple[int, ...], ...]:
    """`rank_stage_counts` of torch's interleaved order with k micro-batches per round and warm-up w, from its
    steps before `end`. Step i runs a forward on chunk (i // k) % v (i < m v), then from the warm-up on a
    backward on chunk v - 1 - ((i - w) // k) % v: between two window changes (i or i - w crossing a multiple of
    k) every chunk's count moves by the same step each step, so a weighted sum of them is largest at an end of
    that run. From the warm-up on, each chunk gains k forwards and loses k backwards every k v steps: the counts
    repeat with that period, so the steps before w + k v hold every instant there is (end: that or m v; the
    counts depend on m through nothing else, and many m share them)."""
    bases = np.arange(0, end + k, k)
    i = np.unique(np.concatenate([[0, end - 1], *(b + d for b in (bases, w + bases) for d in (-1, 0, 1))]))
    i = i[(i >= 0) & (i < end)]
    j = np.arange(v)
    fwd = _windows_counts(i[:, None] + 1, k, v, j[None, :])
    bwd = _windows_counts(i[:, None] - w, k, v, v - 1 - j[None, :])
    seen = set(map(tuple, (fwd - bwd).tolist()))
    return tuple(_line_ends(_undominated(seen)))


def _windows_counts(n: IntArray, k: int, v: int, j: IntArray) -> IntArray:
    """`_windows_count` elementwise over arrays n and j."""
    full, rest = np.divmod(np.maximum(n, 0), k * v)
    out: IntArray = full * k + np.clip(rest - j * k, 0, k)
    return out


def _undominated(points: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The points no other point reaches in every coordinate, sorted. Two coordinates: a staircase, one pass in
    decreasing order; more: every pair compared at once."""
    kept: list[tuple[int, ...]] = []
    if points and len(next(iter(points))) == 2:  # a staircase: in that order, each kept point raises the second
        top = None
        for c in sorted(points, reverse=True):
            if top is None or c[1] > top:
                kept.append(c)
                top = c[1]
        return sorted(kept)
    pts = np.array(sorted(points), dtype=np.int64).reshape(len(points), -1)
    covers = (pts[:, None, :] >= pts[None, :, :]).all(axis=2)  # [j, i]: j reaches i in every coordinate
    alone = covers.sum(axis=0) == 1  # only i itself (the points are distinct)
    return [tuple(int(x) for x in row) for row in pts[alone].tolist()]


def _line_ends(points: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """`points` (sorted) without those lying between their neighbours on one straight line."""
    out: list[tuple[int, ...]] = []
    for q in points:
        while len(out) >= 2 and _between(out[-2], out[-1], q):
            out.pop()
        out.append(q)
    return out


def _between(a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...]) -> bool:
    """Whether b lies on the segment from a to c."""
    d, e = [y - x for x, y in zip(a, c)], [y - x for x, y in zip(a, b)]
    n = next((i for i, x in enumerate(d) if x), None)
    if n is None:
        return False
    t = e[n] / d[n]
    return 0 <= t <= 1 and all(e[i] * d[n] == d[i] * e[n] for i in range(len(d)))


def rank_peak_activations(schedule: str, p: int, m: int, v: int, rank: int, per_mb: list[float]) -> float:
    """The rank's peak activation bytes, `per_mb` its stages' activations per micro-batch in stage order
    (`rank_stage_counts`)."""
    counts = rank_stage_counts(schedule, p, m, v, rank)
    if len(per_mb) != len(counts[0]):
        raise ValueError(f"rank {rank} holds {len(counts[0])} stages, got activations of {len(per_mb)}")
    return max(sum(c * a for c, a in zip(cs, per_mb, strict=True)) for cs in counts)


def _interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    # torch _get_warmup_ops: (v-1) rounds of k micro-batches for the last rank, two more per hop back.
    k = m // max(1, m // p)
    return min((v - 1) * k + 2 * (p - 1 - rank), m * v)


def _windows_count(n: int, k: int, v: int, j: int) -> int:
    """How many t in [0, n) fall in window j, windows of length k cycling over v slots."""
    if n <= 0:
        return 0
    full, rest = divmod(n, k * v)
    return full * k + min(max(rest - j * k, 0), k)


def _interleaved_stage_peak(p: int, m: int, v: int, stage: int) -> int:
    """Peak activations of one interleaved stage, from torch's step pattern.

    Rank r runs step i as: forward on local chunk (i // k) % v, then (once i >= warm-up w) backward on
    chunk v-1 - ((i - w) // k) % v, with k micro-batches per round. Chunk c's count of forwards minus
    finished backwards only grows inside its forward windows, so its peak is at the end of one of them: of
    the last. From one window's end to the next (v k steps, one whole cycle of the backward windows) the
    chunk runs k more forwards and at most k more backwards (exactly k once its backwards have started), so
    the count at the windows' ends never falls.
    """
    rounds = max(1, m // p)
    k = m // rounds
    chunk, rank = divmod(stage, p)
    warm = _interleaved_warmup(p, m, v, rank)
    last_fwd = ((rounds - 1) * v + chunk + 1) * k - 1  # step of the last window's last forward on the chunk
    return rounds * k - _windows_count(last_fwd - warm, k, v, v - 1 - chunk)
