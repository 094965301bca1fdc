"""The pipeline simulator against torch's orders, the closed forms, and invariants any schedule obeys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.cost.schedules import (
    bubble_fraction,
    in_flight_microbatches,
    iteration_time_uniform,
    rank_in_flight_microbatches,
    rank_peak_activations,
    rank_stage_counts,
    schedule_violation,
    stage_rank,
)
from planner.cost.simulate import B, F, W, rank_actions, simulate

REL = 1e-9

times = st.floats(0.01, 5.0, allow_nan=False, allow_infinity=False)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-12)


def _valid(schedule: str, p: int, m: int, v: int) -> bool:
    return schedule_violation(schedule, p, m, v) is None


@st.composite
def configs(draw, schedules=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"), max_p=8, max_m=24):
    schedule = draw(st.sampled_from(schedules))
    p = draw(st.integers(1, max_p))
    v = {"gpipe": 1, "1f1b": 1, "zero-bubble": 2}.get(schedule) or draw(st.integers(2, 4))
    m = draw(st.integers(1, max_m))
    assume(_valid(schedule, p, m, v))
    return schedule, p, m, v


# --- the orders are torch's ------------------------------------------------------------------------------


def _torch_orders(pipelining, schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    kind = {
        pipelining._ComputationType.FORWARD: F,
        pipelining._ComputationType.FULL_BACKWARD: B,
        pipelining._ComputationType.BACKWARD_INPUT: B,
        pipelining._ComputationType.BACKWARD_WEIGHT: W,
    }
    out = []
    for r in range(p):
        # The order methods only read these attributes, so no process group is needed.
        if schedule == "gpipe":
            fake = SimpleNamespace(_num_stages=p, _n_microbatches=m)
            ops = pipelining.ScheduleGPipe._get_pipeline_order(fake)[r]
        elif schedule == "interleaved-1f1b":
            fake = SimpleNamespace(
                n_local_stages=v,
                microbatches_per_round=m // max(1, m // p),
                pp_group_size=p,
                _n_microbatches=m,
            )
            ops = pipelining.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r)
        else:
            fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            ops = pipelining.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r)
        out.append(
            [
                (kind[a.computation_type], a.stage_index, a.microbatch_index)
                for a in ops
                if a is not None and a.computation_type in kind
            ]
        )
    return out


TORCH_CASES = [("gpipe", [1]), ("interleaved-1f1b", [2, 3, 4]), ("zero-bubble", [2])]


@pytest.mark.parametrize("schedule,vs", TORCH_CASES)
def test_orders_match_torch(schedule, vs):
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    for p in range(1, 9):
        for m in range(1, 33):
            for v in vs:
                if _valid(schedule, p, m, v):
                    expected = _torch_orders(pipelining, schedule, p, m, v)
                    assert rank_actions(schedule, p, m, v) == expected, (p, m, v)


def test_1f1b_order_is_torch_runtime_order():
    # Schedule1F1B._step_microbatches: min(m, p - s) forwards, then B/F alternating, then the rest of B.
    names = [" ".join(f"{'FBW'[k]}{j}" for k, _, j in acts) for acts in rank_actions("1f1b", 3, 5)]
    assert names == [
        "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4",
    ]


@given(configs())
def test_every_action_once(cfg):
    schedule, p, m, v = cfg
    orders = rank_actions(schedule, p, m, v)
    kinds = (F, B, W) if schedule == "zero-bubble" else (F, B)
    expected = sorted((k, s, j) for k in kinds for s in range(p * v) for j in range(m))
    assert sorted(a for acts in orders for a in acts) == expected
    for r, acts in enumerate(orders):
        assert all(stage_rank(schedule, p, v, s) == r for _, s, _ in acts)


# --- closed forms ---------------------------------------------------------------------------------------


@settings(max_examples=300)
@given(configs(("gpipe", "1f1b", "interleaved-1f1b"), max_p=12, max_m=40), times, times)
def test_uniform_matches_closed_form(cfg, t_f, t_b):
    schedule, p, m, v = cfg
    n = p * v
    sim = simulate(schedule, p, m, v, [t_f / v] * n, [t_b / v] * n)
    assert _close(sim.iteration_time, iteration_time_uniform(schedule, p, m, v, t_f, t_b))
    assert _close(sim.bubble_ratio, bubble_fraction(schedule, p, m, v))


def test_closed_forms_of_the_papers():
    # Narayanan et al.: (p-1)/m, (p-1)/(v m); GPipe/1F1B (m + p - 1)(t_f + t_b).
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("gpipe", 4, 2) == pytest.approx(3 / 2)
    assert bubble_fraction("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("interleaved-1f1b", 4, 10, 2) == pytest.approx(3 / 20)  # flexible rounds
    assert iteration_time_uniform("1f1b", 4, 8, 1, 1.0, 2.0) == pytest.approx(33.0)
    assert iteration_time_uniform("interleaved-1f1b", 4, 8, 2, 1.0, 2.0) == pytest.approx((8 + 1.5) * 3)
    assert bubble_fraction("zero-bubble", 4, 8, 2) == pytest.approx(3 / 48)


@settings(max_examples=100)
@given(st.integers(1, 24), st.integers(0, 60), times)
def test_zero_bubble_closed_form(p, extra, t):
    # Paper's assumption: per-stage F = B = W (per rank t_f = t, t_b = 2t, t_w = t), m >= 3p/2.
    m = 3 * p // 2 + extra
    n = 2 * p
    sim = simulate("zero-bubble", p, m, 2, [t / 2] * n, [t] * n, [t / 2] * n)
    closed = iteration_time_uniform("zero-bubble", p, m, 2, t, 2 * t, t)
    assert _close(sim.iteration_time, closed)
    assert _close(closed, m * 3 * t + (p - 1) * t / 2)
    # Optimal: the last rank starts after p - 1 stage forwards and then never idles.
    assert sim.busy[p - 1] == pytest.approx(sim.iteration_time - (p - 1) * t / 2)


@given(configs(max_p=6, max_m=16), times, times, st.floats(0.0, 1.0))
def test_zero_bubble_general_case_is_simulated(cfg, t_f, t_b, w_share):
    _, p, m, _ = cfg
    t_w = t_b * w_share
    n = 2 * p
    sim = simulate("zero-bubble", p, m, 2, [t_f / 2] * n, [t_b / 2] * n, [t_w / 2] * n)
    assert _close(iteration_time_uniform("zero-bubble", p, m, 2, t_f, t_b, t_w), sim.iteration_time)


@settings(max_examples=300)
@given(configs(max_p=10, max_m=40))
def test_in_flight_closed_forms(cfg):
    schedule, p, m, v = cfg
    n = p * v
    sim = simulate(schedule, p, m, v, [1.0] * n, [2.0] * n)
    assert sim.peak_in_flight == [in_flight_microbatches(schedule, p, m, v, s) for s in range(n)]
    assert sim.rank_peak_in_flight == [rank_in_flight_microbatches(schedule, p, m, v, r) for r in range(p)]
    if schedule == "1f1b":
        assert sim.peak_in_flight == [min(p - s, m) for s in range(p)]
    if schedule == "gpipe":
        assert sim.peak_in_flight == [m] * p


@settings(max_examples=300)
@given(configs(max_p=10, max_m=40), st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=4, max_size=4))
def test_rank_peak_activations_is_the_largest_instant_of_the_order(cfg, per_mb):
    # Walk each rank's order: after every forward, the held micro-batches of each stage times its bytes per
    # micro-batch; the largest such sum is the rank's peak, which the few counted instants must give exactly.
    schedule, p, m, v = cfg
    release = W if schedule == "zero-bubble" else B
    for r, acts in enumerate(rank_actions(schedule, p, m, v)):
        mine = sorted({s for _, s, _ in acts})
        held = dict.fromkeys(mine, 0)
        want = 0.0
        for kind, s, _ in acts:
            if kind == F:
                held[s] += 1
                want = max(want, sum(held[x] * per_mb[j] for j, x in enumerate(mine)))
            elif kind == release:
                held[s] -= 1
        got = rank_peak_activations(schedule, p, m, v, r, per_mb[: len(mine)])
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
        counts = rank_stage_counts(schedule, p, m, v, r)
        assert max(sum(c) for c in counts) == rank_in_flight_microbatches(schedule, p, m, v, r)


def test_interleaved_instants_at_window_ends_equal_the_walked_order():
    # rank_stage_counts reads torch's interleaved order only at the steps where a window changes, and only over
    # one period after the warm-up; walking every step of the order must give the same counts.
    from planner.cost.schedules import _line_ends, _undominated, _walked_instants

    checked = 0
    for p in (1, 2, 3, 4, 5, 8):
        for m in range(1, 49):
            for v in (2, 3, 4):
                if schedule_violation("interleaved-1f1b", p, m, v):
                    continue
                for r in range(p):
                    walked = tuple(_line_ends(_undominated(_walked_instants("interleaved-1f1b", p, m, v, r))))
                    assert rank_stage_counts("interleaved-1f1b", p, m, v, r) == walked, (p, m, v, r)
                    checked += 1
    assert checked > 1000


def test_zero_bubble_instants_above_2p_micro_batches_equal_the_walked_order():
    # rank_stage_counts reads ZBV's order at 2p micro-batches for any m above (each later micro-batch repeats the
    # counts of the one before); walking the whole order must give the same.
    from planner.cost.schedules import _line_ends, _undominated, _walked_instants

    checked = 0
    for p in (1, 2, 3, 4, 6, 8):
        for m in range(1, 5 * p + 3):
            if schedule_violation("zero-bubble", p, m, 2):
                continue
            for r in range(p):
                walked = tuple(_line_ends(_undominated(_walked_instants("zero-bubble", p, m, 2, r))))
                assert rank_stage_counts("zero-bubble", p, m, 2, r) == walked, (p, m, r)
                checked += 1
    assert checked > 300


def test_rank_peak_activations_of_the_last_interleaved_rank_holds_the_loss_once():
    # Interleaved, p 16, v 2, 64 micro-batches: the last rank's first stage holds up to 17 micro-batches, its
    # last stage (the head and the loss) one. 17 x the largest stage would count the loss 17 times.
    assert rank_stage_counts("interleaved-1f1b", 16, 64, 2, 15) == ((16, 1), (17, 0))
    assert rank_peak_activations("interleaved-1f1b", 16, 64, 2, 15, [1.0, 100.0]) == 116.0
    with pytest.raises(ValueError, match="holds 2 stages"):
        rank_peak_activations("interleaved-1f1b", 16, 64, 2, 15, [1.0])


@given(configs(max_p=6, max_m=16), st.lists(times, min_size=48, max_size=48))
def test_in_flight_does_not_depend_on_timing(cfg, ts):
    # A rank runs its actions one by one in a fixed order, so the high-water mark is a property of the order.
    schedule, p, m, v = cfg
    n = p * v
    sim = simulate(schedule, p, m, v, ts[:n], ts[24 : 24 + n], p2p=ts[-1])
    assert sim.peak_in_flight == [in_flight_microbatches(schedule, p, m, v, s) for s in range(n)]


@given(configs(("gpipe", "1f1b", "interleaved-1f1b"), max_p=10, max_m=30), times, times)
def test_bubble_shrinks_as_m_grows(cfg, t_f, t_b):
    schedule, p, m, v = cfg
    nxt = next((k for k in range(m + 1, 4 * m + 4) if _valid(schedule, p, k, v)), None)
    assume(nxt is not None)
    n = p * v
    small = simulate(schedule, p, m, v, [t_f] * n, [t_b] * n)
    large = simulate(schedule, p, nxt, v, [t_f] * n, [t_b] * n)
    assert large.bubble_fraction <= small.bubble_fraction + 1e-12
    assert bubble_fraction(schedule, p, nxt, v) <= bubble_fraction(schedule, p, m, v) + 1e-12


# --- invariants for any stage times ----------------------------------------------------------------------


@st.composite
def uneven(draw, schedules=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")):
    schedule, p, m, v = draw(configs(schedules, max_p=6, max_m=14))
    n = p * v
    fwd = draw(st.lists(times, min_size=n, max_size=n))
    bwd = draw(st.lists(times, min_size=n, max_size=n))
    share = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    p2p = draw(st.lists(st.floats(0.0, 2.0), min_size=max(n - 1, 0), max_size=max(n - 1, 0)))
    return schedule, p, m, v, fwd, bwd, [b * x for b, x in zip(bwd, share, strict=True)], p2p


@settings(max_examples=200)
@given(uneven())
def test_events_respect_dependencies_and_start_asap(case):
    schedule, p, m, v, fwd, bwd, wgt, p2p = case
    sim = simulate(schedule, p, m, v, fwd, bwd, wgt, p2p)
    split = schedule == "zero-bubble"
    n = p * v
    end = {(e.kind, e.stage, e.microbatch): e.end for e in sim.events}
    rank_free = [0.0] * p
    for e in sim.events:  # rank by rank, each in order
        s, j = e.stage, e.microbatch
        hop = 0.0
        if e.kind == "F":
            ready = 0.0
            if s > 0:
                hop = p2p[s - 1] if sim.stage_ranks[s - 1] != e.rank else 0.0
                ready = end[("F", s - 1, j)] + hop
            length = fwd[s]
        elif e.kind == "B":
            if s == n - 1:
                ready = end[("F", s, j)]
            else:
                hop = p2p[s] if sim.stage_ranks[s + 1] != e.rank else 0.0
                ready = max(end[("B", s + 1, j)] + hop, end[("F", s, j)])
            length = bwd[s] - wgt[s] if split else bwd[s]
        else:
            ready = end[("B", s, j)]
            length = wgt[s]
        assert e.end - e.start == pytest.approx(length, abs=1e-9)
        # Starts as soon as both its rank and its input are free: no invented idle time.
        assert e.start == pytest.approx(max(ready, rank_free[e.rank]), abs=1e-9)
        rank_free[e.rank] = e.end
    assert sim.iteration_time == pytest.approx(max(rank_free))
    assert sim.busy == pytest.approx(
        [sum(e.end - e.start for e in sim.events if e.rank == r) for r in range(p)], abs=1e-9
    )
    assert sim.bubble_fraction == pytest.approx(1 - sum(sim.busy) / p / sim.iteration_time)


@settings(max_examples=200)
@given(uneven())
def test_lower_bounds(case):
    schedule, p, m, v, fwd, bwd, wgt, p2p = case
    sim = simulate(schedule, p, m, v, fwd, bwd, wgt, p2p)
    n = p * v
    ranks = sim.stage_ranks
    hops = [p2p[s] if ranks[s] != ranks[s + 1] else 0.0 for s in range(n - 1)]
    split = schedule == "zero-bubble"
    b_in = [b - w for b, w in zip(bwd, wgt, strict=True)] if split else bwd
    eps = 1e-9 * sim.iteration_time
    # No rank can do more than the iteration.
    assert sim.iteration_time >= max(sim.busy) - eps
    # One micro-batch must go forward through every stage and its gradient all the way back.
    assert sim.iteration_time >= sum(fwd) + sum(b_in) + 2 * sum(hops) - eps
    for s in range(n):
        before = sum(fwd[:s]) + sum(hops[:s])
        # Stage s starts no earlier than micro-batch 0 reaches it, then runs all its work in turn ...
        assert sim.iteration_time >= before + m * (fwd[s] + bwd[s]) - eps
        if not split:
            # ... and its last backward still has to travel back to stage 0.
            assert sim.iteration_time >= before + m * (fwd[s] + bwd[s]) + sum(bwd[:s]) + sum(hops[:s]) - eps


@settings(max_examples=200)
@given(uneven(("gpipe",)))
def test_gpipe_exact_for_uneven_stages(case):
    # Fill then drain are two flow shops of m identical jobs (each path crosses every hop once):
    # sum(f) + (m-1) max(f) + sum(b) + (m-1) max(b) + 2 sum(p2p).
    _, p, m, v, fwd, bwd, wgt, p2p = case
    sim = simulate("gpipe", p, m, v, fwd, bwd, wgt, p2p)
    expected = sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd) + 2 * sum(p2p)
    assert _close(sim.iteration_time, expected)


def test_1f1b_max_stage_bound_is_not_an_invariant():
    # (m-1) max_s t_s + sum_s t_s is GPipe-like; 1F1B hides the light stages behind the heavy one's warm-up.
    p, m = 2, 8
    sim = simulate("1f1b", p, m, 1, [10.0, 1.0], [10.0, 1.0])
    assert sim.iteration_time == pytest.approx(20.0 * m)
    assert sim.iteration_time < (m - 1) * 20.0 + 22.0


@settings(max_examples=200)
@given(uneven(), st.integers(0, 40), st.floats(0.0, 3.0))
def test_monotone_in_every_duration(case, which, extra):
    # Fixed orders make every start time a max-plus expression of the durations: nothing gets faster.
    schedule, p, m, v, fwd, bwd, wgt, p2p = case
    base = simulate(schedule, p, m, v, fwd, bwd, wgt, p2p).iteration_time
    n = p * v
    fwd2, bwd2, p2p2 = list(fwd), list(bwd), list(p2p)
    slot = which % (2 * n + len(p2p))
    if slot < n:
        fwd2[slot] += extra
    elif slot < 2 * n:
        bwd2[slot - n] += extra
    else:
        p2p2[slot - 2 * n] += extra
    assert simulate(schedule, p, m, v, fwd2, bwd2, wgt, p2p2).iteration_time >= base - 1e-9 * base


@given(configs(("1f1b", "gpipe"), max_p=8, max_m=24), times, times, st.floats(0.0, 2.0))
def test_p2p_costs_at_least_the_round_trip(cfg, t_f, t_b, d):
    # With uniform stages the zero-p2p critical path runs micro-batch 0 forward through every stage and the
    # last one back: it crosses 2(p-1) links, so each adds at least d.
    schedule, p, m, v = cfg
    free = simulate(schedule, p, m, v, [t_f] * p, [t_b] * p).iteration_time
    paid = simulate(schedule, p, m, v, [t_f] * p, [t_b] * p, p2p=d).iteration_time
    assert paid >= free + 2 * (p - 1) * d - 1e-9 * paid


@settings(max_examples=200)
@given(st.integers(1, 8), st.integers(0, 30), times, times, st.floats(0.0, 1.0))
def test_zero_bubble_not_slower_than_1f1b(p, extra, t_f, t_b, w_share):
    # Same work per rank (two half-size stages in the V vs one stage), m >= 2p, uniform stages.
    m = 2 * p + extra
    t_w = t_b * w_share
    n = 2 * p
    zbv = simulate("zero-bubble", p, m, 2, [t_f / 2] * n, [t_b / 2] * n, [t_w / 2] * n)
    one = simulate("1f1b", p, m, 1, [t_f] * p, [t_b] * p)
    assert zbv.iteration_time <= one.iteration_time * (1 + REL)


def test_zero_bubble_default_split_is_half():
    half = simulate("zero-bubble", 3, 8, 2, [1.0] * 6, [2.0] * 6)
    explicit = simulate("zero-bubble", 3, 8, 2, [1.0] * 6, [2.0] * 6, [1.0] * 6)
    assert half.iteration_time == explicit.iteration_time
    assert half.events == explicit.events


def test_p2p_only_between_ranks():
    # Stages p-1 and p of the V share a rank: their link costs nothing.
    p = 3
    links = [0.0] * 5
    links[p - 1] = 100.0
    sim = simulate("zero-bubble", p, 6, 2, [1.0] * 6, [2.0] * 6, p2p=links)
    assert sim.iteration_time == simulate("zero-bubble", p, 6, 2, [1.0] * 6, [2.0] * 6).iteration_time
    assert sim.transfers == []
    sim = simulate("1f1b", 2, 2, 1, [1.0, 1.0], [1.0, 1.0], p2p=0.5)
    assert [(t.src_rank, t.dst_rank, t.kind) for t in sim.transfers] == [
        (0, 1, "F"),
        (0, 1, "F"),
        (1, 0, "B"),
        (1, 0, "B"),
    ]


def test_deterministic():
    args = ("interleaved-1f1b", 4, 8, 2, [1.0, 2.0] * 4, [2.0, 3.0] * 4, None, [0.1] * 7)
    assert simulate(*args).events == simulate(*args).events


def test_large_schedule_matches_the_closed_form():
    """64 ranks x 2 stages, 512 micro-batches, free communication: the event simulation reproduces the
    interleaved closed form (its speed is measured by bench/search_speed.py, not asserted here)."""
    n = 128
    sim = simulate("interleaved-1f1b", 64, 512, 2, [1.0] * n, [2.0] * n)
    assert sim.iteration_time == pytest.approx(iteration_time_uniform("interleaved-1f1b", 64, 512, 2, 2.0, 4.0))


@pytest.mark.parametrize(
    "args,match",
    [
        (("pipedream", 2, 4, 1), "unknown pipeline schedule"),
        (("1f1b", 4, 2, 1), "at least as many micro-batches"),
        (("1f1b", 4, 8, 2), "one stage per rank"),
        (("interleaved-1f1b", 4, 9, 2), "multiple of the number of rounds"),
        (("interleaved-1f1b", 4, 8, 1), "v >= 2"),
        (("zero-bubble", 4, 8, 3), "exactly two stages"),
    ],
)
def test_refused_configurations(args, match):
    schedule, p, m, v = args
    with pytest.raises(ValueError, match=match):
        simulate(schedule, p, m, v, [1.0] * (p * v), [1.0] * (p * v))
    with pytest.raises(ValueError, match=match):
        iteration_time_uniform(schedule, p, m, v, 1.0, 1.0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="one per pipeline stage"):
        simulate("1f1b", 2, 4, 1, [1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite times"):
        simulate("1f1b", 2, 4, 1, [1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="stage boundary"):
        simulate("1f1b", 2, 4, 1, [1.0, 1.0], [1.0, 1.0], p2p=[0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match="cannot exceed"):
        simulate("zero-bubble", 1, 4, 2, [1.0, 1.0], [1.0, 1.0], [2.0, 0.0])
