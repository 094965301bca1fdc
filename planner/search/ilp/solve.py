"""Solving one candidate's ILP: choose the encoding, build it from the forms and constraint families,
give CBC a start, solve, decode (see the package docstring for the model)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import pulp

from planner.names import SolveStatus
from planner.search.bounds import (
    BlockBounds,
    IntervalBounds,
    block_bound,
    comm_bound,
    interval_bound,
    interval_vars,
    tail_bound,
)
from planner.search.evaluate import evaluate
from planner.search.ilp import constraints as rows
from planner.search.ilp.chain import ChainResult, solve_chain
from planner.search.ilp.chain import applies as chain_applies
from planner.search.ilp.forms import (
    AssignForm,
    CountForm,
    Form,
    IntervalForm,
    Partition,
    count_partition,
)
from planner.search.ilp.ranks import MAX_NODES, RanksResult, solve_ranks
from planner.search.ilp.ranks import applies as ranks_applies
from planner.search.ilp.tailcut import TailFloor, tail_floor
from planner.search.problem import PartitionProblem, Run

log = logging.getLogger(__name__)
OBJ_SCALE = 1e6
# The interval form has one binary per (stage, unit interval, mode): used while that stays small.
MAX_INTERVAL_VARS = 20_000


@dataclass
class ILPResult:
    status: SolveStatus
    objective: float | None
    partition: list[list[int]] | None
    recompute: list[str] | None
    gap: float = 0.0
    form: str = ""
    # the balanced partition used as CBC's incumbent, when there was one (partition, recompute)
    start: tuple[list[list[int]], list[str]] | None = None
    # a valid lower bound on the candidate's optimum when the solver stopped at its limit (None: unknown)
    low: float | None = None
    nodes: int = 0  # nodes the branch and bound for several stages per rank expanded (0: not used)


def solve_partition(
    pb: PartitionProblem,
    time_limit: float | None = None,
    force_form: str | None = None,
    max_nodes: int | None = None,
    cutoff: float | None = None,
    cuts: bool = True,
    bounds: BlockBounds | IntervalBounds | None = None,
    bb_nodes: int | None = MAX_NODES,
) -> ILPResult:
    """Solve the partition + recomputation ILP of one candidate exactly (or to the time limit).

    `cutoff`: only solutions with an objective below it are wanted (the search passes the k-th best plan
    so far); when none exists the status is "cutoff". `cuts`: add the valid integer bounds of
    `planner.search.bounds.block_bound` on the maxima (count form), which close most of the LP gap;
    `bounds`: that function's result when the caller has it already. `bb_nodes`: the nodes the branch and
    bound for several stages per rank (`ranks.solve_ranks`) may expand (None: no limit).
    """
    cand, modes = pb.cand, pb.modes
    U = len(pb.graph.units)
    S = cand.stages
    if S > U:
        return ILPResult("infeasible", None, None, None)
    if S == 1:
        return _single_stage(pb)
    run = pb.run
    kind = force_form or ("count" if run is not None else None)
    if kind == "count" and run is None:
        kind = "assign"
    ib = None
    floor: TailFloor | None = None
    start_sol = None
    form: Form
    if kind == "count":
        assert run is not None
        form = CountForm(run)
    else:
        # Any unit sequence: the interval bound (cut and start), then the intervals an optimal plan can use.
        # (the tables are the problem's own: `interval_bound` computed the given bounds from them)
        given = bounds if isinstance(bounds, IntervalBounds) else None
        if cuts:
            ib = given or interval_bound(pb)
            if ib is None:
                return ILPResult("infeasible", None, None, None, form=kind or "interval")
            start_sol = _best_start(pb, ib.starts)
        limits = [v for v in (cutoff, start_sol[2] if start_sol else None) if v is not None]
        tot_ = pb.totals
        work = tot_.work if cand.virtual_stages == 1 else cand.num_micro_batches * tot_.work / cand.pp
        rest = work + comm_bound(pb) + tail_bound(pb)
        if cuts and force_form is None and start_sol is not None and cand.virtual_stages == 1:
            # One stage per rank: the objective is at least work + p2p + (m-1) Z + tail, each term at least
            # its bound; a start that reaches that sum is optimal without branching.
            comm = comm_bound(pb)
            floor = tail_floor(pb, start_sol[2] - work - comm)
            if floor is not None and start_sol[2] <= (work + comm + floor.joint) * (1 + 1e-9):
                part, rec, obj = start_sol
                if cutoff is not None and obj >= cutoff * (1 + 1e-9):
                    return ILPResult("cutoff", None, None, None, form=kind or "interval")
                return ILPResult("optimal", obj, part, rec, form=kind or "interval", start=(part, rec))
        if force_form is None and chain_applies(cand):
            # one stage per rank: the exact dynamic program (chain.py) instead of CBC, unless it gives up
            low = work + comm_bound(pb) + (floor.joint if floor is not None else 0.0)
            limit = None if cutoff is None else cutoff * (1 + 1e-9)
            got = solve_chain(pb, limit, start_sol, low)
            log.debug("%s: chain %s, %d shortest paths", cand.label(), got and got.objective, got and got.paths)
            done = _chain_result(pb, got, cutoff, start_sol)
            if done is not None:
                return done
        if force_form is None and cuts and ranks_applies(cand):
            # several stages per rank: the branch and bound (ranks.py) instead of CBC
            limit = None if cutoff is None else cutoff * (1 + 1e-9)
            got_r = solve_ranks(pb, limit, start_sol, bb_nodes)
            log.debug("%s: ranks %s, %d nodes", cand.label(), got_r.objective, got_r.nodes)
            done = _ranks_result(pb, got_r, cutoff, start_sol)
            if done is not None:
                return done
        # the intervals an optimal plan can use, for CBC (the dynamic programs above need none)
        ivars = interval_vars(pb, min(limits) if limits else None, rest)
        if not all(ivars.values()):
            return ILPResult(
                "cutoff" if cutoff is not None else "infeasible", None, None, None, form=kind or "interval"
            )
        if kind is None:
            # (the assignment form cannot leave out zero-bubble's stages that `PartitionProblem.stage_ok` refuses)
            few = sum(len(v) for v in ivars.values()) <= MAX_INTERVAL_VARS
            kind = "interval" if few or pb.stage_ok is not None else "assign"
        form = IntervalForm(ivars) if kind == "interval" else AssignForm()

    bb = None
    if isinstance(form, CountForm) and cuts:
        given_bb = bounds if isinstance(bounds, BlockBounds) else None
        bb = given_bb or block_bound(pb)
        if bb is None:
            return ILPResult("infeasible", None, None, None, form=form.name)

    prob = pulp.LpProblem("partition", pulp.LpMinimize)
    mode_vars = rows.add_mode_choice(prob, pb)
    ex = form.build(prob, pb, mode_vars)
    mx = rows.add_stage_maxima(prob, ex, pb)
    if isinstance(form, CountForm) and cand.virtual_stages > 1:
        rows.add_symmetry_breaking(prob, form, pb)
    for cut in (bb, ib):
        if cut is not None:
            rows.add_stage_cuts(prob, mx, cut, pb, mode_vars)
    rows.add_rank_maxima(prob, mx, ex, pb, bb, mode_vars)
    tail = rows.add_tail(prob, ex, pb)
    if floor is not None:
        prob += tail >= floor.tail * rows.RELAX
        if cand.num_micro_batches > 1:
            prob += (cand.num_micro_batches - 1) * mx.Z + tail >= floor.joint * rows.RELAX
    if bb is not None:
        rows.add_joint_cut(prob, mx, tail, bb, pb, mode_vars)
    # In microseconds: CBC's absolute tolerances (1e-7 .. 1e-10) would otherwise be coarse next to
    # iteration times of a few milliseconds, and near-ties could come out in the wrong order.
    prob += OBJ_SCALE * rows.objective(mx, tail, ex, pb)
    rows.add_memory(prob, ex, pb)

    if isinstance(form, CountForm):
        tries = _count_starts(pb, form.run, bb.starts if bb else [])
        start_sol = _best_start(pb, [(count_partition(c, form.run), r) for c, r in tries])
    warm = start_sol is not None and form.warm_start(start_sol[0], start_sol[1], modes, mode_vars)
    status, res_status = _solve_cbc(prob, time_limit, max_nodes, cutoff, warm)
    if status is not None:
        return ILPResult(status, None, None, None, form=form.name)
    recompute = [next(r for r in modes if (mode_vars[s, r].value() or 0) > 0.5) for s in range(S)]
    partition = form.decode(S, U, modes)
    obj = pulp.value(prob.objective) / OBJ_SCALE
    start = None if start_sol is None else (start_sol[0], start_sol[1])
    return ILPResult(res_status, float(obj), partition, recompute, form=form.name, start=start)


def _chain_result(
    pb: PartitionProblem,
    got: ChainResult | None,
    cutoff: float | None,
    start_sol: tuple[Partition, list[str], float] | None,
) -> ILPResult | None:
    """The dynamic program's answer as an ILPResult (optimal, or cutoff / infeasible when no plan below the
    cutoff, or none at all, fits), its plan scored by the cost model itself; None (solve with CBC) when it
    gave up, or when its plan does not fit memory by the cost model's own sum (a rounding edge)."""
    if got is None:
        return None
    if got.partition is None or got.recompute is None:
        return ILPResult("cutoff" if cutoff is not None else "infeasible", None, None, None, form="chain")
    ev = evaluate(pb, got.partition, got.recompute)
    if max(ev.rank_memory.values()) > pb.capacity:
        return None
    start = None if start_sol is None else (start_sol[0], start_sol[1])
    return ILPResult("optimal", ev.objective, got.partition, got.recompute, form="chain", start=start)


