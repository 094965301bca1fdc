"""The outer search: bound every candidate, solve ILPs in order of their bounds, keep the top k.

A candidate's lower bounds (`planner.search.bounds`) are valid for every partition, so once the bound of
the next candidate reaches the k-th best solved objective, no later candidate can enter the top k and
the search stops: the result is exact with respect to the cost model. Bounds are tightened lazily: every
candidate gets the cheap one, and only a candidate that reaches the front of the queue gets the next
level (and goes back in), so the costly bounds run for the few that could still win. Each ILP gets the
k-th best objective as its cutoff.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec

from planner.cost.model import (
    Candidate,
    CostOptions,
    Profile,
    UnitCost,
    block_units,
    unit_cost,
)
from planner.cost.terms import comm_reserve_bytes, rank_capacity
from planner.errors import ConfigError, InfeasibleError
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.names import MAX_TOP_K, SEARCHED_RECOMPUTE_MODES, SearchStatus
from planner.search.blocks import even_partition, with_full_blocks, with_pinned_blocks
from planner.search.bounds import (
    BlockBounds,
    IntervalBounds,
    Totals,
    backward_share,
    comm_bound,
    linear_bounds_reported,
    lower_bounds,
    one_f_one_b_bound,
    reported_bound,
    simple_bound,
    tail_bound,
)
from planner.search.evaluate import Evaluated, evaluate, evaluate_fitting, simulate_evaluated
from planner.search.forked import SideSolvers, fork_allowed
from planner.search.ilp import ILPResult, block_run, solve_partition
from planner.search.pathbound import pipeline_bound
from planner.search.problem import PartitionProblem
from planner.search.reference import brute_force_reported, choices_count
from planner.search.space import Pins, enumerate_space

# Evaluated and simulate_evaluated are re-exported: planner.pipeline and the CLI import them from here.
__all__ = ["Evaluated", "Search", "SearchResult", "evaluate", "search", "simulate_evaluated"]

log = logging.getLogger(__name__)

# `Search.one_stage_first` solves one-stage candidates early while their bound is within this factor of the least.
ONE_STAGE_NEAR = 1.5

# Candidates `Search.guess` evaluates, at most, for a first guess at the plan (each one evaluation per mode).
GUESS_TRIES = 16

GiB = 2**30
ILP_WORKERS = 2  # CBC processes at once
# Nodes the branch and bound for several stages per rank (`ilp.ranks`) may expand over the whole search, and
# per candidate at most / at least (counts, never time: the result must not depend on the machine). A
# candidate stopped by its share keeps its best plan, and its lower bound enters SearchResult.gap.
SEARCH_BB_NODES = 12_000
BB_NODES_MAX = 4_000
BB_NODES_MIN = 100
# A pipelined candidate with at most this many (partition, recomputation) choices is settled by simulating
# every one of them (exact for the reported figure) instead of solving its ILP.
REFINE_LIMIT = 256
# GPipe's twin is dominated when the 1F1B plan's reported figure is within this relative tolerance of the
# linear optimum (the figures are sums of the same floats in different orders).
DOMINANCE_TOL = 1e-12
OOM_BOUND = "out of memory even with full recomputation and perfect balance"
RESERVE = "within the memory reserve: fits the GPU but not what the reserve leaves (--memory-reserve)"
NOT_TOP_K = "not in the top k: the ILP proved no partition that fits memory beats the k-th plan"


@dataclass(order=True)
class QueueItem:
    """A candidate waiting in the search's queue, ordered by its lower bound on the linear objective (then
    by its index).

    level 0 has the simple bound, 1 the block bound, 2 the block bound minimised jointly with the tail,
    or the interval bound of a model that is not transformer-shaped; `bounds` is that BlockBounds /
    IntervalBounds, which the ILP reuses for its cuts and start. `reported` is a valid lower bound on the
    figure the plan reports (`bounds.reported_bound`: equal to `bound` where the linear objective is at
    most the reported figure, GPipe and one stage; lower for the other schedules)."""

    bound: float
    index: int
    level: int = field(compare=False)
    pb: PartitionProblem = field(compare=False)
    bounds: BlockBounds | IntervalBounds | None = field(default=None, compare=False, repr=False)
    reported: float = field(default=0.0, compare=False)
    tail: float = field(default=0.0, compare=False)  # `bounds.tail_bound` of the candidate
    paths: bool = field(default=False, compare=False)  # `reported` raised by `pathbound.pipeline_bound`

    @property
    def cand(self) -> Candidate:
        return self.pb.cand


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
    # Relative gap between the chosen plan's reported figure and the least valid lower bound on that figure
    # of a candidate the search did not settle for it (too many partitions to simulate each, REFINE_LIMIT,
    # and either the linear optimum's partition is not proven best by the simulator or the candidate was
    # pruned by its linear bound only). 0 when the choice is the proven minimum of the reported figure
    # over the whole space searched. Candidates left below the choice get their bounds tightened to the
    # last level and raised by the schedule's longest paths (`pathbound`), which see the fill and drain
    # over uneven partitions. What keeps it open (GPT-3 175B on 1024 A100s: 3.1%): interleaved and
    # zero-bubble candidates with one to three blocks per stage, whose fractional partitions (which the
    # path bound relaxes to) simulate below the choice while their whole-block ones do not.
    reported_gap: float = 0.0


@dataclass
class CostTable:
    """Unit costs per (tp, mbs, sp) (and, under expert parallelism or with frozen parameters, per (ep, dp,
    zero), which set the experts' and the frozen parameters' share of the states and the all-to-all), computed
    once per distinct unit signature and frozen count (a frozen block and a trained one share a signature)."""

    graph: ModelGraph
    cluster: ClusterSpec
    profile: Profile | None
    _by_sig: dict[tuple[object, ...], UnitCost] = field(default_factory=dict)
    _lists: dict[tuple[object, ...], list[UnitCost]] = field(default_factory=dict)

    @property
    def frozen(self) -> bool:
        return any(u.frozen_params for u in self.graph.units)

    def units(self, cand: Candidate) -> list[UnitCost]:
        """The units' costs under the candidate (one shared list per (tp, mbs, sp): do not modify it)."""
        key = _cost_key(cand)
        if cand.ep > 1 or self.frozen:
            key += (cand.ep, cand.dp_shard, cand.zero_stage)
        if cand.cp > 1:  # context parallelism: each rank's share of the sequence (and its K/V exchange)
            key += ("cp", cand.cp)
        if key in self._lists:
            return self._lists[key]
        out: list[UnitCost] = []
        for u in self.graph.units:
            k = (u.signature, *key, u.name if u.kind != "block" else "", u.frozen_params)
            if k not in self._by_sig:
                self._by_sig[k] = unit_cost(u, cand, self.cluster, self.graph.source.dtype, self.profile)
            out.append(self._by_sig[k])
        self._lists[key] = out
        return out


