"""Pipeline stage placement and the rules torch imposes on a schedule (a leaf of planner.cost).

Both the closed forms (`planner.cost.schedules`) and the discrete-event simulator
(`planner.cost.simulate`) build on these, so neither imports the other for them.
"""

from __future__ import annotations

import functools

from planner.names import SCHEDULES


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
                f"interleaved-1f1b needs m to be a multiple of the number of rounds max(1, m // p) = "
                f"{rounds} (torch ScheduleInterleaved1F1B), got m = {m}, p = {p}; use a multiple of p"
            )
    if schedule == "zero-bubble" and v != 2:
        return f"zero-bubble (ZBV) places exactly two stages per rank in a V: v must be 2, got {v}"
    return None


@functools.lru_cache(maxsize=65536)  # a pure function of its arguments, asked for every stage evaluated
def stage_rank(schedule: str, p: int, v: int, stage: int) -> int:
    """The pipeline rank that runs `stage`.

    Loop placement (stage s on rank s % p) for every schedule but zero-bubble, whose V places stage s on
    rank s for s < p and on rank 2p-1-s after (torch generate_stage_to_rank_mapping, style "loop"/"v").
    """
    from planner.runtime.layout import stage_rank as runtime_stage_rank  # the generated script's placement

    _check_name(schedule)
    check_stage(p, v, stage)
    return runtime_stage_rank(schedule, p, stage)


def check_stage(p: int, v: int, stage: int) -> None:
    if not 0 <= stage < p * v:
        raise ValueError(f"stage {stage} out of range for p = {p}, v = {v} ({p * v} stages)")


def raise_if_refused(schedule: str, p: int, m: int, v: int) -> None:
    violation = schedule_violation(schedule, p, m, v)
    if violation:
        raise ValueError(violation)
