"""The schedule and recomputation names, the one definition (a leaf: only `typing`).

The planner and the generated script share them: `planner.names` re-exports them for the Plan schema, the
cost model and the search; the runtime's Layout validates a plan's constants against them; the CLI builds its
option enums from them (`planner/cli/_options.py`). This module lives in the runtime because the generated train.py
runs a copy of the runtime where the planner is not installed.
"""

from __future__ import annotations

from typing import Literal, get_args

# zero-bubble is ZBV (torch's ScheduleZBVZeroBubble): two stages per rank placed in a V, so stage i runs
# on rank i for i < pp and on rank 2*pp-1-i after; the other schedules place stage i on rank i % pp.
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
# "selective" recomputes the attention core (Korthikanti et al. 2022); "op" is torchtitan's per-op selective
# checkpointing (keep every odd matmul's output and the fused attention's, recompute the rest).
Recompute = Literal["none", "selective", "full", "op"]

SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)
# The modes the search chooses among unless one is pinned: "op" only pinned for now (searching it would move
# plans that the digests record; planner.search.search.search_modes).
SEARCHED_RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
