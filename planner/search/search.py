"""The outer search: bound every candidate, solve ILPs in order of their bounds, keep the top k.

A candidate's lower bounds (`planner.search.bounds`) are valid for every partition, so once the bound of
the next candidate reaches the k-th best solved objective, no later candidate can enter the top k and
the search stops: the result is exact with respect to the cost model. Bounds are tightened lazily: every
candidate gets the cheap one, and only a candidate that reaches the front of the queue gets the next
level (and goes back in), so the costly bounds run for the few that could still win. Each ILP gets the
k-th best objective as its cutoff.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from planner.cost.model import (
    Candidate,
    CostOptions,
    Profile,
    UnitCost,
    unit_cost,
)
from planner.errors import InfeasibleError
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.names import RECOMPUTE_MODES, SearchStatus
from planner.search.bounds import BlockBounds, IntervalBounds, Totals, lower_bounds, simple_bound
from planner.search.evaluate import Evaluated, evaluate, simulate_evaluated, simulated_time
from planner.search.ilp import ILPResult, block_run, solve_partition
from planner.search.space import Pins, enumerate_space

# Evaluated and simulate_evaluated are re-exported: planner.pipeline and the CLI import them from here.
__all__ = ["Evaluated", "SearchResult", "evaluate", "search", "simulate_evaluated"]

log = logging.getLogger(__name__)
GiB = 2**30
ILP_WORKERS = 2  # CBC processes at once
OOM_BOUND = "out of memory even with full recomputation and perfect balance"
RESERVE = "within the memory reserve: fits the GPU but not what the reserve leaves (--memory-reserve)"
NOT_TOP_K = "not in the top k: the ILP proved no partition that fits memory beats the k-th plan"


@dataclass(order=True)
class QueueItem:
    """A candidate waiting in the search's queue, ordered by its lower bound (then by its index).

    level 0 has the simple bound, 1 the block bound, 2 the block bound minimised jointly with the tail,
    or the interval bound of a model that is not transformer-shaped; `bounds` is that BlockBounds /
    IntervalBounds, which the ILP reuses for its cuts and start."""

    bound: float
    index: int
    level: int = field(compare=False)
    cand: Candidate = field(compare=False)
    costs: list[UnitCost] = field(compare=False, repr=False)
    modes: tuple[str, ...] = field(compare=False)
    bounds: BlockBounds | IntervalBounds | None = field(default=None, compare=False, repr=False)


@dataclass
class SearchResult:
    best: Evaluated
    ranked: list[Evaluated]
    rejected: Counter[tuple[str, str]]
    candidates: int
    pruned_by_bound: int
    ilps_solved: int
    seconds: float
    status: SearchStatus = "optimal"
    gap: float = 0.0  # worst relative gap to the candidate's lower bound of an ILP stopped early


@dataclass
class CostTable:
    """Unit costs per (tp, mbs, sp) (and, under expert parallelism, per (ep, dp, zero), which set the
    experts' share of the states and the all-to-all), computed once per distinct unit signature."""

    graph: ModelGraph
    cluster: ClusterSpec
    profile: Profile | None
    _by_sig: dict[tuple[object, ...], UnitCost] = field(default_factory=dict)
    _lists: dict[tuple[object, ...], list[UnitCost]] = field(default_factory=dict)

    def units(self, cand: Candidate) -> list[UnitCost]:
        """The units' costs under the candidate (one shared list per (tp, mbs, sp): do not modify it)."""
        key: tuple[object, ...] = (cand.tp, cand.micro_batch_size, cand.sequence_parallel)
        if cand.ep > 1:
            key += (cand.ep, cand.dp, cand.zero_stage)
        if key in self._lists:
            return self._lists[key]
        out: list[UnitCost] = []
        for u in self.graph.units:
            k = (u.signature, *key, u.name if u.kind != "block" else "")
            if k not in self._by_sig:
                self._by_sig[k] = unit_cost(u, cand, self.cluster, self.graph.source.dtype, self.profile)
            out.append(self._by_sig[k])
        self._lists[key] = out
        return out


def search(
    graph: ModelGraph,
    cluster: ClusterSpec,
    global_batch: int,
    pins: Pins = Pins(),
    options: CostOptions = CostOptions(),
    profile: Profile | None = None,
    top_k: int = 5,
    time_limit: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_nodes: int | None = 5000,
    prefer_simulated: bool = True,
) -> SearchResult:
    """Find the best configuration (and the next top_k) under the cost model.

    prefer_simulated: with several stages per rank, keep CBC's balanced incumbent instead of the ILP's
    optimum when the simulator finds it faster (the linear objective cannot see how uneven stages of one
    rank stall each other). Off, the result is exactly the optimum of the linear objective.
    """
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
    run = block_run(graph)
    # Lazy bounding: every candidate gets the cheap simple bound; the tighter block bound is computed
    # only for candidates that reach the front of the queue, which then go back in with it (QueueItem).
    heap: list[QueueItem] = []
    smallest_need: tuple[float, Candidate] | None = None
    totals: dict[tuple[object, ...], Totals] = {}
    for i, cand in enumerate(space.candidates):
        costs = table.units(cand)
        if pins.recompute:
            costs = [_only(c, pins.recompute) for c in costs]
        cand_modes = tuple(m for m in modes if not (cand.schedule == "zero-bubble" and m == "selective")) or modes
        tkey: tuple[object, ...] = (cand.tp, cand.micro_batch_size, cand.sequence_parallel, cand_modes)
        if cand.ep > 1:  # the unit costs differ per (ep, dp, zero) then (CostTable)
            tkey += (cand.ep, cand.dp, cand.zero_stage)
        if tkey not in totals:
            totals[tkey] = Totals.of(costs, cand_modes)
        b = simple_bound(totals[tkey], cand, cluster, dtype, options)
        if b.memory > cap:
            rejected[(_region(cand), OOM_BOUND if b.memory > cap + cluster.reserved_gib * GiB else RESERVE)] += 1
            if smallest_need is None or b.memory < smallest_need[0]:
                smallest_need = (b.memory, cand)
            continue
        heap.append(QueueItem(b.time, i, 0, cand, costs, cand_modes))
    heapq.heapify(heap)
    total = len(heap)

    ranked: list[Evaluated] = []
    gaps: list[float] = []
    solved = 0
    pruned = 0
    status: SearchStatus = "optimal"
    done = 0

    def solve(item: QueueItem, cutoff: float | None) -> ILPResult:
        return solve_partition(
            graph,
            cluster,
            item.cand,
            item.costs,
            item.modes,
            options,
            time_limit=time_limit,
            max_nodes=max_nodes,
            cutoff=cutoff,
            bounds=item.bounds,
        )

    # CBC runs in its own process: the next ILP_WORKERS candidates in bound order are solved side by side
    # (a fixed number, so that the counts reported do not depend on the machine). Every candidate whose
    # optimum could enter the top k is still solved exactly, so the ranking is that of one-by-one solving.
    pool = ThreadPoolExecutor(max_workers=ILP_WORKERS)
    try:
        while heap:
            batch: list[QueueItem] = []
            cutoff = ranked[top_k].objective if len(ranked) >= top_k + 1 else None
            while heap and len(batch) < ILP_WORKERS:
                item = heap[0]
                if cutoff is not None and item.bound >= cutoff:
                    break
                heapq.heappop(heap)
                if item.level < 2 and item.cand.stages > 1:
                    b = lower_bounds(
                        graph, item.costs, item.cand, cluster, options, item.modes, run, joint=item.level == 1
                    )
                    if not b.feasible:
                        rejected[(_region(item.cand), OOM_BOUND)] += 1
                        done += 1
                        continue
                    nxt = item.level + 1 if run is not None else 2
                    bounds = b.block or b.interval
                    bound = max(item.bound, b.time)
                    heapq.heappush(heap, QueueItem(bound, item.index, nxt, item.cand, item.costs, item.modes, bounds))
                    continue
                batch.append(item)
            if not batch:
                pruned = len(heap)
                break
            if progress is not None:
                progress(done, total)
            done += len(batch)
            results = list(pool.map(solve, batch, [cutoff] * len(batch)))
            solved += len(batch)
            for item, res in zip(batch, results, strict=True):
                bound, cand, costs = item.bound, item.cand, item.costs
                if res.status == "cutoff":
                    rejected[(_region(cand), NOT_TOP_K)] += 1
                    continue
                if res.status == "not_solved":
                    status = "time_limit" if time_limit is not None else "node_limit"
                    rejected[(_region(cand), "the ILP stopped at its limit before finding a plan")] += 1
                    continue
                if res.status == "infeasible" or res.partition is None:
                    rejected[(_region(cand), "out of memory: no stage partition fits every rank")] += 1
                    continue
                assert res.objective is not None and res.recompute is not None
                if res.status in ("time_limit", "node_limit") and res.objective <= bound * (1 + 1e-9):
                    res.status = "optimal"  # stopped early, but the candidate's lower bound proves it
                found: SearchStatus = "optimal"
                if res.status == "time_limit" or res.status == "node_limit":
                    status = found = res.status
                    gaps.append((res.objective - bound) / res.objective if res.objective else 0.0)
                ev = evaluate(graph, cluster, cand, res.partition, res.recompute, costs, options)
                if (
                    cand.virtual_stages > 1
                    and res.start is not None
                    and (res.start[0], res.start[1])
                    != (
                        res.partition,
                        res.recompute,
                    )
                ):
                    # With several stages per rank the linear objective only approximates the schedule (it
                    # cannot see how uneven stages of one rank stall each other); keep the balanced
                    # incumbent when the simulator says it is faster.
                    alt = evaluate(graph, cluster, cand, res.start[0], res.start[1], costs, options)
                    if simulated_time(alt) < simulated_time(ev):
                        ev = alt
                ev.status = found
                ranked.append(ev)
            ranked.sort(key=lambda e: (e.objective, _key(e.cand)))
            ranked = ranked[: top_k + 1]
    finally:
        pool.shutdown()
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
        ep_comm=c.ep_comm,
        sync_params_or_none=c.sync_params_or_none,
    )


def _key(c: Candidate) -> tuple[object, ...]:
    return (
        c.pp, c.tp, c.virtual_stages, -c.micro_batch_size, c.schedule, c.zero_stage, c.sequence_parallel, c.dp, c.ep
    )


def _region(c: Candidate) -> str:
    return f"dp={c.dp} tp={c.tp} pp={c.pp}" + (f" ep={c.ep}" if c.ep > 1 else "")


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
            f"{cap / GiB:.0f} GiB per GPU"
            + (f" left after the {cluster.reserved_gib:.2f} GiB memory reserve." if cluster.reserved_gib else ".")
        )
    msg += (
        " To make it fit: use more GPUs (--nodes), allow ZeRO-3/FSDP and full recomputation (unpin "
        "--zero-stage/--recompute), a smaller micro-batch size, or a GPU with more memory"
        + (" (or a smaller --memory-reserve)." if cluster.reserved_gib else ".")
    )
    return msg