def _ranks_result(
    pb: PartitionProblem,
    got: RanksResult,
    cutoff: float | None,
    start_sol: tuple[Partition, list[str], float] | None,
) -> ILPResult | None:
    """The branch and bound's answer as an ILPResult: optimal when proven, else node_limit with its
    valid lower bound (`ILPResult.low`); cutoff / infeasible when it proved no plan below the cutoff fits;
    None (solve with CBC) when its plan does not fit memory by the cost model's own sum (a rounding edge)."""
    start = None if start_sol is None else (start_sol[0], start_sol[1])
    if got.partition is None or got.recompute is None:
        if got.proven:
            return ILPResult(
                "cutoff" if cutoff is not None else "infeasible", None, None, None, form="ranks", nodes=got.nodes
            )
        return ILPResult("not_solved", None, None, None, form="ranks", low=got.low, nodes=got.nodes)
    ev = evaluate(pb, got.partition, got.recompute)
    if max(ev.rank_memory.values()) > pb.capacity:
        return None
    status: SolveStatus = "optimal" if got.proven else "node_limit"
    return ILPResult(
        status, ev.objective, got.partition, got.recompute, form="ranks", start=start, low=got.low, nodes=got.nodes
    )


def _solve_cbc(
    prob: pulp.LpProblem, time_limit: float | None, max_nodes: int | None, cutoff: float | None, warm: bool
) -> tuple[SolveStatus | None, SolveStatus]:
    """Run CBC: (the status of a failed solve or None, the status of the solution found)."""
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
    if status == "Infeasible":
        return ("cutoff" if cutoff is not None else "infeasible"), "infeasible"
    if status != "Optimal":
        return "not_solved", "not_solved"
    if getattr(prob, "sol_status", None) == pulp.LpSolutionIntegerFeasible:
        return None, ("time_limit" if time_limit is not None else "node_limit")
    return None, "optimal"


