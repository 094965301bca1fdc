"""The outer search: bound every candidate, solve ILPs in order of their bounds, keep the top k.

A candidate's lower bound (bubble-free balanced compute plus the unavoidable optimizer step, and a
memory bound from the average model states per pipeline rank) is valid for every partition, so once the
bound of the next candidate exceeds the k-th best solved objective, no later candidate can enter the
top k and the search stops: the result is exact with respect to the cost model.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from planner.cost.memory import model_state_bytes_per_param
from planner.cost.model import (
    RECOMPUTE_MODES,
    Candidate,
    CostOptions,
    Profile,
    StageCost,
    UnitCost,
    dp_comm_time,
    dp_link,
    iteration_linear,
    optimizer_time,
    rank_memory,
    stage_costs,
    unit_cost,
)
from planner.cost.schedules import in_flight_microbatches
from planner.errors import InfeasibleError
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.search.ilp import solve_partition
from planner.search.space import Pins, enumerate_space

log = logging.getLogger(__name__)
GiB = 2**30


@dataclass
class Evaluated:
    cand: Candidate
    partition: list[list[int]]
    recompute: list[str]
    stages: list[StageCost]
    objective: float
    rank_memory: dict[int, float]
    status: str = "optimal"


@dataclass
class SearchResult:
    best: Evaluated
    ranked: list[Evaluated]
    rejected: Counter
    candidates: int
    pruned_by_bound: int
    ilps_solved: int
    seconds: float
    status: str = "optimal"
    gap: float = 0.0  # worst relative gap to the candidate's lower bound of an ILP stopped early


@dataclass
class _Bounds:
    time: float
    memory: float


@dataclass
class CostTable:
    """Unit costs per (tp, mbs, sp), computed once per distinct unit signature."""

    graph: ModelGraph
    cluster: ClusterSpec
    profile: Profile | None
    _by_sig: dict = field(default_factory=dict)

    def units(self, cand: Candidate) -> list[UnitCost]:
        key = (cand.tp, cand.mbs, cand.sp)
        out = []
        for u in self.graph.units:
            k = (u.signature, *key, u.name if u.kind != "block" else "")
            if k not in self._by_sig:
                self._by_sig[k] = unit_cost(u, cand, self.cluster, self.graph.source.dtype, self.profile)
            out.append(self._by_sig[k])
        return out


def evaluate(
    graph: ModelGraph,
    cluster: ClusterSpec,
    cand: Candidate,
    partition: list[list[int]],
    recompute: list[str],
    costs: list[UnitCost],
    options: CostOptions,
) -> Evaluated:
    """The cost model's figures for a fixed partition (what the ILP optimises, recomputed directly)."""
    stages = stage_costs(graph, cluster, cand, partition, recompute, costs, options)
    obj = iteration_linear(stages, cand, options, cluster, graph.source.dtype)
    return Evaluated(cand, partition, recompute, stages, obj, rank_memory(stages, cand, options))


