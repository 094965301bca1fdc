"""Partial recomputation, Megatron-LM's block method: the first k blocks of a stage recomputed fully, the rest at the
stage's own mode (`--recompute-granularity full --recompute-method block --recompute-num-layers k`).

All-or-nothing recomputation makes a stage that does not quite fit at its cheaper mode recompute every block; the
block method recomputes just enough of them. A stage with k of its b blocks fully recomputed keeps k blocks'
inputs instead of their activations and re-runs k blocks' forwards in backward (`cost.model.stage_costs`'s
`full_blocks`), so its memory falls and its time rises monotonically with k, from its mode at k = 0 to (nearly)
full recomputation at k = b (the embedding and head keep the stage's mode).

Where it is chosen. The partition and each stage's mode come from the partition solvers, which know the
all-or-nothing modes only; `with_full_blocks` then takes each plan the search ranks (`Search.add`) and, stage by
stage, replaces its mode by a cheaper one with the smallest k that fits (the cheapest in time) where that is
faster. With one stage per rank each stage's memory is its rank's, so the stages are chosen independently; with
several stages per rank (interleaved, zero-bubble) one (mode, k) for every stage is chosen, the smallest k that
fits every rank as `cost.model.rank_memory` counts it. Since a stage's memory at any k is at least its memory under
full recomputation, no candidate becomes feasible that was not; but a candidate the search pruned by a bound under
all-or-nothing costs might have won with partial recomputation, so the search is not exact over the larger space.
`--recompute-blocks N` pins k = N in every stage (each stage must hold N blocks), each stage's mode then chosen
among the searched modes but full (or the pinned `--recompute`) as the fastest that fits.
"""

from __future__ import annotations

from planner.cost.memory import held_states
from planner.cost.model import StageCost, block_units, stage_costs, stage_time_with_gathers
from planner.cost.terms import rank_peak_bytes
from planner.model.graph import ModelGraph
from planner.search.evaluate import Evaluated, evaluate
from planner.search.problem import PartitionProblem


def even_partition(graph: ModelGraph, stages: int) -> list[list[int]] | None:
    """Megatron-LM's partition: the blocks (`block_units`, one contiguous run) spread evenly over the stages
    (the first stages one more where they do not divide), the units before them in the first stage and those
    after in the last; None where the blocks are not one run or fewer than the stages."""
    blocks = sorted(block_units(graph))
    if not blocks or blocks != list(range(blocks[0], blocks[-1] + 1)) or len(blocks) < stages:
        return None
    per, extra = divmod(len(blocks), stages)
    out, at = [], blocks[0]
    for s in range(stages):
        n = per + (s < extra)
        out.append(list(range(at, at + n)))
        at += n
    out[0] = list(range(blocks[0])) + out[0]
    out[-1] = out[-1] + list(range(blocks[-1] + 1, len(graph.units)))
    return out


def stage_blocks(pb: PartitionProblem, partition: list[list[int]]) -> list[int]:
    """The number of blocks (`cost.model.block_units`) each stage of `partition` holds."""
    blocks = block_units(pb.graph)
    return [sum(1 for u in units if u in blocks) for units in partition]


def base_modes(pb: PartitionProblem) -> list[str]:
    """The modes the rest of a stage's blocks may take beside its fully recomputed ones: the problem's own, but
    full (a stage at full recomputes every block already)."""
    return [m for m in pb.modes if m != "full"]


def _stage(pb: PartitionProblem, ev: Evaluated, s: int, mode: str, k: int) -> StageCost:
    modes = list(ev.recompute)
    modes[s] = mode
    ks = list(ev.full_blocks) if ev.full_blocks else [0] * len(modes)
    ks[s] = k
    stages = stage_costs(
        pb.graph, pb.cluster, pb.cand, ev.partition, modes, pb.costs, pb.options, pb.stage_memo, ks
    )
    return stages[s]


def _fits_alone(pb: PartitionProblem, st: StageCost) -> bool:
    """With one stage per rank: the stage's rank peak (`terms.rank_peak_bytes`, as `rank_memory`) within capacity."""
    peak: float = rank_peak_bytes(held_states(st), st.activations, pb.options)
    return peak <= pb.capacity


