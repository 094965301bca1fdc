"""The three encodings of a stage partition, one class each: `build` adds the form's variables and rows
and returns the stages' linear expressions, `warm_start` gives CBC a start, `decode` reads the solution.

The stages' quantities (forward time, total time, parameters, activation bytes, outgoing boundary bytes)
are linear expressions in the form's variables; everything after them (time, tail, memory) is shared.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pulp

from planner.search.problem import PartitionProblem, Run
from planner.search.problem import block_run as block_run  # the count form's run, exported by planner.search.ilp

Expr = Any  # pulp.LpAffineExpression or LpVariable (pulp has no type information)
Partition = list[list[int]]
Modes = tuple[str, ...]
ModeVars = dict[tuple[int, str], Any]  # y[s, r]: stage s runs recomputation mode r


@dataclass
class StageExprs:
    """Per stage s, linear expressions of the stage's quantities (boundary[s] for s < S-1 only)."""

    fwd: list[Expr]
    tot: list[Expr]
    params: list[Expr]
    act: list[Expr]  # activation bytes per micro-batch
    boundary: list[Expr]  # bytes of the stage's outgoing boundary tensor (per sample)
    # parameters as the data-parallel ring counts them (`UnitCost.sync_params`: experts over dp/ep replicas)
    sync: list[Expr] = field(default_factory=list)



def count_partition(counts: list[int], run: Run) -> Partition:
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


def _prefix(xs: Iterable[float]) -> list[float]:
    return [0.0, *itertools.accumulate(xs)]


def _set_modes(mode_vars: ModeVars, modes: Modes, rec: list[str]) -> None:
    for s, chosen in enumerate(rec):
        for r in modes:
            mode_vars[s, r].setInitialValue(1 if r == chosen else 0)


@dataclass
class CountForm:
    """Prefix? + L identical blocks + suffix?: n[s, r] blocks in stage s under mode r (integers), the
    prefix in stage 0 and the suffix in the last; O(stages) variables however many layers there are."""

    run: Run
    cnt: dict[tuple[int, str], Any] = field(default_factory=dict)
    has_blocks: Any = None
    name: str = "count"

    def build(self, prob: pulp.LpProblem, pb: PartitionProblem, mode_vars: ModeVars) -> StageExprs:
        graph, cand, costs, modes = pb.graph, pb.cand, pb.costs, pb.modes
        start, end, n = self.run
        S, L = cand.stages, end - start + 1
        blk = costs[start]
        pre, post = list(range(0, start)), list(range(end + 1, n))
        cnt = self.cnt = {
            (s, r): pulp.LpVariable(f"n_{s}_{r}", lowBound=0, upBound=L, cat="Integer") for s in range(S) for r in modes
        }
        for s in range(S):
            for r in modes:
                prob += cnt[s, r] <= L * mode_vars[s, r]
        prob += pulp.lpSum(cnt.values()) == L
        ex = StageExprs([None] * S, [None] * S, [None] * S, [None] * S, [None] * S, [None] * S)
        for s in range(S):
            holds = (pre if s == 0 else []) + (post if s == S - 1 else [])
            blocks = pulp.lpSum(cnt[s, r] for r in modes)
            if not holds:
                prob += blocks >= 1
            fixed = [costs[u] for u in holds]
            ex.fwd[s] = blocks * blk.fwd + sum(c.fwd for c in fixed)
            ex.tot[s] = pulp.lpSum(
                [cnt[s, r] * (blk.fwd + blk.bwd[r]) for r in modes]
                + [mode_vars[s, r] * (c.fwd + c.bwd[r]) for r in modes for c in fixed]
            )
            ex.params[s] = blocks * blk.params_local + sum(c.params_local for c in fixed)
            ex.sync[s] = blocks * blk.sync_params + sum(c.sync_params for c in fixed)
            ex.act[s] = pulp.lpSum(
                [cnt[s, r] * blk.act[r] for r in modes] + [mode_vars[s, r] * c.act[r] for r in modes for c in fixed]
            )
            if s < S - 1:
                b = pulp.LpVariable(f"bnd_{s}", lowBound=0)
                out_blk = graph.units[start].output_bytes
                if s == 0 and pre:
                    has = self.has_blocks = pulp.LpVariable("has_blocks_0", cat="Binary")
                    prob += has <= blocks
                    prob += blocks <= L * has
                    prob += b >= out_blk * has
                    prob += b >= graph.units[pre[-1]].output_bytes * (1 - has)
                else:
                    prob += b >= out_blk
                ex.boundary[s] = b
        return ex

    def blocks(self, s: int, modes: Modes) -> Expr:
        return pulp.lpSum(self.cnt[s, m] for m in modes)

    def warm_start(self, part: Partition, rec: list[str], modes: Modes, mode_vars: ModeVars) -> bool:
        counts = [sum(1 for u in units if self.run[0] <= u <= self.run[1]) for units in part]
        for s in range(len(part)):
            for r in modes:
                mode_vars[s, r].setInitialValue(1 if r == rec[s] else 0)
                self.cnt[s, r].setInitialValue(counts[s] if r == rec[s] else 0)
        if self.has_blocks is not None:
            # every integer variable needs its value, or CBC cannot use the start
            self.has_blocks.setInitialValue(1 if counts[0] > 0 else 0)
        return True

    def decode(self, S: int, U: int, modes: Modes) -> Partition:
        counts = [int(round(sum(self.cnt[s, r].value() or 0 for r in modes))) for s in range(S)]
        return count_partition(counts, self.run)