def lower_bounds(
    costs: list[UnitCost], cand: Candidate, cluster: ClusterSpec, dtype: str, options: CostOptions
) -> _Bounds:
    """Valid lower bounds on the iteration time and on the busiest rank's memory of any partition.

    Time: stage times sum to at least the whole model's work W (cheapest recomputation) and, under
    ZeRO-3, to at least the sum of the weight gathers G; the largest is at least the mean. The tail is
    at least the mean over ranks of exposed gradient sync (sync minus one stage's backward per rank) plus
    the optimizer step. Memory: the busiest rank holds at least the mean of all ranks' bytes.
    """
    work = sum(c.fwd + min(c.bwd.values()) for c in costs)
    fwd = sum(c.fwd for c in costs)
    S, p, m = cand.stages, cand.pp, cand.m
    params = sum(c.params_local for c in costs)
    sync_one, gather_one = dp_comm_time(params, cand, cluster, dtype)
    if cand.dp > 1:
        # dp_comm_time pays its latency once; S stages pay it S times (lower bound: once per rank)
        _, lat = dp_link(cand, cluster)
        per_stage_lat = {0: 2, 1: 2, 2: cand.m + 1, 3: 1}[cand.zero] * (cand.dp - 1) * lat
        sync = sync_one + (p - 1) * per_stage_lat
    else:
        sync = 0.0
    work = max(work, gather_one)
    if cand.schedule in ("gpipe", "1f1b"):
        pipe = work + (m - 1) * work / S
    elif cand.schedule == "interleaved-1f1b":
        pipe = m * work / p + (p - 1) * work / S
    else:
        pipe = m * work / p + (p - 1) * fwd / S
    windows = sum(max(c.bwd.values()) for c in costs) if options.overlap_dp_comm else 0.0
    if cand.zero == 2:
        windows *= m
    tail = (max(0.0, sync - windows) + p * optimizer_time(params / p, cand, cluster, dtype)) / p
    state = model_state_bytes_per_param(dtype, cand.zero, cand.dp)
    states = params * (state.weights + state.gradients + state.optimizer)
    min_inflight = min(in_flight_microbatches(cand.schedule, p, m, cand.v, s) for s in range(S))
    acts = min_inflight * sum(min(c.act.values()) for c in costs)
    memory = (states + acts) / p * (1 + options.fragmentation) + options.workspace_bytes
    return _Bounds(pipe + tail, memory)


def search(
    graph: ModelGraph,
    cluster: ClusterSpec,
    global_batch: int,
    pins: Pins = Pins(),
    options: CostOptions = CostOptions(),
    profile: Profile | None = None,
    top_k: int = 5,
    time_limit: float | None = None,
    progress=None,
    max_nodes: int | None = 500,
) -> SearchResult:
    """Find the best configuration (and the next top_k) under the cost model."""
    t0 = time.perf_counter()
    space = enumerate_space(graph, cluster, global_batch, pins)
    rejected = Counter(space.rejected)
    if not space.candidates:
        reasons = "; ".join(f"{region}: {why} ({n})" for (region, why), n in sorted(rejected.items())[:6])
        raise InfeasibleError(
            f"No configuration of {cluster.world_size} GPUs satisfies the constraints: {reasons or 'none'}. "
            "Change the pinned degrees, the global batch size (make it divisible by the data-parallel degree) "
            "or the GPU count."
        )
    table = CostTable(graph, cluster, profile)
    dtype = graph.source.dtype
    cap = cluster.gpu.memory_bytes
    modes = (pins.recompute,) if pins.recompute else search_modes(graph)
    bounded: list[tuple[float, int, Candidate, list[UnitCost]]] = []
    smallest_need: tuple[float, Candidate] | None = None
    for i, cand in enumerate(space.candidates):
        costs = table.units(cand)
        if pins.recompute:
            costs = [_only(c, pins.recompute) for c in costs]
        b = lower_bounds(costs, cand, cluster, dtype, options)
        if b.memory > cap:
            rejected[(_region(cand), "out of memory even with full recomputation and perfect balance")] += 1
            if smallest_need is None or b.memory < smallest_need[0]:
                smallest_need = (b.memory, cand)
            continue
        bounded.append((b.time, i, cand, costs))
    bounded.sort(key=lambda x: (x[0], x[1]))

    ranked: list[Evaluated] = []
    gaps: list[float] = []
    solved = 0
    pruned = 0
    status = "optimal"
    for j, (bound, _i, cand, costs) in enumerate(bounded):
        if len(ranked) >= top_k + 1 and bound >= ranked[top_k].objective:
            pruned = len(bounded) - j
            break
        if progress is not None:
            progress(j, len(bounded))
        cand_modes = tuple(m for m in modes if not (cand.schedule == "zero-bubble" and m == "selective")) or modes
        res = solve_partition(
            graph, cluster, cand, costs, cand_modes, options, time_limit=time_limit, max_nodes=max_nodes
        )
        solved += 1
        if res.status == "infeasible" or res.partition is None:
            rejected[(_region(cand), "out of memory: no stage partition fits every rank")] += 1
            continue
        if res.status in ("time_limit", "node_limit"):
            status = res.status
            gaps.append((res.objective - bound) / res.objective if res.objective else 0.0)
        ev = evaluate(graph, cluster, cand, res.partition, res.recompute, costs, options)
        if cand.v > 1 and res.start is not None:
            # With several stages per rank the linear objective only approximates the schedule (it cannot
            # see how uneven stages of one rank stall each other); keep the balanced incumbent when the
            # simulator says it is faster.
            alt = evaluate(graph, cluster, cand, res.start[0], res.start[1], costs, options)
            if _simulated(alt) < _simulated(ev):
                ev = alt
        ev.status = res.status
        ranked.append(ev)
        ranked.sort(key=lambda e: (e.objective, _key(e.cand)))
        ranked = ranked[: top_k + 1]
    if not ranked:
        raise InfeasibleError(_nothing_fits(graph, cluster, smallest_need, space.candidates))
    return SearchResult(
        best=ranked[0],
        ranked=ranked,
        rejected=rejected,
        candidates=len(space.candidates),
        pruned_by_bound=pruned,
        ilps_solved=solved,
        seconds=time.perf_counter() - t0,
        status=status,
        gap=max(gaps, default=0.0),
    )


