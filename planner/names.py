"""Names shared by every layer: schedules, recomputation modes, solver statuses (a leaf, no imports).

The Plan schema (`planner.plan`), the cost model and the search all take these names from here. The
generated script cannot import the planner, so planner/codegen's template keeps its own copy (checked by
its tests), as does the CLI's option enum (`cli/_options.py`).
"""

from __future__ import annotations

from typing import Literal, get_args

# zero-bubble is ZBV (torch's ScheduleZBVZeroBubble): two stages per rank placed in a V, so stage i runs
# on rank i for i < pp and on rank 2*pp-1-i after; the other schedules place stage i on rank i % pp.
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
Recompute = Literal["none", "selective", "full"]

# What one ILP ended with (planner.search.ilp.solve_partition): "cutoff" when no plan beats the cutoff it
# was given, "not_solved" when it stopped at its limit before finding any plan.
SolveStatus = Literal["optimal", "infeasible", "cutoff", "time_limit", "node_limit", "not_solved"]
# What a whole search (and each plan it ranks) ended with: exact, or stopped early at a limit.
SearchStatus = Literal["optimal", "time_limit", "node_limit"]

SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)