@dataclass
class IntervalForm:
    """x[s, i, j, r] = 1: stage s holds units i..j-1 in mode r. The stages form a path from unit 0 to U
    (flow conservation), whose LP relaxation is the convex hull of the partitions."""

    ivars: dict[int, list[tuple[int, int, str]]]
    x: dict[tuple[int, int, int, str], Any] = field(default_factory=dict)
    name: str = "interval"

    def build(self, prob: pulp.LpProblem, pb: PartitionProblem, mode_vars: ModeVars) -> StageExprs:
        graph, cand, costs, modes = pb.graph, pb.cand, pb.costs, pb.modes
        S, U, ivars = cand.stages, len(costs), self.ivars
        c_fwd = _prefix(c.fwd for c in costs)
        c_par = _prefix(c.params_local for c in costs)
        c_sync = _prefix(c.sync_params for c in costs)
        c_tot = {r: _prefix(c.fwd + c.bwd[r] for c in costs) for r in modes}
        c_act = {r: _prefix(c.act[r] for c in costs) for r in modes}
        x = self.x = {
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
        ex = StageExprs([None] * S, [None] * S, [None] * S, [None] * S, [None] * S, [None] * S)
        for s in range(S):
            xs = [(i, j, r, x[s, i, j, r]) for i, j, r in ivars[s]]
            ex.fwd[s] = pulp.lpSum([v * (c_fwd[j] - c_fwd[i]) for i, j, r, v in xs])
            ex.tot[s] = pulp.lpSum([v * (c_tot[r][j] - c_tot[r][i]) for i, j, r, v in xs])
            ex.params[s] = pulp.lpSum([v * (c_par[j] - c_par[i]) for i, j, r, v in xs])
            ex.sync[s] = pulp.lpSum([v * (c_sync[j] - c_sync[i]) for i, j, r, v in xs])
            ex.act[s] = pulp.lpSum([v * (c_act[r][j] - c_act[r][i]) for i, j, r, v in xs])
            if s < S - 1:
                ex.boundary[s] = pulp.lpSum([v * graph.units[j - 1].output_bytes for i, j, r, v in xs])
        return ex

    def warm_start(self, part: Partition, rec: list[str], modes: Modes, mode_vars: ModeVars) -> bool:
        chosen = {(s, units[0], units[-1] + 1, rec[s]) for s, units in enumerate(part)}
        if not chosen <= self.x.keys():
            return False
        for key, var in self.x.items():
            var.setInitialValue(1 if key in chosen else 0)
        _set_modes(mode_vars, modes, rec)
        return True

    def decode(self, S: int, U: int, modes: Modes) -> Partition:
        return [
            next(list(range(i, j)) for i, j, r in self.ivars[s] if (self.x[s, i, j, r].value() or 0) > 0.5)
            for s in range(S)
        ]


@dataclass
class AssignForm:
    """z[u, s] = 1: unit u in stage s (w[u, s, r] with its mode), contiguous through prefix sums over the
    stages that never increase from one unit to the next."""

    z: dict[tuple[int, int], Any] = field(default_factory=dict)
    w: dict[tuple[int, int, str], Any] = field(default_factory=dict)
    name: str = "assign"

    def build(self, prob: pulp.LpProblem, pb: PartitionProblem, mode_vars: ModeVars) -> StageExprs:
        graph, cand, costs, modes = pb.graph, pb.cand, pb.costs, pb.modes
        S, U = cand.stages, len(costs)
        z = self.z = {(u, s): pulp.LpVariable(f"z_{u}_{s}", cat="Binary") for u in range(U) for s in range(S)}
        w = self.w = {
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
        for u in range(U - 1):
            for s in range(S - 1):
                prob += pulp.lpSum(z[u + 1, k] for k in range(s + 1)) <= pulp.lpSum(z[u, k] for k in range(s + 1))
        for s in range(S):
            prob += pulp.lpSum(z[u, s] for u in range(U)) >= 1
        prob += z[0, 0] == 1
        ex = StageExprs([None] * S, [None] * S, [None] * S, [None] * S, [None] * S, [None] * S)
        for s in range(S):
            ex.fwd[s] = pulp.lpSum([z[u, s] * costs[u].fwd for u in range(U)])
            ex.tot[s] = pulp.lpSum([w[u, s, r] * (costs[u].fwd + costs[u].bwd[r]) for u in range(U) for r in modes])
            ex.params[s] = pulp.lpSum([z[u, s] * costs[u].params_local for u in range(U)])
            ex.sync[s] = pulp.lpSum([z[u, s] * costs[u].sync_params for u in range(U)])
            ex.act[s] = pulp.lpSum([w[u, s, r] * costs[u].act[r] for u in range(U) for r in modes])
            if s < S - 1:
                b = pulp.LpVariable(f"bnd_{s}", lowBound=0)
                for u in range(U):
                    nxt = z[u + 1, s] if u + 1 < U else 0
                    prob += b >= graph.units[u].output_bytes * (z[u, s] - nxt)
                ex.boundary[s] = b
        return ex

    def warm_start(self, part: Partition, rec: list[str], modes: Modes, mode_vars: ModeVars) -> bool:
        _set_modes(mode_vars, modes, rec)
        owner = {u: s for s, units in enumerate(part) for u in units}
        for (u, s), var in self.z.items():
            var.setInitialValue(1 if owner[u] == s else 0)
        for (u, s, r), var in self.w.items():
            var.setInitialValue(1 if owner[u] == s and rec[s] == r else 0)
        return True

    def decode(self, S: int, U: int, modes: Modes) -> Partition:
        return [[u for u in range(U) if (self.z[u, s].value() or 0) > 0.5] for s in range(S)]


Form = CountForm | IntervalForm | AssignForm
