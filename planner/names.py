"""Names shared by every layer: schedules, recomputation modes, solver statuses (a leaf, no planner imports).

The Plan schema (`planner.plan`), the cost model and the search all take these names from here. Schedules
and recomputation modes are defined once, in `planner.runtime.names` (the generated script runs a copy of
the runtime where the planner is not installed), and re-exported here; the CLI's option enums
(`planner/cli/_options.py`) are built from them.
"""

from __future__ import annotations

from typing import Literal

from planner.runtime.names import RECOMPUTE_MODES, SCHEDULES, SEARCHED_RECOMPUTE_MODES, Recompute, Schedule

__all__ = [
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "SEARCHED_RECOMPUTE_MODES",
    "Recompute",
    "Schedule",
    "SearchStatus",
    "SolveStatus",
]

# What one ILP ended with (planner.search.ilp.solve_partition): "cutoff" when no plan beats the cutoff it
# was given, "not_solved" when it stopped at its limit before finding any plan.
SolveStatus = Literal["optimal", "infeasible", "cutoff", "time_limit", "node_limit", "not_solved"]
# What a whole search (and each plan it ranks) ended with: exact, or stopped early at a limit.
SearchStatus = Literal["optimal", "time_limit", "node_limit"]
# The most runners-up a search keeps (--top-k): each one raises the cutoff the search prunes with, so a search
# asked for thousands of them solves nearly every candidate (137 s at 500 on GPT-3 175B against 4 s at 5).
MAX_TOP_K = 50