def _smallest_fitting(pb: PartitionProblem, ev: Evaluated, s: int, base: str, b: int) -> int | None:
    """The least k in 1..b with stage `s` at (`base`, k) within its rank's memory (one stage per rank; memory
    falls with k, so by bisection), None where even k = b does not fit."""
    if not _fits_alone(pb, _stage(pb, ev, s, base, b)):
        return None
    lo, hi = 1, b  # hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits_alone(pb, _stage(pb, ev, s, base, mid)):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _fits(pb: PartitionProblem, ev: Evaluated) -> bool:
    return max(ev.rank_memory.values()) <= pb.capacity


def with_full_blocks(pb: PartitionProblem, ev: Evaluated) -> Evaluated:
    """`ev` with each stage's mode and fully recomputed blocks chosen for the least time that fits (the module
    docstring); `ev` itself where nothing is faster. `pb`: the candidate's problem with every mode's unit costs
    (full's among them) and the modes the stages may take."""
    if not pb.costs or "full" not in pb.costs[0].bwd:
        return ev
    if all(m == "none" for m in ev.recompute):
        return ev  # the fastest already: recomputing a block only adds time
    bases = base_modes(pb)
    blocks = stage_blocks(pb, ev.partition)
    if not bases or not any(blocks):
        return ev
    if pb.cand.virtual_stages == 1:
        modes, ks, changed = list(ev.recompute), [0] * len(blocks), False
        for s, b in enumerate(blocks):
            best = stage_time_with_gathers(ev.stages[s])
            for base in bases:
                if b == 0 or stage_time_with_gathers(_stage(pb, ev, s, base, 0)) >= best:
                    continue  # not faster even without recomputing a block (the stage's own mode, or a slower one)
                k = _smallest_fitting(pb, ev, s, base, b)
                if k is None:
                    continue
                # the smallest k that fits is this mode's fastest: a larger k only re-runs more forwards
                st = _stage(pb, ev, s, base, k)
                if stage_time_with_gathers(st) < best:
                    best, modes[s], ks[s], changed = stage_time_with_gathers(st), base, k, True
        if not changed:
            return ev
        out = evaluate(pb, ev.partition, modes, ks)
    else:
        out = ev
        for base in bases:
            for k in range(1, min(blocks) + 1):
                got = evaluate(pb, ev.partition, [base] * len(blocks), [k] * len(blocks))
                if _fits(pb, got):
                    if got.reported < out.reported:
                        out = got
                    break
        if out is ev:
            return ev
    if out.reported >= ev.reported or not _fits(pb, out):
        return ev
    out.status = ev.status
    return out


def with_pinned_blocks(pb: PartitionProblem, ev: Evaluated, n: int) -> Evaluated | str:
    """`ev` with the first `n` blocks of every stage recomputed fully (`--recompute-blocks n`) and each stage's
    other units at the fastest of the problem's modes but full that fits (one mode for every stage where a rank
    holds several); the reason it is refused where a stage holds fewer than `n` blocks or nothing fits."""
    blocks = stage_blocks(pb, ev.partition)
    short = [s for s, b in enumerate(blocks) if b < n]
    if short:
        s = short[0]
        return (
            f"--recompute-blocks {n}: stage {s} holds {blocks[s]} block(s) (each stage recomputes its first {n} "
            "blocks fully)"
        )
    bases = base_modes(pb)
    if not bases:
        return f"--recompute-blocks {n}: no mode but full recomputation left for the other blocks"
    ks = [n] * len(blocks)
    if pb.cand.virtual_stages == 1:
        modes: list[str] = []
        for s in range(len(blocks)):
            fitting = [(stage_time_with_gathers(st), i, m) for i, m in enumerate(bases)
                       if _fits_alone(pb, st := _stage(pb, ev, s, m, n))]
            if not fitting:
                return f"out of memory with the first {n} blocks of each stage recomputed fully (stage {s})"
            modes.append(min(fitting)[2])
        out = evaluate(pb, ev.partition, modes, ks)
    else:
        tried = [evaluate(pb, ev.partition, [m] * len(blocks), ks) for m in bases]
        ranked = [(got.reported, i) for i, got in enumerate(tried) if _fits(pb, got)]
        if not ranked:
            return f"out of memory with the first {n} blocks of each stage recomputed fully"
        out = tried[min(ranked)[1]]
    if not _fits(pb, out):
        return f"out of memory with the first {n} blocks of each stage recomputed fully"
    out.status = ev.status
    return out
