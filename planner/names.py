"""Names shared by every layer: pipeline schedules and recomputation modes (a leaf module, no imports).

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

SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
RECOMPUTE_MODES: tuple[Recompute, ...] = get_args(Recompute)
