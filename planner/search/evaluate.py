"""One fixed partition evaluated under the cost model: what the ILP optimises and the simulator reports.

Below both the ILP (which scores its start solutions with `evaluate`) and the outer search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost.model import Candidate, CostOptions, StageCost, UnitCost, iteration_linear, rank_memory, stage_costs
from planner.cost.simulate import SimResult, simulate
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.names import SearchStatus


@dataclass
class Evaluated:
    cand: Candidate
    partition: list[list[int]]
    recompute: list[str]
    stages: list[StageCost]
    objective: float
    rank_memory: dict[int, float]
    status: SearchStatus = "optimal"
    sim: SimResult | None = field(default=None, repr=False, compare=False)  # simulate_evaluated's, cached


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


def simulate_evaluated(ev: Evaluated) -> SimResult:
    """Discrete-event simulation of an evaluated partition's pipeline (the figure the plan reports)."""
    if ev.sim is not None:
        return ev.sim
    c = ev.cand
    fwd = [st.fwd for st in ev.stages]
    bwd = [max(st.compute, st.zero3_gather) - st.fwd for st in ev.stages]
    p2p = [st.p2p for st in ev.stages[:-1]] + [0.0]
    ev.sim = simulate(c.schedule, c.pp, c.num_micro_batches, c.virtual_stages, fwd, bwd, None, p2p)
    return ev.sim


def simulated_time(ev: Evaluated) -> float:
    """The simulated iteration time of an evaluated partition."""
    return simulate_evaluated(ev).iteration_time