class Search:
    """One search of the configurations of `graph` on `cluster` for `global_batch` (the pinned degrees `pins`):
    its inputs, its queue of candidates and what it has found so far, with one method a step. `run()` does it.

    prefer_simulated (the default): rank by the iteration time the plan reports (`Evaluated.reported`,
    the simulated pipeline plus the tail) and prune only with bounds valid for it. Candidates of one
    stage, and GPipe, have a linear objective at most their reported figure, so the linear bounds and
    the ILP's cutoff prune them; a pipelined candidate with at most REFINE_LIMIT partitions is settled
    by simulating each of them; a larger one keeps the faster (by the reported figure) of the ILP's
    optimum and its balanced start, and where neither is proven the minimum of the reported figure, or
    where it was pruned by its linear bound only, its valid bound (`bounds.reported_bound`) enters
    SearchResult.reported_gap. Off, the ranking is by the linear objective and the result is exactly
    its optimum over the whole space (GPipe's 1F1B dominance is exact for it).

    on_best: called with each plan that becomes the best so far (the last call's is the result's best, where
    the search ends normally); the search itself does not depend on it.

    on_guess: called once, before any candidate is solved, with a first guess (`Search.guess`: the candidate of
    the least bound, its blocks spread evenly, no solver run), where one fits; `planner plan` hands it to the
    plan-time check, which gets to work on it while the search runs. The search does not depend on it.

    block_recompute: each plan ranked gets its stages' block recomputation chosen where it fits and is faster
    (`planner.search.blocks.with_full_blocks`; `planner plan` turns it on). Off (the library's default), the
    result is the optimum over the all-or-nothing modes that the exactness tests compare with brute force; a
    pinned `Pins.recompute_blocks` applies either way.
    """

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        global_batch: int,
        pins: Pins = Pins(),
        options: CostOptions | None = None,
        profile: Profile | None = None,
        top_k: int = 5,
        time_limit: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        max_nodes: int | None = 5000,
        prefer_simulated: bool = True,
        on_best: Callable[[Evaluated], None] | None = None,
        block_recompute: bool = False,
        on_guess: Callable[[Evaluated], None] | None = None,
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
            raise ConfigError(
                f"top_k {top_k!r} is outside 0..{MAX_TOP_K}: each runner-up kept weakens the search's pruning, so "
                f"the planner keeps at most {MAX_TOP_K}. Pass --top-k {MAX_TOP_K} or less."
            )
        # the cost model's switches; by default the cluster's (its fragmentation share, `CostOptions.for_cluster`)
        self.options = options if options is not None else CostOptions.for_cluster(cluster)
        self.graph, self.cluster, self.pins = graph, cluster, pins
        self.top_k, self.time_limit, self.max_nodes = top_k, time_limit, max_nodes
        self.progress, self.on_best, self.on_guess = progress, on_best, on_guess
        self.block_recompute = block_recompute
        self.by_reported = prefer_simulated
        self.t0 = time.perf_counter()
        self.space = enumerate_space(graph, cluster, global_batch, pins)
        self.rejected = Counter(self.space.rejected)
        # the search's own rejections, one reason per candidate, grouped into regions at the end (`_regions`)
        self.refused: dict[Candidate, str] = {}
        self.table = CostTable(graph, cluster, profile)
        self.modes = (pins.recompute,) if pins.recompute else search_modes(graph)
        if pins.recompute_blocks is not None:
            check_recompute_blocks(graph, pins)
            # the blocks recompute N each; the rest of each stage takes one of the other modes
            self.modes = tuple(m for m in self.modes if m != "full") or self.modes
        self.blocks = block_units(graph)
        self.run_of_blocks = block_run(graph)
        # Lazy bounding: every candidate gets the cheap simple bound; the tighter block bound is computed
        # only for candidates that reach the front of the queue, which then go back in with it (QueueItem).
        self.heap: list[QueueItem] = []
        self.total = 0  # candidates queued with their simple bound (the progress display's total)
        self.smallest_need: tuple[float, Candidate] | None = None
        self.totals: dict[tuple[object, ...], Totals] = {}
        self.shares: dict[tuple[object, ...], float] = {}
        self.ranked: list[Evaluated] = []  # the best top_k + 1 so far, best first
        self.gaps: list[float] = []
        self.solved = 0
        self.pruned = 0
        self.status: SearchStatus = "optimal"
        self.done = 0
        self.revived = 0
        # valid lower bounds on the reported figure of candidates not settled exactly for it
        self.unresolved: list[float] = []
        # candidates whose ILP plan is not proven the least reported figure: (valid bound, item), settled last
        self.unsettled: list[tuple[float, QueueItem]] = []
        # pipelined candidates pruned by their linear bound whose reported bound is lower: settled at the end
        self.doubtful: list[QueueItem] = []
        self.bb_left = SEARCH_BB_NODES

    def run(self) -> SearchResult:
        """Bound every candidate, solve them in order of their bounds until the k-th plan's figure prunes the
        rest, then settle the reported figure's bounds; InfeasibleError where nothing fits."""
        if not self.space.candidates:
            raise InfeasibleError(_no_candidate(self.cluster, self.rejected))
        self.bound_all()
        if self.on_guess is not None:
            try:
                guess = self.guess()
            except Exception as e:  # noqa: BLE001 - a head start for the check, not part of the search
                log.debug("no first guess (%s: %s)", type(e).__name__, e)
                guess = None
            if guess is not None:
                log.debug("first guess, for the plan-time check: %s", guess.cand.label())
                self.on_guess(guess)
        # The next ILP_WORKERS candidates in bound order are solved side by side (a fixed number, so that the
        # counts reported do not depend on the machine): in forked processes where fork_allowed and two of them
        # have several stages (the chain program and the branch and bound are Python, which threads run one at a
        # time; one stage is a closed form, quicker than a fork), else in threads (CBC runs in its own process).
        # Every candidate whose optimum could enter the top k is still solved exactly, so the ranking is that of
        # one-by-one solving.
        pool = ThreadPoolExecutor(max_workers=ILP_WORKERS)
        # (the children hold the graph, cluster and options as the search does: they never change during it)
        side = SideSolvers([self.graph, self.cluster, self.options]) if fork_allowed() else None
        try:
            self.one_stage_first()
            while self.heap:
                cutoff = self.cutoff_now()
                batch, cutoff = self.next_batch(cutoff)
                if not batch:
                    self.pruned = len(self.heap)
                    break
                if self.progress is not None:
                    self.progress(self.done, self.total)
                self.done += len(batch)
                share = self.bb_share()
                if side is not None and sum(it.cand.stages > 1 for it in batch) > 1:  # Python: processes, not threads
                    solve = functools.partial(
                        solve_item, time_limit=self.time_limit, max_nodes=self.max_nodes, cutoff=cutoff, nodes=share
                    )
                    results = side.map(solve, batch)
                else:
                    results = list(pool.map(self.solve, batch, [cutoff] * len(batch), [share] * len(batch)))
                self.solved += len(batch)
                self.bb_left = max(0, self.bb_left - sum(r.nodes for r in results))
                for item, res in zip(batch, results, strict=True):
                    self.take(item, res, cutoff)
            if self.by_reported:
                self.settle_pruned()
                self.settle_unsettled()
        finally:
            pool.shutdown()
            if side is not None:
                side.close()
        return self.result()

    def one_stage_first(self) -> None:
        """Candidates of one stage solved ahead of the queue's order, the least bound first, while their bounds
        are within ONE_STAGE_NEAR of the least and below the k-th plan's figure (`cutoff_now`, once it exists).
        Each is a closed form, no solver; the pipelined candidates ahead of them in bound order then meet a
        cutoff from their first node: without one, the branch and bound solves the first of them to their
        optimum (a CLIP pair on 64 H100: thousands of nodes for interleaved candidates three times slower than
        the one-stage plans that the linear bounds ranked after them). Going on past the first cutoff, to every
        one-stage candidate that could still enter the top k, finds the best one-stage plan (most models' best)
        before any branch and bound: the plan-time check gets it from `on_best` at once (Llama-3-70B on 64 H100:
        after 0.17 s of a 1 s search, not 0.41 s, so the check runs beside the rest of the search).
        The order changes only how much is solved: every candidate whose bound is below the final cutoff is
        still solved exactly."""
        if not self.heap:
            return
        least = min(self.heap).bound
        # (only those near the least bound: a cutoff from plans far behind it would prune little)
        single = sorted(it for it in self.heap if it.cand.stages == 1 and it.bound <= least * ONE_STAGE_NEAR)
        taken: set[int] = set()
        for item in single:
            cutoff = self.cutoff_now()
            if cutoff is not None and item.bound >= cutoff:
                break
            taken.add(id(item))
            self.done += 1
            self.solved += 1
            self.take(item, self.solve(item, cutoff, None), cutoff)
        if taken:
            self.heap = [it for it in self.heap if id(it) not in taken]
            heapq.heapify(self.heap)

    def guess(self) -> Evaluated | None:
        """The first of the GUESS_TRIES candidates of least bounds that fits memory with its blocks spread
        evenly over its stages (Megatron-LM's layout, `even_partition`), in its first recomputation mode that
        fits; None where none does. A guess at the plan the search will find, made in the time of a few
        evaluations: neither ranked nor bounding anything."""
        n = len(self.graph.units)
        for item in heapq.nsmallest(GUESS_TRIES, self.heap):
            cand = item.cand
            partition = even_partition(self.graph, cand.stages) if cand.stages > 1 else [list(range(n))]
            if partition is None:
                continue
            capacity = rank_capacity(self.cluster, cand)
            for mode in item.pb.modes:
                ev = evaluate_fitting(item.pb, partition, [mode] * len(partition), capacity)
                if ev is not None:  # with the block recomputation a ranked plan gets (none pinned: no refusal)
                    return self.with_blocks(ev) if self.pins.recompute_blocks is None else ev
        return None

    def refuse(self, c: Candidate, why: str) -> None:
        self.refused.setdefault(c, why)

    def score(self, ev: Evaluated) -> float:
        return ev.reported if self.by_reported else ev.objective

    def costs_of(self, cand: Candidate) -> list[UnitCost]:
        """The candidate's unit costs, each down to the pinned recomputation mode where one is pinned."""
        costs = self.table.units(cand)
        if self.pins.recompute_blocks is not None:
            # The partition solvers see each block's activations as under full recomputation (a lower bound on
            # what it keeps with N blocks per stage recomputed), so that no partition that fits with the pin is
            # refused; the plan found is then evaluated with the pin itself (`with_blocks`).
            costs = [_kept_as_full(c) if i in self.blocks else c for i, c in enumerate(costs)]
        if self.pins.recompute:
            costs = [_only(c, self.pins.recompute) for c in costs]
        return costs

    def bound_all(self) -> None:
        """Every candidate into the queue with its simple bound (or refused where even that is out of memory)."""
        for i, cand in enumerate(self.space.candidates):
            modes = self.modes
            # selective checkpointing (either policy) allows one backward per region: zero-bubble runs it as full
            zb = cand.schedule == "zero-bubble"
            cand_modes = tuple(m for m in modes if not (zb and m in ("selective", "op"))) or modes
            self.enqueue(i, cand, self.costs_of(cand), cand_modes, 0.0)
        heapq.heapify(self.heap)
        self.total = len(self.heap)

    def reported_of(self, item: QueueItem, linear: float, comm: float = 0.0, path: bool = False) -> float:
        if not self.by_reported:
            return linear
        c = item.cand
        key = (*_totals_key(c, item.pb.modes), c.zero_stage == 3)
        if key not in self.shares:
            self.shares[key] = backward_share(item.pb.costs, c)
        extra = 0.0
        if path and c.schedule == "1f1b" and c.pp > 1:
            extra = one_f_one_b_bound(item.pb.costs, c, self.shares[key])
        return reported_bound(item.pb, linear, self.shares[key], comm, item.bounds, extra, item.tail)

    def enqueue(
        self, i: int, cand: Candidate, costs: list[UnitCost], cand_modes: tuple[str, ...], floor: float
    ) -> None:
        cluster = self.cluster
        tkey = _totals_key(cand, cand_modes)
        if tkey not in self.totals:
            self.totals[tkey] = Totals.of(costs, cand_modes)
        pb = PartitionProblem(
            self.graph, cluster, cand, costs, cand_modes, self.options, shared_totals=self.totals[tkey]
        )
        tail = tail_bound(pb)
        b = simple_bound(pb, tail)
        if b.memory > rank_capacity(cluster, cand):
            # beyond the GPU itself, or only beyond what the reserve (fixed and this plan's NCCL share) leaves
            cap = cluster.gpu.memory_bytes
            self.refuse(cand, OOM_BOUND if b.memory > cap + cluster.reserved_gib * GiB else RESERVE)
            short = b.memory - rank_capacity(cluster, cand)
            need = self.smallest_need
            if need is None or short < need[0] - rank_capacity(cluster, need[1]):
                self.smallest_need = (b.memory, cand)
            return
        item = QueueItem(max(b.time, floor), i, 0, pb, tail=tail)
        item.reported = max(self.reported_of(item, b.time), floor)
        self.heap.append(item)

    def bb_share(self) -> int | None:
        """One candidate's branch-and-bound nodes: what the search has left, split over a batch, and never
        more than ``max_nodes`` (the nodes of one candidate, whichever solver runs it)."""
        if self.max_nodes is None:
            return None
        return min(self.max_nodes, max(BB_NODES_MIN, min(BB_NODES_MAX, self.bb_left // ILP_WORKERS)))

    def solve(self, item: QueueItem, cutoff: float | None, nodes: int | None) -> ILPResult:
        """The item's ILP (`solve_item` with the search's limits)."""
        return solve_item(item, self.time_limit, self.max_nodes, cutoff, nodes)

    def cutoff_now(self) -> float | None:
        """The k-th best plan's figure (no later candidate whose bound reaches it can enter the top k)."""
        return self.score(self.ranked[self.top_k]) if len(self.ranked) >= self.top_k + 1 else None

    def with_blocks(self, ev: Evaluated) -> Evaluated | None:
        """`ev` with Megatron-LM's block recomputation where pinned (`--recompute-blocks`) or faster where it fits
        (`planner.search.blocks`); None (and the candidate refused, with why) where the pin cannot be met."""
        n = self.pins.recompute_blocks
        if n is None and (not self.block_recompute or self.pins.recompute is not None):
            return ev  # (one mode pinned: every stage fits at it already, and k = 0 is its fastest)
        cand = ev.cand
        zb = cand.schedule == "zero-bubble"
        modes = tuple(m for m in self.modes if not (zb and m in ("selective", "op"))) or self.modes
        pb = PartitionProblem(self.graph, self.cluster, cand, self.table.units(cand), modes, self.options)
        if n is None:
            return with_full_blocks(pb, ev)
        got = with_pinned_blocks(pb, ev, n)
        even = even_partition(self.graph, cand.stages)
        if isinstance(got, str) and even is not None and even != ev.partition:
            # Megatron-LM's own layout (the blocks spread evenly, the embedding first, the head last)
            retry = with_pinned_blocks(pb, evaluate(pb, even, [modes[0]] * len(even)), n)
            got = retry if not isinstance(retry, str) else got
        if isinstance(got, str):
            self.refuse(cand, got)
            return None
        return got

    def add(self, ev: Evaluated) -> None:
        got = self.with_blocks(ev)
        if got is None:
            return
        ev = got
        # a sorted list of at most top_k + 1 (bounded by MAX_TOP_K): one insertion, the worst dropped
        bisect.insort(self.ranked, ev, key=lambda e: (self.score(e), _key(e.cand)))
        del self.ranked[self.top_k + 1 :]
        if self.on_best is not None and self.ranked[0] is ev:
            self.on_best(ev)

    def next_batch(self, cutoff: float | None) -> tuple[list[QueueItem], float | None]:
        """The next ILP_WORKERS candidates to solve, taken from the queue, and the cutoff they are solved under;
        on the way, candidates are tightened and put back, pruned, or settled by simulation."""
        batch: list[QueueItem] = []
        heap = self.heap
        while heap and len(batch) < ILP_WORKERS:
            item = heap[0]
            if cutoff is not None and item.bound >= cutoff:
                break
            heapq.heappop(heap)
            if item.level < 2 and item.cand.stages > 1:
                nxt_item = self.tighten(item)
                if nxt_item is None:
                    self.done += 1
                else:
                    heapq.heappush(heap, nxt_item)
                continue
            if cutoff is not None and item.reported >= cutoff:
                self.refuse(item.cand, NOT_TOP_K)
                self.done += 1
                continue
            if self.small(item):
                # simulate every partition: exact for the reported figure, and no ILP needed
                self.done += 1
                self.brute(item)
                cutoff = self.cutoff_now()
                continue
            batch.append(item)
        return batch, cutoff

    def take(self, item: QueueItem, res: ILPResult, cutoff: float | None) -> None:
        """What the item's ILP (solved under `cutoff`) found: a refusal, or its plan ranked."""
        by_reported = self.by_reported
        bound, cand = item.bound, item.cand
        exact_linear = linear_bounds_reported(cand) or not by_reported
        if res.status == "cutoff":
            # the linear optimum is at least the cutoff: so is the reported figure where it bounds it
            if not exact_linear and cutoff is not None and item.reported < cutoff:
                self.doubtful.append(item)
            self.refuse(cand, NOT_TOP_K)
            return
        if res.status == "not_solved":
            self.status = "time_limit" if self.time_limit is not None else "node_limit"
            self.refuse(cand, "the ILP stopped at its limit before finding a plan")
            self.unresolved.append(item.reported)
            if res.low is not None and cutoff is not None and res.low < cutoff:
                # no plan found: the gap is the k-th plan's to the candidate's proven bound
                self.gaps.append((cutoff - max(bound, res.low)) / cutoff)
            return
        if res.status == "infeasible" or res.partition is None:
            self.refuse(cand, "out of memory: no stage partition fits every rank")
            return
        assert res.objective is not None and res.recompute is not None
        if res.low is not None:
            bound = max(bound, res.low)  # the solver's own proof, when it stopped early
        if res.status in ("time_limit", "node_limit") and res.objective <= bound * (1 + 1e-9):
            res.status = "optimal"  # stopped early, but the candidate's lower bound proves it
        found: SearchStatus = "optimal"
        if res.status == "time_limit" or res.status == "node_limit":
            self.status = found = res.status
            self.gaps.append((res.objective - bound) / res.objective if res.objective else 0.0)
        ev = evaluate(item.pb, res.partition, res.recompute)
        if (
            by_reported
            and cand.stages > 1
            and res.start is not None
            and (res.start[0], res.start[1]) != (res.partition, res.recompute)
        ):
            # The linear objective only approximates the schedule (it cannot see how 1F1B hides part
            # of the fill, or how uneven stages of one rank stall each other): keep the balanced
            # start when the reported figure says it is faster and it fits.
            alt = evaluate(item.pb, res.start[0], res.start[1])
            if alt.reported < ev.reported and max(alt.rank_memory.values()) <= rank_capacity(self.cluster, cand):
                ev = alt
        linear_low = res.objective if found == "optimal" else bound
        if by_reported and cand.stages > 1:
            # what is proven for the reported figure: the candidate's bound for it, and for GPipe
            # the linear optimum (at most the reported figure of every partition)
            low = max(item.reported, linear_low) if linear_bounds_reported(cand) else item.reported
            if ev.reported > low * (1 + 1e-9):
                self.unsettled.append((low, item))
                log.debug("not settled: %s, plan %.6g, bound %.6g", cand.label(), ev.reported, low)
        optimum = (res.partition, res.recompute) if found == "optimal" else None
        self.settled_1f1b(cand, linear_low, ev.reported, item.index, optimum)
        ev.status = found
        self.add(ev)

    def tighten(self, item: QueueItem) -> QueueItem | None:
        """The item with its next level of bounds; None (and the rejection counted) if nothing fits."""
        b = lower_bounds(item.pb, item.level == 1, item.tail)
        if not b.feasible:
            self.refuse(item.cand, OOM_BOUND)
            return None
        nxt = item.level + 1 if self.run_of_blocks is not None else 2
        tight = b.block or b.interval
        out = QueueItem(max(item.bound, b.time), item.index, nxt, item.pb, tight, tail=item.tail)
        comm = 0.0
        if self.by_reported and not linear_bounds_reported(item.cand):
            comm = comm_bound(item.pb, self.run_of_blocks)
        out.reported = max(item.reported, self.reported_of(out, out.bound, comm, path=True))
        return out

    def settled_1f1b(
        self,
        cand: Candidate,
        linear_low: float,
        plan: float | None,
        index: int,
        optimum: tuple[list[list[int]], list[str]] | None = None,
    ) -> None:
        """GPipe's 1F1B dominance (space.py) holds for the linear objective: same objective, a subset of
        the partitions that fit. For the reported figure it holds when the 1F1B plan's reported time is at
        most `linear_low`, a lower bound on 1F1B's (hence GPipe's) linear optimum, which is at most GPipe's
        reported figure (`linear_bounds_reported`). Otherwise the GPipe twin goes into the queue, unless
        `optimum`, 1F1B's proven linear optimum (partition, recomputation), also fits GPipe's memory: it is
        then GPipe's linear optimum too (same objective, fewer partitions fit), so it is evaluated as the
        twin's ILP would find it (the same linear optimum; its reported figure is checked against it)."""
        if not self.by_reported or self.pins.schedule is not None or cand.schedule != "1f1b" or cand.pp == 1:
            return
        if plan is None or plan <= linear_low * (1 + DOMINANCE_TOL):
            return
        twin = dataclasses.replace(cand, schedule="gpipe")
        costs = self.costs_of(twin)
        if optimum is not None:
            pb = PartitionProblem(self.graph, self.cluster, twin, costs, self.modes, self.options)
            ev = evaluate(pb, optimum[0], optimum[1])
            fits = max(ev.rank_memory.values()) <= rank_capacity(self.cluster, twin)
            if fits and ev.objective <= linear_low * (1 + DOMINANCE_TOL):
                self.revived += 1
                if ev.reported > linear_low * (1 + 1e-9):
                    self.unresolved.append(linear_low)
                self.add(ev)
                return
        before = len(self.heap)
        self.enqueue(len(self.space.candidates) + index, twin, costs, self.modes, linear_low)
        if len(self.heap) > before:
            heapq.heapify(self.heap)
            self.revived += 1

    def brute(self, item: QueueItem) -> None:
        """Settle the item by simulating every (partition, recomputation) choice (`small` items)."""
        res = brute_force_reported(item.pb)
        if res is None:
            self.refuse(item.cand, "out of memory: no stage partition fits every rank")
            return
        ev, least_linear = res
        self.add(ev)
        self.settled_1f1b(item.cand, least_linear, ev.reported, item.index)

    def path_raised(self, item: QueueItem, low: float) -> float:
        """`low`, a valid bound on the item's reported figure, raised by the schedule's longest paths
        (`pathbound.pipeline_bound`, aiming at the choice's figure) plus the tail bound."""
        target = self.score(self.ranked[0]) - item.tail
        pipe = pipeline_bound(item.pb, item.bounds, target)
        return max(low, pipe + item.tail)

    def small(self, item: QueueItem) -> bool:
        """Whether the item is settled by simulating every choice (at most REFINE_LIMIT of them)."""
        if not self.by_reported or item.cand.stages <= 1:
            return False
        return choices_count(len(self.graph.units), item.cand, item.pb.modes) <= REFINE_LIMIT

    def settle_pruned(self) -> None:
        """Candidates left in the queue have a linear bound at or above the k-th plan: pruned exactly where it
        bounds the reported figure. The others are settled by simulation when small, else their reported bound
        is tightened and, if still below the choice, counts in the gap.

        The least bound first: small candidates below the choice are settled by simulating every partition. A
        large one has its bound tightened to the last level, then raised by the schedule's longest paths, going
        back each time; the first large one left below the choice with its bound final has the least bound of
        those left and fixes the gap: then only small candidates are still worth settling."""
        rest = [it for it in self.doubtful + self.heap if not linear_bounds_reported(it.cand)]
        sweep = [(it.reported, it.index, it) for it in rest]
        heapq.heapify(sweep)
        gap_found = False
        while sweep:
            _, _, item = heapq.heappop(sweep)
            if not self.ranked or item.reported >= self.score(self.ranked[0]):
                break
            if self.small(item):
                self.brute(item)
                continue
            if gap_found:
                continue
            if item.level < 2:
                nxt_item = self.tighten(item)
                if nxt_item is not None:
                    heapq.heappush(sweep, (nxt_item.reported, nxt_item.index, nxt_item))
                continue
            if not item.paths:
                item.paths = True
                item.reported = self.path_raised(item, item.reported)
                heapq.heappush(sweep, (item.reported, item.index, item))
                continue
            self.unresolved.append(item.reported)
            gap_found = True
            log.debug("reported gap set by %s: bound %.6g", item.cand.label(), item.reported)

    def settle_unsettled(self) -> None:
        """Solved candidates whose plan is not proven their least reported figure: their bounds raised by the
        longest paths, least first; one at or above the least bound so far cannot lower it."""
        if not self.ranked:  # every plan refused (a pinned --recompute-blocks that no stage meets)
            return
        for low, item in sorted(self.unsettled, key=lambda e: (e[0], e[1].index)):
            if low >= min(self.unresolved, default=self.score(self.ranked[0])):
                break
            low = self.path_raised(item, low)
            if low < self.score(self.ranked[0]):
                self.unresolved.append(low)
                log.debug("not settled: %s, bound %.6g", item.cand.label(), low)

    def result(self) -> SearchResult:
        ranked = self.ranked
        pinned = sorted({why for why in self.refused.values() if "recompute-blocks" in why or "blocks of each" in why})
        if not ranked and pinned and self.pins.recompute_blocks is not None:
            n = self.pins.recompute_blocks
            raise InfeasibleError(
                f"No plan meets --recompute-blocks {n} (the first {n} blocks of every stage recomputed fully): "
                f"{'; '.join(pinned[:3])}. Pass a smaller --recompute-blocks where a stage holds too few blocks, a "
                "larger one where memory runs out, or leave it out (the planner then chooses per stage)."
            )
        if not ranked:
            raise InfeasibleError(
                _nothing_fits(
                    self.graph, self.cluster, self.smallest_need, self.space.candidates, self.pins.recompute or "full"
                )
            )
        self.rejected.update(_regions(self.refused, ranked))
        best_figure = self.score(ranked[0])
        least = min(self.unresolved, default=best_figure)
        return SearchResult(
            best=ranked[0],
            ranked=ranked,
            rejected=self.rejected,
            candidates=len(self.space.candidates) + self.revived,
            pruned_by_bound=self.pruned,
            ilps_solved=self.solved,
            seconds=time.perf_counter() - self.t0,
            status=self.status,
            gap=max(self.gaps, default=0.0),
            reported_gap=max(0.0, (best_figure - least) / best_figure) if best_figure > 0 else 0.0,
        )


def solve_item(
    item: QueueItem, time_limit: float | None, max_nodes: int | None, cutoff: float | None, nodes: int | None
) -> ILPResult:
    """A queued candidate's ILP: a pure function of its arguments (`forked.SideSolvers` runs it in a child)."""
    return solve_partition(
        item.pb, time_limit=time_limit, max_nodes=max_nodes, cutoff=cutoff, bounds=item.bounds, bb_nodes=nodes
    )


_P = ParamSpec("_P")


def _running(cls: Callable[_P, Search]) -> Callable[_P, SearchResult]:
    """`cls(...).run()` as one call with the constructor's own parameters (declared once, on Search)."""

    def run(*args: _P.args, **kwargs: _P.kwargs) -> SearchResult:
        return cls(*args, **kwargs).run()

    run.__doc__ = f"Find the best configuration (and the next top_k): Search(...).run().\n\n{cls.__doc__}"
    return run


search = _running(Search)


def _no_candidate(cluster: ClusterSpec, rejected: Counter[tuple[str, str]]) -> str:
    # A candidate "dominated by" another is not why nothing fits (the other one was rejected for its own
    # reason): those reasons go last.
    order = sorted(rejected.items(), key=lambda kv: (kv[0][1].startswith("dominated by"), kv[0]))
    reasons = "; ".join(f"{region}: {why} ({n} candidate{'s' if n != 1 else ''})" for (region, why), n in order[:6])
    return (
        f"No configuration of {cluster.world_size} GPUs satisfies the constraints: {reasons or 'none'}. "
        "Change the pinned degrees, the global batch size (make it divisible by the data-parallel degree) "
        "or the GPU count."
    )


def check_recompute_blocks(graph: ModelGraph | None, pins: Pins) -> None:
    """ConfigError where `--recompute-blocks N` cannot hold: N below 1, with full recomputation pinned (which
    recomputes every block already), or more blocks per stage than the model has for the pinned stage count (that
    last only with the `graph`: the CLI checks the rest before loading the model)."""
    n = pins.recompute_blocks
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(
            f"--recompute-blocks {n!r}: the number of blocks each stage recomputes fully must be 1 or more. Pass a "
            "positive count, or leave the option out (the search then chooses per stage)."
        )
    if pins.recompute == "full":
        raise ConfigError(
            f"--recompute-blocks {n} with --recompute full: full recomputation recomputes every block already, and "
            "--recompute-blocks sets how many of each stage's first blocks are recomputed fully while the rest keep "
            "the stage's mode. Pin --recompute none, selective or op with it, or leave one of the two out."
        )
    if graph is None:
        return
    blocks = len(block_units(graph))
    stages = (pins.pp or 1) * (pins.virtual_stages or 1)
    if n * stages > blocks:
        where = f"each of the {stages} pinned stages (pp x virtual stages)" if stages > 1 else "one stage"
        fix = (
            f"Pass --recompute-blocks {blocks // stages} or less" + (" or pin fewer stages." if stages > 1 else ".")
            if blocks >= stages
            else "Block recomputation needs repeated blocks in every stage: leave the option out."
        )
        raise ConfigError(
            f"--recompute-blocks {n}: the model has {blocks} block(s) (units repeated in it), so {where} cannot hold "
            f"{n} of them. {fix}"
        )


def search_modes(graph: ModelGraph) -> tuple[str, ...]:
    """Recomputation modes worth searching: selective equals none when no unit keeps attention maps
    (flash attention), and identical alternatives would only multiply the ILP's equivalent optima."""
    if any(u.attention_core_bytes > 0 for u in graph.units):
        return SEARCHED_RECOMPUTE_MODES
    return ("none", "full")


def _kept_as_full(c: UnitCost) -> UnitCost:
    """`c` with every mode's activations those of full recomputation (`Search.costs_of` under a pinned
    --recompute-blocks)."""
    return dataclasses.replace(c, act=dict.fromkeys(c.act, c.act["full"]))


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
        experts_held=c.experts_held,
        experts_counted=c.experts_counted,
    )


def _cost_key(c: Candidate) -> tuple[object, ...]:
    """What the unit costs depend on besides the model and cluster: (tp, mbs, sp), async TP where on, and the
    dp degree under ZeRO-3 (its per-unit gathers, `terms.zero3_unit_exposed_time`)."""
    key: tuple[object, ...] = (c.tp, c.micro_batch_size, c.sequence_parallel)
    if c.tp_overlap:
        key += ("async-tp",)
    if c.zero_stage == 3 and c.dp > 1:
        key += ("zero3", c.dp)
    return key


def _totals_key(c: Candidate, modes: tuple[str, ...]) -> tuple[object, ...]:
    """The key of a candidate's unit-cost totals: (tp, mbs, sp, modes), and under expert parallelism
    (ep, dp, zero) too, since the unit costs differ per (ep, dp, zero) then (CostTable)."""
    key: tuple[object, ...] = (*_cost_key(c), modes)
    if c.ep > 1:
        key += (c.ep, c.dp, c.zero_stage)
    if c.cp > 1:
        key += ("cp", c.cp)
    return key


def _key(c: Candidate) -> tuple[object, ...]:
    return (
        c.pp, c.tp, c.virtual_stages, -c.micro_batch_size, c.schedule, c.zero_stage, c.sequence_parallel, c.dp, c.ep,
        c.cp,
    )


def _region(c: Candidate) -> str:
    """What a rejection names: every setting of the candidate but the micro-batch size (which `_regions`
    lists) and the micro-batch count (which follows from it), so that a region never covers a plan of a
    different ZeRO stage, schedule or sequence parallelism than the ones rejected."""
    out = f"dp={c.dp} tp={c.tp}" + ("+sp" if c.sequence_parallel else "") + f" pp={c.pp}"
    if c.virtual_stages > 1:
        out += f"x{c.virtual_stages}"
    if c.ep > 1:
        out += f" ep={c.ep}"
    if c.cp > 1:
        out += f" cp={c.cp}"
    if c.pp > 1:
        out += f" {c.schedule}"
    return out + f" zero={c.zero_stage}"


def region_of(c: Candidate) -> str:
    """The rejected-region label of one candidate, its micro-batch size included (as `_regions` writes it)."""
    return f"{_region(c)} mbs={c.micro_batch_size}"


def _regions(refused: dict[Candidate, str], ranked: list[Evaluated]) -> Counter[tuple[str, str]]:
    """The search's rejections grouped by (region, reason), each region listing its micro-batch sizes
    ("dp=64 tp=1 pp=1 ep=2 zero=0 mbs=1,2,4"). A candidate that was rejected on the way and still made the
    ranking (a pruned candidate settled later) is left out: no region contradicts the plans listed."""
    listed = {ev.cand for ev in ranked}
    sizes: dict[tuple[str, str], set[int]] = {}
    for c, why in refused.items():
        if c not in listed:
            sizes.setdefault((_region(c), why), set()).add(c.micro_batch_size)
    out: Counter[tuple[str, str]] = Counter()
    for (region, why), mbs in sizes.items():
        out[(f"{region} mbs={','.join(str(b) for b in sorted(mbs))}", why)] = len(mbs)
    return out


# How the infeasibility message names the recomputation its most frugal layout was measured with.
_RECOMPUTE_WORDS = {"full": "full recomputation", "selective": "selective recomputation", "none": "no recomputation"}


def _nothing_fits(
    graph: ModelGraph,
    cluster: ClusterSpec,
    need: tuple[float, Candidate] | None,
    cands: list[Candidate],
    recompute: str = "full",
) -> str:
    """Why nothing fits. `recompute`: the mode the memory bound was taken under (the pinned one, else full,
    the most frugal), named in the message: a pinned selective run must not read as "even full recomputation
    does not fit"."""
    msg = f"The model does not fit on {cluster.world_size} x {cluster.gpu.display_name} in any configuration."
    reserved = False
    if need is not None:
        mem, cand = need
        cap = rank_capacity(cluster, cand)
        reserve = cluster.reserved_gib + comm_reserve_bytes(cluster.nccl_bytes_per_group, cand) / GiB
        reserved = reserve > 0
        msg += (
            f" The most memory-frugal layout ({cand.label()}, {_RECOMPUTE_WORDS.get(recompute, recompute)}) still "
            f"needs at least "
            f"{mem / GiB:.1f} GiB on its busiest pipeline rank, {(mem - cap) / GiB:.1f} GiB over the "
            f"{cap / GiB:.0f} GiB per GPU"
            + (f" left after its {reserve:.2f} GiB memory reserve." if reserved else ".")
        )
    msg += (
        " To make it fit: use more GPUs (--nodes), allow ZeRO-3/FSDP and full recomputation (unpin "
        "--zero-stage/--recompute), a smaller micro-batch size, or a GPU with more memory"
        + (" (or a smaller --memory-reserve)." if reserved else ".")
    )
    return msg
