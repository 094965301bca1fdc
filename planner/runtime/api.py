"""`parallelize(plan)`: a plan applied to its model for people with their own training loop.

    import torch
    from planner.runtime import parallelize

    job = parallelize("plan_out")           # under torchrun: joins the process group, builds this rank's part
    optimizer = torch.optim.AdamW(job.parameters(), lr=3e-4)
    for step in range(steps):
        loss = job.step(job.batches(step))  # forward + backward over this rank's micro-batches (or your own)
        optimizer.step()
        optimizer.zero_grad()

`job.stages` are this rank's stage modules (the model itself, sharded, when the plan has no pipeline);
`job.schedule` the torch.distributed.pipelining schedule running them (None without a pipeline). The
parallelisms are the generated train.py's (planner_runtime.parallel, in torchtitan's order).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import RunError
from .layout import Layout, ModelFile, Stage, TPPlan, Training
from .loop import accumulate, init_distributed, pipeline_step, trace_and_cut
from .loss import default_loss
from .model import build_model, input_count, load_model_file, make_batch, materialise
from .parallel import SummedOverTP
from .parallel import parallelize as parallelize_stage
from .stages import (
    AsWritten,
    LocalStage,
    ModelStage,
    build_local_stages,
    shared_weights,
    uses_graph,
    with_structure,
)
from .tied import TiedWeights, own_copies
from .vocab import VocabParallelLoss, loss_context, with_loss_parallel
from .weights import load_sharded, open_checkpoint


def read_plan(path: str | Path) -> tuple[Layout, ModelFile, Training]:
    """The runtime's objects of a plan.json (or the folder holding it), read as plain JSON (the planner's
    pydantic schema is not needed where the job runs)."""
    file = Path(path)
    if file.is_dir():
        file = file / "plan.json"
    try:
        data = json.loads(file.read_text())
        p, m, t = data["parallel"], data["model"], data["training"]
        layout = Layout(
            pp=p["pp"], dp=p["dp"], tp=p["tp"], virtual_stages=p.get("virtual_stages", 1),
            mesh_dims=tuple(p.get("mesh_dims", ("pp", "dp", "tp"))), micro_batch_size=p["micro_batch_size"],
            num_micro_batches=p["num_micro_batches"], global_batch_size=p.get("global_batch_size"),
            schedule=p.get("schedule", "1f1b"), zero_stage=p.get("zero_stage", 0),
            sequence_parallel=p.get("sequence_parallel", False),
            stages=tuple(
                Stage(
                    s["pp_rank"], tuple(s["modules"]), s.get("recompute", "none"),
                    tuple(s.get("recompute_full_modules", ())),
                )
                for s in sorted(data["stages"], key=lambda s: s["index"])
            ),
            tp_plan=TPPlan.from_keys(data),
            ep=p.get("ep", 1), experts=dict(data.get("experts", {})), cp=p.get("cp", 1),
            async_tp=p.get("tp_overlap", False),
        )
        spec = ModelFile(m["path"], m.get("build_fn", "build_model"), m.get("inputs_fn", "example_inputs"),
                         m.get("loss_fn"), m.get("batch_fn"), dict(m.get("model_args", {})))
        training = Training(seed=t.get("seed", 0), lr=float(t.get("lr", 1e-4)), steps=t.get("steps", 10),
                            dtype=t.get("dtype", "bf16"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunError(
            f"Cannot read the plan {file} ({type(e).__name__}: {e}): pass a plan.json that planner wrote."
        ) from None
    return layout, spec, training


@dataclass
class Parallelized:
    """This rank's part of the planned job."""

    layout: Layout
    mesh: DeviceMesh
    device: torch.device
    model: nn.Module  # the model the stages take their modules from (other stages' weights stay on meta)
    stages: list[LocalStage]  # this rank's stages, parallelised
    schedule: Any | None  # the pipeline schedule (pp > 1), else None
    loss_fn: Callable[..., torch.Tensor]
    user: Any  # the imported model file
    spec: ModelFile
    seed: int
    tied: TiedWeights | None = None
    summed: SummedOverTP | None = None  # weights whose gradient is summed over tp (TP_SUMMED)
    _loss: Any = None
    _n_inputs: int = 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (DTensors where sharded), each once: what the optimizer steps."""
        seen: set[int] = set()
        for stage in self.stages:
            for p in stage.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    yield p

    @property
    def has_first(self) -> bool:
        return 0 in self.layout.stages_on(self.mesh["pp"].get_local_rank())

    @property
    def has_last(self) -> bool:
        return self.layout.num_stages - 1 in self.layout.stages_on(self.mesh["pp"].get_local_rank())

    def batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """This data-parallel rank's micro-batches of `step`, from the model file (as train.py draws them)."""
        first = self.mesh["dp"].get_local_rank() * self.layout.num_micro_batches
        return [
            tuple(t.to(self.device) for t in make_batch(self.user, self.spec, self.layout, self.seed, step, first + i))
            for i in range(self.layout.num_micro_batches)
        ]

    def step(self, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """Forward and backward over this rank's NUM_MICRO_BATCHES micro-batches, gradients reduced over dp
        (and summed over a tied weight's copies): the optimizer can step. Returns the mean micro-batch loss
        on the ranks of the last stage (None elsewhere)."""
        loss: torch.Tensor | None
        with loss_context(self.layout):
            if self.schedule is None:
                loss = accumulate(self.stages[0], self.layout, batches, self.loss_fn, self._n_inputs)
            else:
                loss = pipeline_step(
                    self.schedule, self.layout, self._loss, batches, self.has_first, self.has_last, self._n_inputs
                )
        if self.tied is not None:
            self.tied.sum_gradients()
        if self.summed is not None:
            self.summed.sum_gradients()
        return loss


def parallelize(
    plan: str | Path,
    *,
    device: str = "auto",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    init_from: str | None = None,
) -> Parallelized:
    """Apply `plan` (plan.json or its folder) to its model on this rank: join the process group (started by
    torchrun; one process needs no launcher) unless already joined, build this rank's stages with their
    weights (the model's own initialisation, or `init_from`'s checkpoint), apply TP, activation checkpointing
    and FSDP/replicate, and for a pipeline its schedule. `loss_fn(output, *micro_batch)`: default the model
    file's loss_fn, else next-token cross-entropy (or the mean)."""
    from .schedule import MicroBatchLoss, PlannedStage, build_schedule

    layout, spec, training = read_plan(plan)
    if layout.ep_enabled:
        raise RunError("parallelize() does not apply expert parallelism yet: run the generated train.py for ep > 1.")
    if layout.cp_enabled:
        raise RunError(
            "parallelize() does not apply context parallelism yet: run the generated train.py for cp > 1."
        )
    if dist.is_initialized():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if (
            device == "cuda" or (device == "auto" and torch.cuda.is_available())
        ) else torch.device("cpu")
        mesh = init_device_mesh(dev.type, layout.mesh_shape, mesh_dim_names=layout.mesh_dims)
    else:
        dev, mesh = init_distributed(layout, device, "your script")
    torch.manual_seed(training.seed)
    user = load_model_file(spec.path)
    if loss_fn is None:
        loss_fn = getattr(user, spec.loss_fn) if spec.loss_fn else default_loss
    # Loss parallelism (tp, the next-token loss): the LM head's logits stay split by vocabulary (vocab.py).
    layout = with_loss_parallel(layout, None if loss_fn is default_loss else loss_fn)
    if layout.loss_parallel:
        loss_fn = VocabParallelLoss(loss_fn)
    example = make_batch(user, spec, layout, training.seed, 0, 0)
    weights = open_checkpoint(init_from) if init_from else None
    local = layout.stages_on(mesh["pp"].get_local_rank())
    tied = None
    sp_styles: dict[str, Any] = {}
    stages: list[LocalStage]
    traced = None
    if uses_graph(layout):
        # A graph only torch.export traces runs as written at pp 1 without SP (`stages.AsWritten`).
        with contextlib.suppress(AsWritten):
            traced = trace_and_cut(
                user, spec, layout, training.seed, example, mesh["tp"] if layout.tp_enabled else None,
                device_type=dev.type,
            )
    if traced is not None:
        gm, pieces, sp_styles, _, layout = traced
        built, model = build_local_stages(
            user, spec, training.seed, gm, pieces, local, dev, layout.schedule == "zero-bubble", weights
        )
        stages = list(built)
        loss_fn = with_structure(loss_fn, pieces[-1].out_spec)
        shared = shared_weights(gm, pieces)
        tied = TiedWeights(shared, layout, mesh, model, stages, local, own_copies(shared, model, stages, local))
    else:
        model = build_model(user, spec, training.seed, everything_on_meta=False)
        at_build = weights if layout.tp_plan.fused else None  # else read after sharding, each rank its shards
        materialise(model, {n for n, _ in model.named_modules()}, dev, training.seed, at_build)
        stages = [ModelStage(model, list(layout.stages[0].modules))]
    for i, stage in zip(local, stages, strict=True):
        parallelize_stage(
            stage, mesh, layout, layout.stages[i].recompute, dev, sp_styles, training.dtype,
            full=layout.stages[i].full,
        )
    if weights is not None and traced is None and not layout.tp_plan.fused:
        load_sharded(model, weights, {n for n, _ in model.named_modules()})
    job = Parallelized(layout, mesh, dev, model, stages, None, loss_fn, user, spec, training.seed, tied)
    if layout.sums_over_tp:
        job.summed = SummedOverTP(stages, layout, mesh["tp"].get_group())
    job._n_inputs = input_count(model, len(example))
    if layout.pp_enabled:
        job._loss = MicroBatchLoss(loss_fn)
        pipeline = [
            PlannedStage(stage, i, layout.num_stages, dev, group=mesh["pp"].get_group())
            for i, stage in zip(local, stages, strict=True)
        ]
        job.schedule = build_schedule(layout, pipeline, job._loss)
    return job
