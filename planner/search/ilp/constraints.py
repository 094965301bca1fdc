"""The ILP's constraint families and objective, one function each (the package docstring states them in
math). Each takes the problem and the stages' expressions (`forms.StageExprs`) and adds its rows; the
times and bytes come from `planner.cost.terms`, so the ILP optimises the cost model's own formulas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulp

from planner.cost.memory import model_state_bytes_per_param
from planner.cost.schedules import rank_stage_counts
from planner.cost.terms import (
    comm_buffer_bytes,
    comm_reserve_bytes,
    dp_sync_time,
    model_state_bytes,
    optimizer_step_time,
    p2p_time,
    pipeline_time,
    rank_peak_bytes,
    sync_overlap_window,
    zero3_gather_time,
)
from planner.search.bounds import BlockBounds, IntervalBounds
from planner.search.ilp.forms import CountForm, ModeVars, StageExprs
from planner.search.problem import PartitionProblem

# Memory rows in GiB: byte-sized coefficients (1e10) next to second-sized ones (1e-3) make CBC's presolve
# declare feasible models infeasible.
MEM_SCALE = 1.0 / 2**30
# Valid cuts are relaxed by this factor so that rounding can never cut off the optimum.
RELAX = 1 - 1e-12


@dataclass
class Maxima:
    """The epigraph variables of the objective's maxima (0.0 where the schedule has none)."""

    T: list[Any]  # per stage: max(total time, ZeRO-3 gathers)
    Z: Any  # largest stage time
    Y: Any = 0.0  # largest rank time (several stages per rank)
    F: Any = 0.0  # largest stage forward (zero-bubble)


def add_mode_choice(prob: pulp.LpProblem, pb: PartitionProblem) -> ModeVars:
    """y[s, r] binary, sum_r y[s, r] = 1; with several stages per rank y[s, r] = y[0, r]."""
    cand, modes = pb.cand, pb.modes
    mode_vars: ModeVars = {}
    for s in range(cand.stages):
        for r in modes:
            mode_vars[s, r] = pulp.LpVariable(f"y_{s}_{r}", cat="Binary")
        prob += pulp.lpSum(mode_vars[s, r] for r in modes) == 1
        if cand.virtual_stages > 1 and s > 0:
            # Several stages per rank: one recomputation mode for all of them (the per-stage choice
            # multiplies equivalent optima that CBC cannot prune on interleaved and V schedules).
            for r in modes:
                prob += mode_vars[s, r] == mode_vars[0, r]
    return mode_vars


def add_stage_maxima(prob: pulp.LpProblem, ex: StageExprs, pb: PartitionProblem) -> Maxima:
    """T_s >= tot_s, T_s >= gather_s (ZeRO-3), Z >= T_s, and the aggregate cut S Z >= sum_s T_s."""
    cand, cluster, dtype = pb.cand, pb.cluster, pb.dtype
    S = cand.stages
    has_gather = cand.zero_stage == 3 and cand.dp_shard > 1
    T = [pulp.LpVariable(f"T_{s}", lowBound=0) for s in range(S)]
    for s in range(S):
        prob += T[s] >= ex.tot[s]
        if has_gather:
            prob += T[s] >= zero3_gather_time(ex.sync[s], cand, cluster, dtype)
    Z = pulp.LpVariable("Tmax", lowBound=0)
    for s in range(S):
        prob += Z >= T[s]
    # Aggregate cut (implied, but it tightens the LP relaxation): the max is at least the mean.
    prob += S * Z >= pulp.lpSum(T)
    return Maxima(T, Z)


def add_symmetry_breaking(prob: pulp.LpProblem, form: CountForm, pb: PartitionProblem) -> None:
    """Count form, several stages per rank: blocks(a) >= blocks(b) for consecutive block-only stages a < b
    of one rank, neither the rank's first (whose backward hides the gradient sync): swapping their
    contents changes no term."""
    cand, ranks, modes = pb.cand, pb.ranks, pb.modes
    S = cand.stages
    for r in range(cand.pp):
        mine = [s for s in range(S) if ranks[s] == r]
        free = [s for s in mine if s not in (0, S - 1, min(mine))]
        for a, b in zip(free, free[1:]):
            prob += form.blocks(a, modes) >= form.blocks(b, modes)


def add_stage_cuts(
    prob: pulp.LpProblem,
    mx: Maxima,
    bounds: BlockBounds | IntervalBounds,
    pb: PartitionProblem,
    mode_vars: ModeVars,
) -> None:
    """Z >= the bound's least largest stage (per mode with several stages per rank, modes that cannot fit
    memory excluded: y[0, r] = 0)."""
    cand, modes = pb.cand, pb.modes
    allowed = bounds.rank_max if isinstance(bounds, BlockBounds) else bounds.stage_max
    if cand.virtual_stages == 1:
        prob += mx.Z >= min(bounds.stage_max.values()) * RELAX
        return
    for r in modes:
        if r not in allowed:
            prob += mode_vars[0, r] == 0
    prob += mx.Z >= pulp.lpSum(mode_vars[0, r] * bounds.stage_max[r] * RELAX for r in modes if r in bounds.stage_max)


