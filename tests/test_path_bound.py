"""The longest-path bound on the simulated pipeline (`planner.search.pathbound`): valid for every partition
that fits memory (checked against brute force on random small instances), its paths are paths of the
simulated schedule, its oracles are exact, and its game solver is optimal."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from test_reported_exact import _partitions, instance
from test_search_exact import full_space

from planner.cost.model import CostOptions
from planner.cost.simulate import simulate
from planner.cost.terms import rank_capacity
from planner.search.bounds import lower_bounds, tail_bound
from planner.search.evaluate import evaluate, simulated_time
from planner.search.pathbound import CountOracle, IntervalOracle, pipeline_bound, solve_game
from planner.search.problem import PartitionProblem
from planner.search.search import CostTable, search_modes

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2))


def _least(graph, cluster, cand, costs, modes):
    """(least simulated pipeline time, least reported figure) over every partition and recomputation that
    fits the search's capacity, or None."""
    cap = rank_capacity(cluster, cand)
    if cand.virtual_stages > 1:
        choices = [(mode,) * cand.stages for mode in modes]
    else:
        choices = list(itertools.product(modes, repeat=cand.stages))
    best = None
    for part in _partitions(len(graph.units), cand.stages):
        for rec in choices:
            ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=CostOptions()), part, list(rec))
            if max(ev.rank_memory.values()) > cap:
                continue
            pair = (simulated_time(ev), ev.reported)
            best = pair if best is None else (min(best[0], pair[0]), min(best[1], pair[1]))
    return best


@pytest.mark.parametrize("chunk", range(2))
def test_the_path_bound_is_valid_for_every_partition(chunk):
    """On random small instances (transformer-shaped: the count form's oracle with block_bound's memory
    caps; or not: the interval form's), the bound never exceeds the least simulated pipeline time, and
    with the tail bound never the least reported figure; it is often close to it."""
    options = CostOptions()
    checked = close = 0
    for seed in range(2000 + chunk, 2060, 2):
        graph, cluster, batch, pin_dp = instance(seed)
        table = CostTable(graph, cluster, None)
        modes = search_modes(graph)
        for cand in full_space(graph, cluster, batch, pin_dp):
            if cand.stages == 1:
                continue
            cm = tuple(m for m in modes if not (cand.schedule == "zero-bubble" and m == "selective"))
            costs = table.units(cand)
            least = _least(graph, cluster, cand, costs, cm)
            if least is None:
                continue
            pb = PartitionProblem(graph, cluster, cand, costs, cm, options)
            tail = tail_bound(pb)
            b = lower_bounds(pb, True, tail)
            assert b.feasible
            pipe = pipeline_bound(pb, b.block or b.interval, None)
            assert pipe <= least[0] * (1 + 1e-9), (seed, cand, pipe, least)
            assert pipe + tail <= least[1] * (1 + 1e-9), (seed, cand, pipe + tail, least)
            checked += 1
            close += pipe >= 0.95 * least[0]
    assert checked > 50 and close > checked // 4, (checked, close)


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
def test_rank_paths_are_paths_of_the_schedule(schedule, v):
    """Every rank path is at most the simulated time for its own durations and for any others (it is a path
    of the DAG), and the longest is the simulated time."""
    rnd = random.Random(3)
    zb = schedule == "zero-bubble"

    def draw(n):
        times = [rnd.random() for _ in range(2 * n)]
        return times[:n], times[n:], [rnd.random() / 5 for _ in range(n - 1)]

    def length(pc, f, b, link):
        half = 0.5 if zb else 1.0
        stages = sum(pc.fwd[s] * f[s] + (pc.bwd[s] * half + pc.wgt[s] * 0.5) * b[s] for s in range(len(f)))
        return stages + sum(c * x for c, x in zip(pc.links, link, strict=True))

    for _ in range(150):
        p = rnd.randint(1, 4)
        m = p * rnd.randint(1, 2) if schedule == "interleaved-1f1b" else rnd.randint(max(1, p), 8)
        f, b, link = draw(p * v)
        sim = simulate(schedule, p, m, v, f, b, None, link)
        paths = sim.rank_paths()
        assert len(paths) == p

        assert max(length(pc, f, b, link) for pc in paths) == pytest.approx(sim.iteration_time, rel=1e-12)
        f2, b2, link2 = draw(p * v)
        other = simulate(schedule, p, m, v, f2, b2, None, link2).iteration_time
        assert all(length(pc, f2, b2, link2) <= other * (1 + 1e-12) for pc in paths)


