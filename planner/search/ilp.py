"""The stage-partition ILP (PuLP + CBC) for one candidate of outer degrees.

Variables choose, together, the contiguous partition of units into the candidate's p*v stages and each
stage's activation recomputation, under per-rank memory capacity (which depends on the stage's place in
the schedule through its in-flight micro-batches), minimising `planner.cost.model.iteration_linear`:
the schedule's fill-drain iteration time plus the exposed data-parallel sync and optimizer step.

Three encodings of the same model:
- count form, when the units are [prefix?] + a run of identical blocks + [suffix?] (transformers): the
  prefix is always in stage 0 and the suffix in the last stage, so the partition is exactly the number of
  blocks per stage and recomputation mode: O(stages) integer variables however many layers there are;
- interval form, for any other unit sequence while it stays small: one binary per (stage, interval of
  units, mode), the stages a path from the first unit to the last (flow conservation), whose LP
  relaxation is the convex hull of the partitions;
- assignment form otherwise: binary unit-to-stage variables with prefix-sum contiguity constraints.
Maxima in the objective are linearised with epigraph variables (exact, since they are minimised).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import pulp

from planner.cost import collectives as coll
from planner.cost.memory import model_state_bytes_per_param
from planner.cost.model import (
    Candidate,
    CostOptions,
    UnitCost,
    p2p_link,
)
from planner.cost.schedules import in_flight_microbatches, rank_in_flight_microbatches, stage_rank
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.search.bounds import (
    BlockBounds,
    IntervalBounds,
    IntervalTables,
    Totals,
    block_bound,
    comm_bound,
    gather_coefficients,
    interval_bound,
    interval_vars,
    tail_bound,
    tail_coefficients,
)
from planner.search.evaluate import evaluate

log = logging.getLogger(__name__)
OBJ_SCALE = 1e6
# Memory rows in GiB: byte-sized coefficients (1e10) next to second-sized ones (1e-3) make CBC's presolve
# declare feasible models infeasible.
MEM_SCALE = 1.0 / 2**30
# The interval form has one binary per (stage, unit interval, mode): used while that stays small.
MAX_INTERVAL_VARS = 20_000


@dataclass
class ILPResult:
    status: str  # "optimal" | "infeasible" | "time_limit" | "not_solved"
    objective: float | None
    partition: list[list[int]] | None
    recompute: list[str] | None
    gap: float = 0.0
    form: str = ""
    # the balanced partition used as CBC's incumbent, when there was one (partition, recompute)
    start: tuple[list[list[int]], list[str]] | None = None


def block_run(graph: ModelGraph) -> tuple[int, int, int] | None:
    """(start, end, has_prefix...) of the single run of identical units, when units are pre? run post?."""
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


def _lin(terms) -> pulp.LpAffineExpression:
    return pulp.lpSum(terms)


def solve_partition(
    graph: ModelGraph,
    cluster: ClusterSpec,
    cand: Candidate,
    costs: list[UnitCost],
    modes: tuple[str, ...],
    options: CostOptions,
    time_limit: float | None = None,
    force_form: str | None = None,
    max_nodes: int | None = None,
    cutoff: float | None = None,
    cuts: bool = True,
    bounds: BlockBounds | IntervalBounds | None = None,
) -> ILPResult:
    """Solve the partition + recomputation ILP of one candidate exactly (or to the time limit).

    `cutoff`: only solutions with an objective below it are wanted (the search passes the k-th best plan
    so far); when none exists the status is "cutoff". `cuts`: add the valid integer bounds of
    `planner.search.bounds.block_bound` on the maxima (count form), which close most of the LP gap;
    `bounds`: that function's result when the caller has it already.
    """
    U = len(graph.units)
    S = cand.stages
    if S > U:
        return ILPResult("infeasible", None, None, None)
    if S == 1:
        return _single_stage(graph, cluster, cand, costs, modes, options)
    run = block_run(graph)
    form = force_form or ("count" if run is not None else None)
    if form == "count" and run is None:
        form = "assign"
    dtype = graph.source.dtype
    ib = None
    start_sol = None
    if form != "count":
        # Any unit sequence: the interval bound (cut and start), then the intervals an optimal plan can use.
        given = bounds if isinstance(bounds, IntervalBounds) else None
        tables = (
            given.tables if given and given.tables else IntervalTables.of(graph, costs, cand, cluster, options, modes)
        )
        if cuts:
            ib = given or interval_bound(graph, costs, cand, cluster, options, modes, tables)
            if ib is None:
                return ILPResult("infeasible", None, None, None, form=form or "interval")
            start_sol = _best_start(graph, cluster, cand, costs, options, ib.starts)
        limits = [v for v in (cutoff, start_sol[2] if start_sol else None) if v is not None]
        tot_ = Totals.of(costs, modes)
        work = tot_.work if cand.v == 1 else cand.m * tot_.work / cand.pp
        rest = work + comm_bound(graph, cand, cluster) + tail_bound(tot_, cand, cluster, dtype, options)
        ivars = interval_vars(tables, cand, modes, U, min(limits) if limits else None, rest)
        if not all(ivars.values()):
            return ILPResult(
                "cutoff" if cutoff is not None else "infeasible", None, None, None, form=form or "interval"
            )
        if form is None:
            form = "interval" if sum(len(v) for v in ivars.values()) <= MAX_INTERVAL_VARS else "assign"

    prob = pulp.LpProblem("partition", pulp.LpMinimize)
    state = model_state_bytes_per_param(dtype, cand.zero, cand.dp)
    cap = cluster.gpu.memory_bytes
    frag = 1 + options.fragmentation

    # Per stage s: linear expressions of the stage's quantities.
    fwd = [None] * S
    tot = [None] * S
    params = [None] * S
    act = [None] * S  # activation bytes per micro-batch
    boundary = [None] * S  # bytes of the stage's outgoing boundary tensor (per sample)
    mode_vars: dict[tuple[int, str], pulp.LpVariable] = {}
    for s in range(S):
        for r in modes:
            mode_vars[s, r] = pulp.LpVariable(f"y_{s}_{r}", cat="Binary")
        prob += pulp.lpSum(mode_vars[s, r] for r in modes) == 1
        if cand.v > 1 and s > 0:
            # Several stages per rank: one recomputation mode for all of them (the per-stage choice
            # multiplies equivalent optima that CBC cannot prune on interleaved and V schedules).
            for r in modes:
                prob += mode_vars[s, r] == mode_vars[0, r]

    bb = None
    has_blocks = None
    if form == "count":
        start, end, n = run
        L = end - start + 1
        blk = costs[start]
        if cuts:
            bb = (
                bounds
                if isinstance(bounds, BlockBounds)
                else block_bound(graph, costs, cand, cluster, options, modes, run)
            )
            if bb is None:
                return ILPResult("infeasible", None, None, None, form=form)
        pre = list(range(0, start))
        post = list(range(end + 1, n))
        cnt = {
            (s, r): pulp.LpVariable(f"n_{s}_{r}", lowBound=0, upBound=L, cat="Integer") for s in range(S) for r in modes
        }
        for s in range(S):
            for r in modes:
                prob += cnt[s, r] <= L * mode_vars[s, r]
        prob += pulp.lpSum(cnt.values()) == L
        for s in range(S):
            holds = []
            if s == 0:
                holds += pre
            if s == S - 1:
                holds += post
            blocks = pulp.lpSum(cnt[s, r] for r in modes)
            if not holds:
                prob += blocks >= 1
            fixed = [costs[u] for u in holds]
            fwd[s] = blocks * blk.fwd + sum(c.fwd for c in fixed)
            tot[s] = _lin(
                [cnt[s, r] * (blk.fwd + blk.bwd[r]) for r in modes]
                + [mode_vars[s, r] * (c.fwd + c.bwd[r]) for r in modes for c in fixed]
            )
            params[s] = blocks * blk.params_local + sum(c.params_local for c in fixed)
            act[s] = _lin(
                [cnt[s, r] * blk.act[r] for r in modes] + [mode_vars[s, r] * c.act[r] for r in modes for c in fixed]
            )
            if s < S - 1:
                b = pulp.LpVariable(f"bnd_{s}", lowBound=0)
                out_blk = graph.units[start].output_bytes
                if s == 0 and pre:
                    has = has_blocks = pulp.LpVariable("has_blocks_0", cat="Binary")
                    prob += has <= blocks
                    prob += blocks <= L * has
                    prob += b >= out_blk * has
                    prob += b >= graph.units[pre[-1]].output_bytes * (1 - has)
                else:
                    prob += b >= out_blk
                boundary[s] = b
    if form == "interval":
        # x[s, i, j, r]: stage s holds units i..j-1 in mode r. The stages form a path from unit 0 to U
        # (flow conservation), whose LP relaxation is the convex hull of the partitions.
        pre = lambda xs: [0.0, *itertools.accumulate(xs)]  # noqa: E731
        c_fwd = pre(c.fwd for c in costs)
        c_par = pre(c.params_local for c in costs)
        c_tot = {r: pre(c.fwd + c.bwd[r] for c in costs) for r in modes}
        c_act = {r: pre(c.act[r] for c in costs) for r in modes}
        x = {
            (s, i, j, r): pulp.LpVariable(f"x_{s}_{i}_{j}_{r}", cat="Binary") for s in range(S) for i, j, r in ivars[s]
        }
        for s in range(S):
            for r in modes:
                prob += pulp.lpSum(x[s, i, j, q] for i, j, q in ivars[s] if q == r) == mode_vars[s, r]
        for s in range(S - 1):
            for k in range(1, U):
                into = [x[s, i, j, r] for i, j, r in ivars[s] if j == k]
                out = [x[s + 1, i, j, r] for i, j, r in ivars[s + 1] if i == k]
                if into or out:
                    prob += pulp.lpSum(into) == pulp.lpSum(out)
        for s in range(S):
            xs = [(i, j, r, x[s, i, j, r]) for i, j, r in ivars[s]]
            fwd[s] = _lin([v * (c_fwd[j] - c_fwd[i]) for i, j, r, v in xs])
            tot[s] = _lin([v * (c_tot[r][j] - c_tot[r][i]) for i, j, r, v in xs])
            params[s] = _lin([v * (c_par[j] - c_par[i]) for i, j, r, v in xs])
            act[s] = _lin([v * (c_act[r][j] - c_act[r][i]) for i, j, r, v in xs])
            if s < S - 1:
                boundary[s] = _lin([v * graph.units[j - 1].output_bytes for i, j, r, v in xs])
    elif form == "assign":
        z = {(u, s): pulp.LpVariable(f"z_{u}_{s}", cat="Binary") for u in range(U) for s in range(S)}
        w = {
            (u, s, r): pulp.LpVariable(f"w_{u}_{s}_{r}", cat="Binary")
            for u in range(U)
            for s in range(S)
            for r in modes
        }
        for u in range(U):
            prob += pulp.lpSum(z[u, s] for s in range(S)) == 1
            for s in range(S):
                prob += pulp.lpSum(w[u, s, r] for r in modes) == z[u, s]
                for r in modes:
                    prob += w[u, s, r] <= mode_vars[s, r]
        # contiguity in order: prefix sums over stages never increase from one unit to the next
        for u in range(U - 1):
            for s in range(S - 1):
                prob += pulp.lpSum(z[u + 1, k] for k in range(s + 1)) <= pulp.lpSum(z[u, k] for k in range(s + 1))
        for s in range(S):
            prob += pulp.lpSum(z[u, s] for u in range(U)) >= 1
        prob += z[0, 0] == 1
        for s in range(S):
            fwd[s] = _lin([z[u, s] * costs[u].fwd for u in range(U)])
            tot[s] = _lin([w[u, s, r] * (costs[u].fwd + costs[u].bwd[r]) for u in range(U) for r in modes])
            params[s] = _lin([z[u, s] * costs[u].params_local for u in range(U)])
            act[s] = _lin([w[u, s, r] * costs[u].act[r] for u in range(U) for r in modes])
            if s < S - 1:
                b = pulp.LpVariable(f"bnd_{s}", lowBound=0)
                for u in range(U):
                    nxt = z[u + 1, s] if u + 1 < U else 0
                    prob += b >= graph.units[u].output_bytes * (z[u, s] - nxt)
                boundary[s] = b

    # Communication terms (linear in bytes; latency constants as in planner.cost.collectives).
    p2p_bw, p2p_lat = p2p_link(cand, cluster)
    p2p_scale = cand.mbs / (cand.tp if cand.sp else 1) / p2p_bw
    p2p = [p2p_lat + boundary[s] * p2p_scale for s in range(S - 1)]
    n_dp = cand.dp
    a_sync, c_sync, opt_rate = tail_coefficients(cand, cluster, dtype)
    sync = [a_sync * params[s] + c_sync for s in range(S)] if n_dp > 1 else [0] * S
    gc = gather_coefficients(cand, cluster, dtype)
    gather = [gc[0] * params[s] + gc[1] for s in range(S)] if gc is not None else [0] * S

    T = [pulp.LpVariable(f"T_{s}", lowBound=0) for s in range(S)]
    for s in range(S):
        prob += T[s] >= tot[s]
        if gc is not None:
            prob += T[s] >= gather[s]
    Z = pulp.LpVariable("Tmax", lowBound=0)
    for s in range(S):
        prob += Z >= T[s]
    # Aggregate cuts (implied, but they tighten the LP relaxation): the max is at least the mean.
    prob += S * Z >= pulp.lpSum(T)
    ranks = [stage_rank(cand.schedule, cand.pp, cand.v, s) for s in range(S)]
    if form == "count" and cand.v > 1:
        # Symmetry breaking: two block-only stages on one rank, neither the rank's first (whose backward
        # hides the gradient sync), can swap contents without changing any term, so order their sizes.
        for r in range(cand.pp):
            mine = [s for s in range(S) if ranks[s] == r]
            free = [s for s in mine if s not in (0, S - 1, min(mine))]
            for a, b in zip(free, free[1:]):
                prob += pulp.lpSum(cnt[a, m] for m in modes) >= pulp.lpSum(cnt[b, m] for m in modes)
    if bb is not None:
        # Valid cuts: the integer minima of the maxima, per recomputation mode (modes that cannot fit
        # memory are excluded); relaxed by 1e-12 so that rounding can never cut off the optimum.
        if cand.v == 1:
            prob += Z >= min(bb.stage_max.values()) * (1 - 1e-12)
        else:
            for r in modes:
                if r not in bb.rank_max:
                    prob += mode_vars[0, r] == 0
            prob += Z >= pulp.lpSum(mode_vars[0, r] * bb.stage_max[r] * (1 - 1e-12) for r in modes if r in bb.stage_max)
    if ib is not None:
        # Valid cut: the least largest stage time over contiguous partitions (interval_bound).
        if cand.v == 1:
            prob += Z >= min(ib.stage_max.values()) * (1 - 1e-12)
        else:
            for r in modes:
                if r not in ib.stage_max:
                    prob += mode_vars[0, r] == 0
            prob += Z >= pulp.lpSum(mode_vars[0, r] * ib.stage_max[r] * (1 - 1e-12) for r in modes if r in ib.stage_max)
    if cand.schedule in ("gpipe", "1f1b"):
        pipe = pulp.lpSum(T) + (cand.m - 1) * Z
    else:
        Y = pulp.LpVariable("Trank", lowBound=0)
        for r in range(cand.pp):
            prob += Y >= pulp.lpSum(T[s] for s in range(S) if ranks[s] == r)
        prob += cand.pp * Y >= pulp.lpSum(T)
        if bb is not None:
            prob += Y >= pulp.lpSum(mode_vars[0, r] * bb.rank_max[r] * (1 - 1e-12) for r in modes if r in bb.rank_max)
        if cand.schedule == "interleaved-1f1b":
            pipe = cand.m * Y + (cand.pp - 1) * Z
        else:
            F = pulp.LpVariable("Fmax", lowBound=0)
            for s in range(S):
                prob += F >= fwd[s]
            if bb is not None:
                prob += F >= pulp.lpSum(mode_vars[0, r] * bb.fwd_max[r] * (1 - 1e-12) for r in modes if r in bb.fwd_max)
            pipe = cand.m * Y + (cand.pp - 1) * F
    pipe = pipe + 2 * pulp.lpSum(p2p)

    # Tail: exposed DP sync overlapped with the rank's last backward, plus the optimizer step.
    tail = pulp.LpVariable("tail", lowBound=0)
    for r in range(cand.pp):
        mine = [s for s in range(S) if ranks[s] == r]
        first = min(mine)
        exposed = pulp.LpVariable(f"exposed_{r}", lowBound=0)
        window = (tot[first] - fwd[first]) * (cand.m if cand.zero == 2 else 1) if options.overlap_dp_comm else 0
        prob += exposed >= pulp.lpSum(sync[s] for s in mine) - window
        prob += tail >= exposed + opt_rate * pulp.lpSum(params[s] for s in mine)
    # Valid cut: some rank holds the unit with the most parameters, and steps its optimizer.
    prob += tail >= opt_rate * max(c.params_local for c in costs) * (1 - 1e-12)
    if bb is not None:
        # Valid cut: the integer minimum of the maxima terms plus the tail (block_bound's joint).
        if cand.v == 1:
            prob += (cand.m - 1) * Z + tail >= min(bb.joint.values()) * (1 - 1e-12)
        else:
            last = Z if cand.schedule == "interleaved-1f1b" else F
            prob += cand.m * Y + (cand.pp - 1) * last + tail >= pulp.lpSum(
                mode_vars[0, r] * bb.joint[r] * (1 - 1e-12) for r in modes if r in bb.joint
            )
    # In microseconds: CBC's absolute tolerances (1e-7 .. 1e-10) would otherwise be coarse next to
    # iteration times of a few milliseconds, and near-ties could come out in the wrong order.
    prob += OBJ_SCALE * (pipe + tail)

    # Memory per rank.
    per_param = state.weights + state.gradients + state.optimizer
    bucket = 2 * options.ddp_bucket_bytes if (cand.dp > 1 and cand.zero == 0) else 0.0
    z3buf = 2 * max(c.largest_param_bytes for c in costs) if cand.zero == 3 else 0.0
    for r in range(cand.pp):
        mine = [s for s in range(S) if ranks[s] == r]
        states = pulp.lpSum(per_param * params[s] + bucket + z3buf for s in mine) + pulp.lpSum(
            4.0 * cand.mbs * boundary[s] for s in mine if s < S - 1
        )
        if cand.v == 1:
            s = mine[0]
            acts = in_flight_microbatches(cand.schedule, cand.pp, cand.m, cand.v, s) * act[s]
            prob += ((states + acts) * frag + options.workspace_bytes) * MEM_SCALE <= cap * MEM_SCALE
        else:
            A = pulp.LpVariable(f"act_{r}", lowBound=0)
            for s in mine:
                prob += A >= act[s]
            k = rank_in_flight_microbatches(cand.schedule, cand.pp, cand.m, cand.v, r)
            prob += ((states + k * A) * frag + options.workspace_bytes) * MEM_SCALE <= cap * MEM_SCALE

    warm = False
    if form == "count":
        tries = _count_starts(cand, costs, modes, run, bb.starts if bb else [])
        start_sol = _best_start(graph, cluster, cand, costs, options, [(_count_partition(c, run), r) for c, r in tries])
        if start_sol is not None:
            part, rec, _ = start_sol
            counts = [sum(1 for u in units if run[0] <= u <= run[1]) for units in part]
            for s in range(S):
                for r in modes:
                    mode_vars[s, r].setInitialValue(1 if r == rec[s] else 0)
                    cnt[s, r].setInitialValue(counts[s] if r == rec[s] else 0)
            if has_blocks is not None:
                # every integer variable needs its value, or CBC cannot use the start
                has_blocks.setInitialValue(1 if counts[0] > 0 else 0)
            warm = True
    elif start_sol is not None:
        part, rec, _ = start_sol
        chosen = {(s, units[0], units[-1] + 1, rec[s]) for s, units in enumerate(part)}
        if form == "interval" and chosen <= x.keys():
            for key, var in x.items():
                var.setInitialValue(1 if key in chosen else 0)
            for s in range(S):
                for r in modes:
                    mode_vars[s, r].setInitialValue(1 if r == rec[s] else 0)
            warm = True
        elif form == "assign":
            for s in range(S):
                for r in modes:
                    mode_vars[s, r].setInitialValue(1 if r == rec[s] else 0)
            owner = {u: s for s, units in enumerate(part) for u in units}
            for u in range(U):
                for s in range(S):
                    z[u, s].setInitialValue(1 if owner[u] == s else 0)
                    for r in modes:
                        w[u, s, r].setInitialValue(1 if owner[u] == s and rec[s] == r else 0)
            warm = True
    # Single-threaded with a node limit: the same inputs always give the same solution (a wall-clock
    # limit would make the result depend on the machine's load).
    extra = [f"cutoff {cutoff * OBJ_SCALE * (1 + 1e-9):.17g}"] if cutoff is not None else []
    solver = pulp.PULP_CBC_CMD(
        msg=False,
        timeLimit=time_limit,
        threads=1,
        warmStart=warm,
        maxNodes=max_nodes,
        gapRel=0.0,
        gapAbs=0.0,
        options=extra,
    )
    prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    sol_status = getattr(prob, "sol_status", None)
    if status == "Infeasible":
        return ILPResult("cutoff" if cutoff is not None else "infeasible", None, None, None, form=form)
    if status != "Optimal":
        return ILPResult("not_solved", None, None, None, form=form)
    if sol_status == pulp.LpSolutionIntegerFeasible:
        res_status = "time_limit" if time_limit is not None else "node_limit"
    else:
        res_status = "optimal"

    recompute = [next(r for r in modes if (mode_vars[s, r].value() or 0) > 0.5) for s in range(S)]
    if form == "count":
        counts = [int(round(sum(cnt[s, r].value() or 0 for r in modes))) for s in range(S)]
        partition = _count_partition(counts, run)
    elif form == "interval":
        partition = [
            next(list(range(i, j)) for i, j, r in ivars[s] if (x[s, i, j, r].value() or 0) > 0.5) for s in range(S)
        ]
    else:
        partition = [[u for u in range(U) if (z[u, s].value() or 0) > 0.5] for s in range(S)]
    obj = pulp.value(prob.objective) / OBJ_SCALE
    start = None if start_sol is None else (start_sol[0], start_sol[1])
    return ILPResult(res_status, float(obj), partition, recompute, form=form, start=start)


def _single_stage(graph, cluster, cand, costs, modes, options) -> ILPResult:
    """One stage: the partition is forced, so only the recomputation mode is chosen, by evaluation."""
    part = [list(range(len(graph.units)))]
    best = _best_start(graph, cluster, cand, costs, options, [(part, [mode]) for mode in modes])
    if best is None:
        return ILPResult("infeasible", None, None, None, form="single")
    return ILPResult("optimal", best[2], part, best[1], form="single")


def _count_starts(cand, costs, modes, run, extra=()) -> list[tuple[list[int], list[str]]]:
    """Block counts per stage and recomputation per stage to try as CBC's start in the count form.

    For each recomputation mode, two balanced block distributions (stage times evened out around the
    prefix and suffix; equal block counts, which balances ranks when one rank holds both ends, as in the
    V schedule), plus `extra` (built from the bound's relaxation).
    """
    start, end, n = run
    L, S = end - start + 1, cand.stages
    pre, post = list(range(0, start)), list(range(end + 1, n))
    holds = [bool((s == 0 and pre) or (s == S - 1 and post)) for s in range(S)]
    tries = []
    for mode in modes:
        blk = costs[start].fwd + costs[start].bwd[mode]
        extra_t = [0.0] * S
        extra_t[0] += sum(costs[u].fwd + costs[u].bwd[mode] for u in pre)
        extra_t[-1] += sum(costs[u].fwd + costs[u].bwd[mode] for u in post)
        target = (L * blk + sum(extra_t)) / S
        timed = [max(0, round((target - e) / blk)) if blk > 0 else L // S for e in extra_t]
        even = [L // S + (1 if s < L % S else 0) for s in range(S)]
        for counts in (timed, even):
            counts = _fix_total(counts, L, extra_t, blk, holds)
            if counts is not None:
                tries.append((counts, [mode] * S))
    tries += [
        (list(c), list(r)) for c, r in extra if sum(c) == L and all(c[s] >= (0 if holds[s] else 1) for s in range(S))
    ]
    return tries


def _count_partition(counts: list[int], run) -> list[list[int]]:
    """The units of each stage for blocks-per-stage counts (prefix in the first, suffix in the last)."""
    start, end, n = run
    part, nxt = [], start
    for s, k in enumerate(counts):
        units = (list(range(0, start)) if s == 0 else []) + list(range(nxt, nxt + k))
        if s == len(counts) - 1:
            units += list(range(end + 1, n))
        nxt += k
        part.append(units)
    return part


def _best_start(graph, cluster, cand, costs, options, starts):
    """(partition, recomputation, objective) of the fitting candidate partition with the lowest
    objective under the cost model (first of equals), or None."""
    best = None
    for part, rec in starts:
        if cand.v > 1 and len(set(rec)) > 1:
            continue
        ev = evaluate(graph, cluster, cand, part, rec, costs, options)
        if max(ev.rank_memory.values()) <= cluster.gpu.memory_bytes and (best is None or ev.objective < best[2]):
            best = (part, rec, ev.objective)
    return best


def _fix_total(counts, L, extra, blk, holds):
    """Adjust block counts to sum to L (every stage without prefix/suffix keeps at least one block),
    taking from / giving to the stages furthest from the mean time; None if impossible."""
    S = len(counts)
    counts = [c if holds[s] else max(1, c) for s, c in enumerate(counts)]
    while sum(counts) != L:
        times = [extra[s] + counts[s] * blk for s in range(S)]
        if sum(counts) > L:
            order = sorted(range(S), key=lambda s: -times[s])
            s = next((s for s in order if counts[s] > (0 if holds[s] else 1)), None)
            if s is None:
                return None
            counts[s] -= 1
        else:
            counts[min(range(S), key=lambda s: times[s])] += 1
    return counts


def stage_bytes_bound(costs: list[UnitCost], dtype: str, cand: Candidate) -> float:
    """A lower bound on the largest rank's model-state bytes: the average over pipeline ranks."""
    state = model_state_bytes_per_param(dtype, cand.zero, cand.dp)
    total = sum(c.params_local for c in costs) * (state.weights + state.gradients + state.optimizer)
    return total / cand.pp


__all__ = ["ILPResult", "block_run", "solve_partition", "stage_bytes_bound", "coll"]