def simulate_evaluated(ev: Evaluated):
    """Discrete-event simulation of an evaluated partition's pipeline (the figure the plan reports)."""
    from planner.cost.simulate import simulate

    c = ev.cand
    fwd = [st.fwd for st in ev.stages]
    bwd = [max(st.compute, st.zero3_gather) - st.fwd for st in ev.stages]
    p2p = [st.p2p for st in ev.stages[:-1]] + [0.0]
    return simulate(c.schedule, c.pp, c.m, c.v, fwd, bwd, None, p2p)


def _simulated(ev: Evaluated) -> float:
    return simulate_evaluated(ev).iteration_time


def search_modes(graph: ModelGraph) -> tuple[str, ...]:
    """Recomputation modes worth searching: selective equals none when no unit keeps attention maps
    (flash attention), and identical alternatives would only multiply the ILP's equivalent optima."""
    if any(u.attention_core_bytes > 0 for u in graph.units):
        return RECOMPUTE_MODES
    return ("none", "full")


def _only(c: UnitCost, mode: str) -> UnitCost:
    return UnitCost(
        fwd=c.fwd,
        bwd={mode: c.bwd[mode]},
        act={mode: c.act[mode]},
        params_local=c.params_local,
        tp_comm_fwd=c.tp_comm_fwd,
        tp_comm_bwd=c.tp_comm_bwd,
        largest_param_bytes=c.largest_param_bytes,
        source=c.source,
    )


def _key(c: Candidate) -> tuple:
    return (c.pp, c.tp, c.v, -c.mbs, c.schedule, c.zero, c.sp, c.dp)


def _region(c: Candidate) -> str:
    return f"dp={c.dp} tp={c.tp} pp={c.pp}"


def _nothing_fits(
    graph: ModelGraph, cluster: ClusterSpec, need: tuple[float, Candidate] | None, cands: list[Candidate]
) -> str:
    cap = cluster.gpu.memory_bytes
    msg = f"The model does not fit on {cluster.world_size} x {cluster.gpu.display_name} in any configuration."
    if need is not None:
        mem, cand = need
        msg += (
            f" The most memory-frugal layout ({cand.label()}, full recomputation) still needs at least "
            f"{mem / GiB:.1f} GiB on its busiest pipeline rank, {(mem - cap) / GiB:.1f} GiB over the "
            f"{cap / GiB:.0f} GiB per GPU."
        )
    msg += (
        " To make it fit: use more GPUs (--nodes), allow ZeRO-3/FSDP and full recomputation (unpin "
        "--zero-stage/--recompute), a smaller micro-batch size, or a GPU with more memory."
    )
    return msg