def test_count_oracle_is_exact():
    """The greedy count oracle finds the least linear cost over every block count vector within the caps."""
    rnd = random.Random(5)
    for _ in range(300):
        S, L = rnd.randint(2, 4), rnd.randint(2, 7)
        ext = np.array([[rnd.random(), rnd.random()] if s in (0, S - 1) else [0.0, 0.0] for s in range(S)])
        lo = [0 if s in (0, S - 1) and rnd.random() < 0.5 else 1 for s in range(S)]
        cap = [rnd.choice([float("inf"), rnd.randint(1, L)]) for _ in range(S)]
        rank_of = [s % 2 for s in range(S)]
        rank_cap = [rnd.choice([float("inf"), rnd.randint(1, L)]) for _ in range(2)]
        oracle = CountOracle(ext, (rnd.random(), rnd.random()), lo, L, cap, rank_of, rank_cap)
        cf, cb = np.array([rnd.uniform(0, 3) for _ in range(S)]), np.array([rnd.uniform(0, 3) for _ in range(S)])
        best = None
        for n in itertools.product(range(L + 1), repeat=S):
            if sum(n) != L or any(n[s] < lo[s] or n[s] > cap[s] for s in range(S)):
                continue
            if any(sum(n[s] for s in range(S) if rank_of[s] == r) > rank_cap[r] for r in range(2)):
                continue
            x = oracle.features(np.array(n, dtype=float))
            value = float(cf @ x[:, 0] + cb @ x[:, 1])
            best = value if best is None else min(best, value)
        got = oracle.best(cf, cb)
        if best is None:
            assert got is None
        else:
            assert got is not None and got[0] == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_interval_oracle_is_exact():
    """The dynamic program finds the least linear cost over every contiguous partition (and the features of
    one that attains it)."""
    rnd = random.Random(6)
    for _ in range(200):
        U, S = rnd.randint(2, 7), rnd.randint(2, 4)
        if S > U:
            continue
        f, b = [rnd.random() for _ in range(U)], [rnd.random() for _ in range(U)]
        oracle = IntervalOracle(f, b, S, None)
        cf, cb = np.array([rnd.uniform(0, 3) for _ in range(S)]), np.array([rnd.uniform(0, 3) for _ in range(S)])
        best = min(
            sum(cf[s] * sum(f[u] for u in part[s]) + cb[s] * sum(b[u] for u in part[s]) for s in range(S))
            for part in _partitions(U, S)
        )
        got = oracle.best(cf, cb)
        assert got is not None and got[0] == pytest.approx(best, rel=1e-12)
        assert float(cf @ got[1][:, 0] + cb @ got[1][:, 1]) == pytest.approx(best, rel=1e-12)


def test_solve_game_is_optimal():
    """The row weights guarantee what the column weights concede: no duality gap, on either orientation."""
    rng = np.random.default_rng(0)
    for K, N in [(1, 1), (3, 5), (10, 4), (40, 12), (5, 30), (96, 24)]:
        for _ in range(10):
            M = rng.random((K, N)) * 10 - 3
            lam, y = solve_game(M)
            assert lam.min() >= 0 and y.min() >= 0
            assert lam.sum() == pytest.approx(1.0) and y.sum() == pytest.approx(1.0)
            low, high = float((lam @ M).min()), float((M @ y).max())
            assert low <= high + 1e-12
            assert high - low <= 1e-9 * max(1.0, abs(high))


def test_the_bound_is_remembered_by_its_whole_input(monkeypatch):
    """`path_bound` answers a second call with the same schedule, oracle, link and target from its memo (the
    ZeRO-1 and ZeRO-2 twins of one layout ask the same), without simulating; an oracle whose caps differ, or
    another target, is bounded afresh."""
    import planner.search.pathbound as pathbound

    sims = []
    real = pathbound.simulate

    def counted(*args, **kwargs):
        sims.append(args[:4])
        return real(*args, **kwargs)

    monkeypatch.setattr(pathbound, "simulate", counted)
    monkeypatch.setattr(pathbound, "_MEMO", {})

    def oracle(cap: float) -> CountOracle:
        return CountOracle(np.array([[1.0, 2.0], [0.0, 0.0], [0.5, 1.0]]), (1.0, 2.0), [1, 1, 1], 12,
                           [cap] * 3, [0, 1, 2], [np.inf] * 3)

    first = pathbound.path_bound("1f1b", 3, 6, 1, oracle(8), 0.1, None)
    n = len(sims)
    assert n >= 2 and first > 0
    assert pathbound.path_bound("1f1b", 3, 6, 1, oracle(8), 0.1, None) == first and len(sims) == n
    pathbound.path_bound("1f1b", 3, 6, 1, oracle(5), 0.1, None)
    assert len(sims) > n
    m = len(sims)
    pathbound.path_bound("1f1b", 3, 6, 1, oracle(8), 0.1, first / 2)
    assert len(sims) > m
