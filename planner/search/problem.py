"""One candidate's partition problem: the inputs every bound, form and solver of a stage partition reads.

`PartitionProblem` carries the model, the cluster, the candidate, its unit costs, the recomputation modes
searched and the cost options, and derives once (cached properties) what several steps share: the
whole-model `Totals`, the `IntervalTables` over unit intervals, the run of identical blocks (`run`) and
the pp rank of each stage (`ranks`). It is passed as the one argument through `planner.search.bounds`,
`planner.search.ilp`, `planner.search.pathbound`, `planner.search.reference` and `evaluate`, as PyTorch's
autoparallel keeps its problem on one `ShardingOptimizer`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from planner.cost.memory import model_state_bytes_per_param
from planner.cost.model import Candidate, CostOptions, StageCost, UnitCost
from planner.cost.placement import stage_rank
from planner.cost.schedules import in_flight_microbatches
from planner.cost.terms import (
    comm_buffer_bytes,
    linear_form,
    memory_budget,
    model_state_bytes,
    rank_capacity,
    zero3_gather_time,
)
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.names import SEARCHED_RECOMPUTE_MODES

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
Run = tuple[int, int, int]


@dataclass(frozen=True, eq=False)
class PartitionProblem:
    """The stage partition (and recomputation) problem of one candidate. Frozen: the derived properties
    are computed at most once. `shared_totals`: the `Totals` of another problem with the same costs and
    modes, when the caller has them (the search shares them over candidates of one (tp, mbs, sp))."""

    graph: ModelGraph
    cluster: ClusterSpec
    cand: Candidate
    costs: list[UnitCost]
    # the recomputation modes a solver chooses from (evaluate reads none)
    modes: tuple[str, ...] = SEARCHED_RECOMPUTE_MODES
    options: CostOptions = field(default_factory=CostOptions)
    shared_totals: Totals | None = field(default=None, repr=False)

    @property
    def dtype(self) -> str:
        return self.graph.source.dtype

    @property
    def capacity(self) -> float:
        """The bytes a rank may use (`terms.rank_capacity`)."""
        return rank_capacity(self.cluster, self.cand)

    @functools.cached_property
    def stage_memo(self) -> dict[tuple[int, tuple[int, ...], str, int, bool], StageCost]:
        """Stage figures computed so far for this problem (`planner.cost.model.stage_costs`'s `memo`): the
        partitions a solver or the brute force evaluates share most of their stages."""
        return {}

    @functools.cached_property
    def totals(self) -> Totals:
        return self.shared_totals or Totals.of(self.costs, self.modes)

    @functools.cached_property
    def tables(self) -> IntervalTables:
        return IntervalTables.of(self)

    @functools.cached_property
    def run(self) -> Run | None:
        """The single run of identical blocks (`block_run`), None when the units are not transformer-shaped."""
        return block_run(self.graph)

    @functools.cached_property
    def stage_ok(self) -> BoolArray | None:
        """[i, j]: whether units i..j-1 may form a stage after the first (`zero_bubble_stages`) under zero-bubble;
        None where every interval may (any other schedule, one stage, or a model that needs no rule)."""
        if self.cand.schedule != "zero-bubble" or self.cand.stages == 1:
            return None
        return zero_bubble_stages(self.graph)

    def stages_ok(self, partition: list[list[int]]) -> bool:
        """Whether every stage of a partition after the first may hold its units (`stage_ok`)."""
        ok = self.stage_ok
        return ok is None or all(bool(ok[units[0], units[-1] + 1]) for units in partition[1:] if units)

    @functools.cached_property
    def ranks(self) -> list[int]:
        """The pp rank of each stage."""
        c = self.cand
        return [stage_rank(c.schedule, c.pp, c.virtual_stages, s) for s in range(c.stages)]

    def with_costs(self, cand: Candidate, costs: list[UnitCost]) -> PartitionProblem:
        """The same model, cluster, modes and options for another candidate and its costs."""
        return PartitionProblem(self.graph, self.cluster, cand, costs, self.modes, self.options)


@dataclass(frozen=True)
class Totals:
    """Whole-model sums of unit costs that the simple bound needs (shared by candidates with the same
    tp, micro-batch size and sequence parallelism)."""

    work: float  # forward + cheapest backward
    fwd: float
    params: float
    sync: float  # parameters as the data-parallel ring counts them (`UnitCost.sync_params`)
    act: float  # cheapest activation bytes per micro-batch
    bwd_max: float  # most expensive backward (the widest overlap window)

    @classmethod
    def of(cls, costs: list[UnitCost], modes: tuple[str, ...]) -> Totals:
        return cls(
            work=sum(c.fwd + min(c.bwd[r] for r in modes) for c in costs),
            fwd=sum(c.fwd for c in costs),
            params=sum(c.params_local for c in costs),
            sync=sum(c.sync_params for c in costs),
            act=sum(min(c.act[r] for r in modes) for c in costs),
            bwd_max=sum(max(c.bwd.values()) for c in costs),
        )



def gather_coefficients(cand: Candidate, cluster: ClusterSpec, dtype: str) -> tuple[float, float] | None:
    """(g, c): a stage's ZeRO-3 weight gathers per micro-batch take g * params + c, the linear form of
    `planner.cost.terms.zero3_gather_time`; None without ZeRO-3 over more than one replica."""
    if cand.zero_stage != 3 or cand.dp_shard <= 1:
        return None
    return linear_form(lambda x: zero3_gather_time(x, cand, cluster, dtype))


def prefix_sums(xs: list[float]) -> FloatArray:
    """[0, x0, x0 + x1, ...]: the sum over units i..j-1 is out[j] - out[i]."""
    out: FloatArray = np.concatenate([[0.0], np.cumsum(xs)])
    return out


@dataclass
class IntervalTables:
    """Per unit interval [i, j) (matrices indexed [i, j]): time per mode, forward time, ZeRO-3 gathers,
    and with one stage per rank whether the ILP's memory row fits at stage s in mode r."""

    t: dict[str, np.ndarray]
    fwd: np.ndarray
    gather: np.ndarray
    valid: np.ndarray  # j > i
    mem_ok: dict[tuple[int, str], np.ndarray]

    @classmethod
    def of(cls, pb: PartitionProblem) -> IntervalTables:
        graph, costs, cand, cluster, options, modes = pb.graph, pb.costs, pb.cand, pb.cluster, pb.options, pb.modes
        U, S, p, m = len(costs), cand.stages, cand.pp, cand.num_micro_batches
        dtype = pb.dtype

        def span(c: FloatArray) -> FloatArray:  # span[i, j] = sum over units i..j-1
            out: FloatArray = c[None, :] - c[:, None]
            return out

        params = span(prefix_sums([c.params_local for c in costs]))
        act = {r: span(prefix_sums([c.act[r] for c in costs])) for r in modes}
        gc = gather_coefficients(cand, cluster, dtype)
        synced = span(prefix_sums([c.sync_params for c in costs]))
        gather = gc[0] * synced + gc[1] if gc is not None else np.zeros_like(params)
        mem_ok: dict[tuple[int, str], BoolArray] = {}
        if cand.virtual_stages == 1:
            state = model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp_shard)
            budget = memory_budget(rank_capacity(cluster, cand), options)
            largest = max(c.largest_param_bytes for c in costs)
            out_bytes = np.array([0.0] + [u.output_bytes for u in graph.units])  # [j]: unit j-1's output
            for s in range(S):
                k = in_flight_microbatches(cand.schedule, p, m, 1, s)
                buf = comm_buffer_bytes(out_bytes[None, :] if s < S - 1 else 0.0, cand, options, largest)
                for r in modes:
                    mem_ok[s, r] = model_state_bytes(params, state) + buf + k * act[r] <= budget
        return cls(
            t={r: span(prefix_sums([c.fwd + c.bwd[r] for c in costs])) for r in modes},
            fwd=span(prefix_sums([c.fwd for c in costs])),
            gather=gather,
            valid=np.triu(np.ones((U + 1, U + 1), dtype=bool), 1),
            mem_ok=mem_ok,
        )



