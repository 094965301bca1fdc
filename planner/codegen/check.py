"""The plan-time check that the generated script can run the plan: the runtime's own check_plan_runs (meta
device, one process), its errors turned into PlanError so `planner plan` exits 2 before writing anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.codegen.render import runtime_objects
from planner.errors import LayoutRefusedError, PlanError
from planner.plan import Plan
from planner.runtime.errors import RefusedLayout, RunError

if TYPE_CHECKING:
    from planner.runtime.check import Prepared


def check_plan_runs(plan: Plan, prepared: Prepared | None = None) -> str:
    """Raise PlanError if the plan's stages, TP decisions or loss cannot run one micro-batch; returns how the
    script would run it ("module", "fx" or "export"). `prepared`: the check's start made ahead (the worker's)."""
    from planner.runtime.check import check_plan_runs as runtime_check  # imports torch

    try:
        device_type = "cpu" if plan.cluster.gpu.lower() == "cpu" else "cuda"  # the device launch.sh passes
        return runtime_check(*runtime_objects(plan), device_type=device_type, prepared=prepared)
    except RefusedLayout as e:
        raise LayoutRefusedError(f"The plan cannot run: {e}") from None
    except RunError as e:
        raise PlanError(f"The plan cannot run: {e}") from None