def _single_stage(pb: PartitionProblem) -> ILPResult:
    """One stage: the partition is forced, so only the recomputation mode is chosen, by evaluation."""
    part = [list(range(len(pb.graph.units)))]
    best = _best_start(pb, [(part, [mode]) for mode in pb.modes])
    if best is None:
        return ILPResult("infeasible", None, None, None, form="single")
    return ILPResult("optimal", best[2], part, best[1], form="single")


def _count_starts(
    pb: PartitionProblem, run: Run, extra: Iterable[tuple[list[int], list[str]]] = ()
) -> list[tuple[list[int], list[str]]]:
    """Block counts per stage and recomputation per stage to try as CBC's start in the count form.

    For each recomputation mode, two balanced block distributions (stage times evened out around the
    prefix and suffix; equal block counts, which balances ranks when one rank holds both ends, as in the
    V schedule), plus `extra` (built from the bound's relaxation).
    """
    cand, costs, modes = pb.cand, pb.costs, pb.modes
    start, end, n = run
    L, S = end - start + 1, cand.stages
    pre, post = list(range(0, start)), list(range(end + 1, n))
    holds = [bool((s == 0 and pre) or (s == S - 1 and post)) for s in range(S)]
    tries: list[tuple[list[int], list[str]]] = []
    for mode in modes:
        blk = costs[start].fwd + costs[start].bwd[mode]
        extra_t = [0.0] * S
        extra_t[0] += sum(costs[u].fwd + costs[u].bwd[mode] for u in pre)
        extra_t[-1] += sum(costs[u].fwd + costs[u].bwd[mode] for u in post)
        target = (L * blk + sum(extra_t)) / S
        timed = [max(0, round((target - e) / blk)) if blk > 0 else L // S for e in extra_t]
        even = [L // S + (1 if s < L % S else 0) for s in range(S)]
        for counts in (timed, even):
            fixed = _fix_total(counts, L, extra_t, blk, holds)
            if fixed is not None:
                tries.append((fixed, [mode] * S))
    tries += [
        (list(c), list(r)) for c, r in extra if sum(c) == L and all(c[s] >= (0 if holds[s] else 1) for s in range(S))
    ]
    return tries


def _best_start(
    pb: PartitionProblem, starts: Iterable[tuple[Partition, list[str]]]
) -> tuple[Partition, list[str], float] | None:
    """(partition, recomputation, objective) of the fitting candidate partition with the lowest
    objective under the cost model (first of equals), or None."""
    cand, cap = pb.cand, pb.capacity
    best: tuple[Partition, list[str], float] | None = None
    for part, rec in starts:
        if (cand.virtual_stages > 1 and len(set(rec)) > 1) or not pb.stages_ok(part):
            continue
        ev = evaluate(pb, part, rec)
        if max(ev.rank_memory.values()) <= cap and (best is None or ev.objective < best[2]):
            best = (part, rec, ev.objective)
    return best


def _fix_total(counts: list[int], L: int, extra: list[float], blk: float, holds: list[bool]) -> list[int] | None:
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