def add_rank_maxima(
    prob: pulp.LpProblem, mx: Maxima, ex: StageExprs, pb: PartitionProblem, bb: BlockBounds | None, mode_vars: ModeVars
) -> None:
    """Interleaved and zero-bubble: Y >= sum_{s on r} T_s, p Y >= sum_s T_s; zero-bubble F >= fwd_s; with
    the block bound's cuts on Y and F."""
    cand, ranks, modes = pb.cand, pb.ranks, pb.modes
    if cand.schedule in ("gpipe", "1f1b"):
        return
    S = cand.stages
    mx.Y = Y = pulp.LpVariable("Trank", lowBound=0)
    for r in range(cand.pp):
        prob += Y >= pulp.lpSum(mx.T[s] for s in range(S) if ranks[s] == r)
    prob += cand.pp * Y >= pulp.lpSum(mx.T)
    if bb is not None:
        prob += Y >= pulp.lpSum(mode_vars[0, r] * bb.rank_max[r] * RELAX for r in modes if r in bb.rank_max)
    if cand.schedule == "zero-bubble":
        mx.F = F = pulp.LpVariable("Fmax", lowBound=0)
        for s in range(S):
            prob += F >= ex.fwd[s]
        if bb is not None:
            prob += F >= pulp.lpSum(mode_vars[0, r] * bb.fwd_max[r] * RELAX for r in modes if r in bb.fwd_max)


def add_tail(prob: pulp.LpProblem, ex: StageExprs, pb: PartitionProblem) -> Any:
    """tail >= e_r + step_r, e_r >= sum_{s on r} sync_s - window(first stage of r), e_r >= 0; the cut
    tail >= the optimizer step of the unit with the most parameters. Returns the tail variable."""
    cand, cluster, options, dtype, ranks, costs = pb.cand, pb.cluster, pb.options, pb.dtype, pb.ranks, pb.costs
    S = cand.stages
    tail = pulp.LpVariable("tail", lowBound=0)
    for r in range(cand.pp):
        mine = [s for s in range(S) if ranks[s] == r]
        first = min(mine)
        exposed = pulp.LpVariable(f"exposed_{r}", lowBound=0)
        window = sync_overlap_window(ex.tot[first] - ex.fwd[first], cand, options)
        prob += exposed >= pulp.lpSum(dp_sync_time(ex.sync[s], cand, cluster, dtype) for s in mine) - window
        prob += tail >= exposed + optimizer_step_time(pulp.lpSum(ex.params[s] for s in mine), cand, cluster, dtype)
    # Valid cut: some rank holds the unit with the most parameters, and steps its optimizer.
    largest_step = optimizer_step_time(max(c.params_local for c in costs), cand, cluster, dtype)
    prob += tail >= largest_step * RELAX
    return tail


def add_joint_cut(
    prob: pulp.LpProblem, mx: Maxima, tail: Any, bb: BlockBounds, pb: PartitionProblem, mode_vars: ModeVars
) -> None:
    """The block bound's joint minimum of the maxima terms plus the tail: (m-1) Z + tail >= J (one stage
    per rank), m Y + (p-1) Z|F + tail >= sum_r y[0, r] J_r (several)."""
    cand, modes = pb.cand, pb.modes
    if cand.virtual_stages == 1:
        prob += (cand.num_micro_batches - 1) * mx.Z + tail >= min(bb.joint.values()) * RELAX
        return
    last = mx.Z if cand.schedule == "interleaved-1f1b" else mx.F
    prob += cand.num_micro_batches * mx.Y + (cand.pp - 1) * last + tail >= pulp.lpSum(
        mode_vars[0, r] * bb.joint[r] * RELAX for r in modes if r in bb.joint
    )


def objective(mx: Maxima, tail: Any, ex: StageExprs, pb: PartitionProblem) -> Any:
    """`terms.pipeline_time` on (sum_s T_s, Z, Y, F, sum_s p2p_s) plus the tail: the cost model's
    `iteration_linear` with its maxima replaced by their epigraph variables."""
    cand, cluster = pb.cand, pb.cluster
    p2p = [p2p_time(ex.boundary[s], cand, cluster) for s in range(cand.stages - 1)]
    return pipeline_time(cand, pulp.lpSum(mx.T), mx.Z, mx.Y, mx.F, pulp.lpSum(p2p)) + tail


def add_memory(prob: pulp.LpProblem, ex: StageExprs, pb: PartitionProblem) -> None:
    """Per rank r and each of its peak instants c (`rank_stage_counts`): rank_peak_bytes(sum_{s on r} states_s +
    buffers_s, sum_{s on r} c_s act_s) + the NCCL buffers of the candidate's process groups
    (`terms.comm_reserve_bytes`) <= capacity, act_s the stage's activations per micro-batch (`cost.model.rank_memory`
    as a linear row)."""
    cand, cluster, options, ranks, costs = pb.cand, pb.cluster, pb.options, pb.ranks, pb.costs
    state = model_state_bytes_per_param(pb.dtype, cand.zero_stage, cand.dp_shard)
    S = cand.stages
    largest = max(c.largest_param_bytes for c in costs)
    cap = cluster.gpu.memory_bytes
    for r in range(cand.pp):
        mine = [s for s in range(S) if ranks[s] == r]
        states = pulp.lpSum(
            model_state_bytes(ex.params[s], state)
            + comm_buffer_bytes(ex.boundary[s] if s < S - 1 else 0.0, cand, options, largest)
            for s in mine
        )
        nccl = comm_reserve_bytes(cluster.nccl_bytes_per_group, cand)
        # one row per instant that can be the rank's peak (`rank_stage_counts`; one stage per rank: its own)
        for counts in rank_stage_counts(cand.schedule, cand.pp, cand.num_micro_batches, cand.virtual_stages, r):
            acts = pulp.lpSum(c * ex.act[s] for c, s in zip(counts, mine))
            prob += (rank_peak_bytes(states, acts, options) + nccl) * MEM_SCALE <= cap * MEM_SCALE
