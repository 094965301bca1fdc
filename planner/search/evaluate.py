"""One fixed partition evaluated under the cost model: what the ILP optimises and the simulator reports.

Below both the ILP (which scores its start solutions with `evaluate`) and the outer search. Two figures:
`Evaluated.objective`, the linear (closed-form) objective the ILP minimises, and `Evaluated.reported`, the
iteration time the plan reports (the simulated pipeline plus the same tail), which the search ranks by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost.model import (
    Candidate,
    StageCost,
    iteration_linear,
    rank_memory,
    rank_tail,
    stage_costs,
    stage_time_with_gathers,
)
from planner.cost.simulate import SimResult, simulate
from planner.names import SearchStatus
from planner.search.problem import PartitionProblem


@dataclass
class Evaluated:
    cand: Candidate
    partition: list[list[int]]
    recompute: list[str]
    stages: list[StageCost]
    objective: float
    rank_memory: dict[int, float]
    tail: float  # the slowest rank's exposed gradient sync plus optimizer step, after the pipeline drains
    status: SearchStatus = "optimal"
    # per stage, its first blocks recomputed fully (Megatron-LM's block method, `planner.search.blocks`); empty: none
    full_blocks: list[int] = field(default_factory=list)
    sim: SimResult | None = field(default=None, repr=False, compare=False)  # simulate_evaluated's, cached

    @property
    def reported(self) -> float:
        """The iteration time plan.json and the report show: simulated pipeline plus the tail
        (`planner.pipeline.predicted_for`). The search ranks by it."""
        return simulated_time(self) + self.tail


def evaluate(
    pb: PartitionProblem, partition: list[list[int]], recompute: list[str], full_blocks: list[int] | None = None
) -> Evaluated:
    """The cost model's figures for a fixed partition (what the ILP optimises, recomputed directly); `full_blocks`:
    per stage, its first blocks recomputed fully (`planner.cost.model.stage_costs`; the ILP's plans have none)."""
    out = evaluate_fitting(pb, partition, recompute, capacity=None, full_blocks=full_blocks)
    assert out is not None
    return out


def evaluate_fitting(
    pb: PartitionProblem,
    partition: list[list[int]],
    recompute: list[str],
    capacity: float | None,
    full_blocks: list[int] | None = None,
) -> Evaluated | None:
    """`evaluate`, or None where a rank's memory exceeds `capacity` (its times then not computed: the
    brute-force references go through every partition, most of which do not fit)."""
    cand, cluster, options, dtype = pb.cand, pb.cluster, pb.options, pb.dtype
    blocks = full_blocks if full_blocks and any(full_blocks) else None
    stages = stage_costs(pb.graph, cluster, cand, partition, recompute, pb.costs, options, pb.stage_memo, blocks)
    memory = rank_memory(stages, cand, options)
    if capacity is not None and max(memory.values()) > capacity:
        return None
    tail = rank_tail(stages, cand, options, cluster, dtype)
    obj = iteration_linear(stages, cand, options, cluster, dtype, tail)
    ev = Evaluated(cand, partition, recompute, stages, obj, memory, tail)
    if blocks is not None:
        ev.full_blocks = list(blocks)
    return ev


def simulate_evaluated(ev: Evaluated) -> SimResult:
    """Discrete-event simulation of an evaluated partition's pipeline (the figure the plan reports)."""
    if ev.sim is not None:
        return ev.sim
    c = ev.cand
    fwd = [st.fwd for st in ev.stages]
    bwd = [stage_time_with_gathers(st) - st.fwd for st in ev.stages]
    p2p = [st.p2p for st in ev.stages[:-1]] + [0.0]
    ev.sim = simulate(c.schedule, c.pp, c.num_micro_batches, c.virtual_stages, fwd, bwd, None, p2p)
    return ev.sim


def simulated_time(ev: Evaluated) -> float:
    """The simulated iteration time of an evaluated partition."""
    return simulate_evaluated(ev).iteration_time
