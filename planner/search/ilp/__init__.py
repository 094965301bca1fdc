r"""The stage-partition ILP (PuLP + CBC) for one candidate of outer degrees.

Variables choose, together, the contiguous partition of units into the candidate's S = p*v stages and
each stage's activation recomputation, under per-rank memory capacity, minimising the cost model's
`planner.cost.model.iteration_linear` (the schedule's fill-drain time plus the exposed data-parallel
sync and optimizer step). Every time and byte count is a term of `planner.cost.terms` evaluated on the
stages' linear expressions; the ILP adds only the linearisation of the maxima (epigraph variables,
exact since they are minimised) and valid cuts from `planner.search.bounds`.

Notation: s a stage, r a pipeline rank (rank(s) from `planner.cost.placement.stage_rank`), q a
recomputation mode, m micro-batches, k_s / k_r the in-flight micro-batches of a stage / rank
(`planner.cost.schedules`). For each stage the encoding gives linear expressions fwd_s, tot_s (forward +
backward), P_s (local parameters), G_s (parameters as the data-parallel ring counts them: experts over
their dp/ep replicas, `UnitCost.sync_params`), a_s (activation bytes per micro-batch) and b_s (outgoing
boundary bytes), `forms.StageExprs`.

Encodings (`forms`, one class each with build / warm_start / decode):
- `CountForm`, when the units are [prefix] + L identical blocks + [suffix] (transformers):
  n_{s,q} in {0..L} integer, sum_{s,q} n_{s,q} = L, n_{s,q} <= L y_{s,q}, sum_q n_{s,q} >= 1 for stages
  without the prefix or suffix; b_s >= the block's (or, for stage 0 without blocks, the prefix's) output.
- `IntervalForm`, any unit sequence while it stays small: x_{s,i,j,q} binary (stage s holds units
  i..j-1), sum_{i,j} x_{s,i,j,q} = y_{s,q}, flow conservation sum_i x_{s,i,k} = sum_j x_{s+1,k,j}:
  the LP relaxation is the convex hull of the partitions. Only the intervals an optimal plan can use
  are created (`planner.search.bounds.interval_vars`).
- `AssignForm` otherwise: z_{u,s} binary, sum_s z_{u,s} = 1, w_{u,s,q} = z_{u,s} y_{s,q} (linearised),
  prefix sums sum_{k<=s} z_{u+1,k} <= sum_{k<=s} z_{u,k} (contiguity), z_{0,0} = 1, every stage non-empty.

Constraint families (`constraints`, one function each):
- mode choice, `add_mode_choice`: y_{s,q} binary, sum_q y_{s,q} = 1; y_{s,q} = y_{0,q} when v > 1.
- stage maxima, `add_stage_maxima`: T_s >= tot_s, T_s >= gather(G_s) (ZeRO-3), Z >= T_s, S Z >= sum_s T_s.
- symmetry, `add_symmetry_breaking` (count form, v > 1): n(a) >= n(b) for consecutive block-only,
  non-first stages a < b of one rank.
- stage cuts, `add_stage_cuts`: Z >= Z* (v = 1) or Z >= sum_q y_{0,q} Z*_q, y_{0,q} = 0 for modes that
  cannot fit (Z* from `bounds.block_bound` or `bounds.interval_bound`).
- rank maxima, `add_rank_maxima` (interleaved, zero-bubble): Y >= sum_{rank(s)=r} T_s, p Y >= sum_s T_s,
  Y >= sum_q y_{0,q} Y*_q; zero-bubble F >= fwd_s, F >= sum_q y_{0,q} F*_q.
- tail, `add_tail`: e_r >= sum_{rank(s)=r} sync(G_s) - window(tot_f - fwd_f), f the rank's first stage,
  e_r >= 0, tail >= e_r + step(sum_{rank(s)=r} P_s), tail >= step(max_u P_u).
- tail cut, `tailcut.tail_floor` (interval and assign forms, one stage per rank): tail >= tau*, the least
  largest per-rank tail over partitions, and (m-1) Z + tail >= J*, their joint minimum; a start whose
  objective reaches work + p2p bound + J* is returned as optimal without calling CBC.
- joint cut, `add_joint_cut` (count form): (m-1) Z + tail >= J*, or m Y + (p-1) (Z or F) + tail >= J*_q.
- objective, `objective`: min pipeline_time(sum_s T_s, Z, Y, F, sum_s p2p(b_s)) + tail, that is
  sum_s T_s + (m-1) Z (GPipe, 1F1B), m Y + (p-1) Z (interleaved), m Y + (p-1) F (zero-bubble), plus
  2 sum_s p2p(b_s); scaled to microseconds.
- memory, `add_memory`: rank_peak_bytes(sum_{rank(s)=r} state(P_s) + buffers(b_s), k_r a) <= capacity,
  with a = a_s (v = 1) or A_r >= a_s for the rank's stages (v > 1); in GiB.

`solve.solve_partition` picks the encoding, builds the model, warm-starts CBC from the best of the
bound's and a balanced partition, and decodes the result with its `Status`. With one stage per rank
(GPipe, 1F1B) on any unit sequence it first runs `chain.solve_chain`, an exact dynamic program (branch
and bound over the largest stage time and the largest tail, shortest paths under both caps), and calls
CBC only when that gives up after `chain.MAX_PATHS` paths. With several stages per rank (interleaved,
zero-bubble) on a unit sequence that is not one run of identical blocks it runs `ranks.solve_ranks`, an
exact branch and bound over the stages' ends (best first with dives; bounds from water levels, per-rank
shortest paths and subset sums of unit times) under a node budget (`bb_nodes`, a count): stopped there,
its plan comes back as node_limit with its proven lower bound (`ILPResult.low`). CBC runs these
candidates only where the branch and bound's plan fails the cost model's own memory sum (a rounding edge).
"""

from planner.search.ilp.forms import block_run
from planner.search.ilp.solve import ILPResult, solve_partition

__all__ = ["ILPResult", "block_run", "solve_partition"]