def zero_bubble_stages(graph: ModelGraph) -> BoolArray | None:
    """[i, j]: whether units i..j-1 can form a pipeline stage after the first under zero-bubble; None where all
    can (no unit records a `Unit.grad_meet`).

    Zero-bubble splits the backward of each stage but the first in two, and its weight step (torch's
    `stage_backward_weight`) gets a weight's gradient only where the weight's part of the autograd graph meets
    the part that starts at the stage's inputs, the values earlier stages computed (`get_param_groups`). A stage
    that starts at unit i and holds unit u up to unit j-1 gives u's weights their gradients where they meet the
    values of a unit before i inside the stage: `grad_meet[j-1-u] < i`. Otherwise the weight is left without its
    gradient (CLIP's text tower in a stage after the first, unless the stage reaches the logits that join it to
    the image tower; T5's decoder embedding at a stage's end). The plan-time check runs torch's own split
    backward and refuses such a stage (`planner.runtime.check`); this lets the search leave them out. It reads
    the model per node of the traced graph and takes a read of an earlier unit's value as a meeting, so it
    refuses no stage the check passes (the check refuses the rest)."""
    key = tuple(tuple(u.grad_meet) for u in graph.units)
    return _zero_bubble_stages(key) if any(key) else None


@functools.lru_cache(maxsize=8)
def _zero_bubble_stages(key: tuple[tuple[int, ...], ...]) -> BoolArray:
    U = len(key)
    ok = np.ones((U + 1, U + 1), dtype=bool)
    starts = np.arange(U + 1)
    for u, row in enumerate(key):
        if not row:
            continue
        meet = np.asarray(row)  # meet[j - 1 - u]: the stage ends before unit j (j = u+1..U)
        # a stage [i, j) holds u where i <= u < j: refused where the weights meet nothing from before i
        bad = meet[None, :] >= starts[: u + 1, None]  # [i, j - 1 - u]
        ok[: u + 1, u + 1 :] &= ~bad
    return ok


def block_run(graph: ModelGraph) -> Run | None:
    """(start, end, number of units) of the single run of identical units, when units are pre? run post?."""
    sigs = [u.signature for u in graph.units]
    n = len(sigs)
    best = None
    i = 0
    while i < n:
        j = i
        while j + 1 < n and sigs[j + 1] == sigs[i]:
            j += 1
        if best is None or (j - i) > (best[1] - best[0]):
            best = (i, j)
        i = j + 1
    if best is None:
        return None
    start, end = best
    if start > 1 or end < n - 2 or end - start + 1 < 2:
        return None
    return start, end, n
