"""The plan-time check that the generated script can run the plan: the runtime's own check_plan_runs (meta
device, one process), its errors turned into PlanError so `planner plan` exits 2 before writing anything."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.codegen.render import runtime_objects
from planner.errors import CheckpointError, LayoutRefusedError, PlanError
from planner.plan import Plan
from planner.runtime.errors import RefusedLayout, RunError
from planner.runtime.layout import Layout, ModelFile, Training

if TYPE_CHECKING:
    from planner.runtime.check import Prepared


@dataclass(frozen=True)
class CheckInputs:
    """All that the check of a plan reads: the runtime's objects (what train.py builds from its constants) and
    the device launch.sh passes. Two plans with equal inputs get the same answer (the check worker answers a
    plan sent ahead, during the search, for the final plan when their inputs are equal)."""

    layout: Layout
    spec: ModelFile
    training: Training
    device_type: str

    @classmethod
    def of(cls, plan: Plan) -> CheckInputs:
        """Raises PlanError on a broken plan (constants the runtime refuses), as the check does."""
        device_type = "cpu" if plan.cluster.gpu.lower() == "cpu" else "cuda"  # the device launch.sh passes
        with _as_plan_errors():
            return cls(*runtime_objects(plan), device_type=device_type)


def check_plan_runs(plan: Plan, prepared: Prepared | None = None) -> str:
    """Raise PlanError if the plan's stages, TP decisions or loss cannot run one micro-batch; returns how the
    script would run it ("module", "fx" or "export"). `prepared`: the check's start made ahead (the worker's)."""
    return check_runs(CheckInputs.of(plan), prepared)


def check_runs(inputs: CheckInputs, prepared: Prepared | None = None, cancel: Callable[[], bool] | None = None) -> str:
    """check_plan_runs for a plan's CheckInputs. With `cancel`, it stops at its next checkpoint once `cancel()`
    holds (planner.runtime.check.Cancelled, which is no answer)."""
    from planner.runtime.check import check_plan_runs as runtime_check  # imports torch
    from planner.runtime.scans import each_scan_once

    # Mamba's mixers: each distinct one once on meta, as the run's device computes it (mixer_stand_in)
    with _as_plan_errors(), each_scan_once(mixer_stand_in(inputs.device_type)):
        return runtime_check(
            inputs.layout, inputs.spec, inputs.training, inputs.device_type, prepared=prepared, cancel=cancel
        )


def mixer_stand_in(device_type: str) -> Callable[[Any], Any] | None:
    """How the check runs a Mamba mixer on meta for a run on `device_type`: on GPUs as the fused kernels
    (planner.model.kernels.fused_mixer, where the mixer's layout is Mamba-1's or Mamba-2's; mamba_ssm's training
    path, which transformers' mixers and state-spaces' Mamba take there), on the CPU as written (its reference
    scan, which the CPU run takes)."""
    if device_type == "cpu":
        return None
    from planner.model.fused import fused_mixer

    return fused_mixer


@contextmanager
def _as_plan_errors() -> Iterator[None]:
    """The runtime's errors as the planner's: a layout the model cannot take (the next runner-up may run), else
    a plan that cannot run."""
    try:
        yield
    except RefusedLayout as e:
        raise LayoutRefusedError(f"The plan cannot run: {e}") from None
    except RunError as e:
        raise PlanError(f"The plan cannot run: {e}") from None


def with_init_from(plan: Plan, source: str) -> Plan:
    """`plan` whose script starts from the checkpoint `source` (a local path is made absolute), after checking
    that the checkpoint holds the plan's model: its names and shapes, read without the tensors' data, against
    the model built on the meta device. CheckpointError (exit 2) names the first keys or the parameter that
    differ."""
    from planner.runtime.model import build_model, load_model_file
    from planner.runtime.weights import checkpoint_problem

    path = Path(source).expanduser()
    if path.exists():
        source = str(path.absolute())
    inputs = CheckInputs.of(plan)
    with _as_plan_errors():
        model = build_model(load_model_file(inputs.spec.path), inputs.spec, inputs.training.seed, True)
    problem = checkpoint_problem(source, model)
    if problem is not None:
        raise CheckpointError(f"--init-from {source}: {problem}")
    return plan.model_copy(update={"training": plan.training.model_copy(update={"init_from": source})})
