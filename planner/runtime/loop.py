"""The training run: process group and device mesh, building and parallelising this rank's stages, the step
(gradient accumulation, or a pipeline schedule), and metrics.json."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from .checkpoint import Checkpointer, fused_params, latest
from .context import ContextParallel, ContextParallelLoss, shard_batch, stage_buffers
from .data import Samples, SavedDataset, TokenFile, check_same_data, is_saved_dataset
from .errors import RunError
from .experts import ExpertParallel, shard_experts
from .layout import Layout, ModelFile, Training
from .loss import default_loss
from .model import build_model, input_count, load_model_file, make_batch, materialise
from .optim import LossScale, build_optimizers, clip_gradients
from .parallel import SummedOverTP, parallelize, sequence_parallel, with_tied_styles
from .stages import (
    AsWritten,
    LocalStage,
    ModelStage,
    Piece,
    StageModule,
    build_local_stages,
    cut_into_pieces,
    shared_weights,
    trace_for_plan,
    uses_graph,
    with_structure,
)
from .tied import TiedWeights, own_copies
from .tp_graph import localise_tp_sizes
from .unit_reads import model_reads_outside
from .vocab import VocabParallelLoss, loss_context, with_loss_parallel
from .weights import load_sharded, open_checkpoint

if TYPE_CHECKING:
    from .schedule import MicroBatchLoss

# FSDP2 warns when a stage returns a view (e.g. gathered logits), in case the caller modifies it in place;
# the pipeline schedule and the loss only read stage outputs.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def log0(message: str) -> None:
    """Print on global rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_distributed(layout: Layout, device_arg: str, script: str) -> tuple[torch.device, DeviceMesh]:
    """Join the process group (NCCL on GPUs, Gloo on CPU) and lay the ranks out as a (pp, dp, tp) mesh."""
    world = layout.world_size
    if "RANK" not in os.environ:
        # Started as `python train.py`: fine for a one-process plan, which then needs no launcher.
        if world != 1:
            raise RunError(
                f"This plan runs on {world} processes: start it with launch.sh, or "
                f"`torchrun --standalone --nproc-per-node={world} {script}`."
            )
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RunError("--device cuda was given but no GPU is visible; use --device cpu.")
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if dist.get_world_size() != world:
        raise RunError(
            f"This plan needs exactly {world} processes (pp {layout.pp} x dp {layout.dp}"
            f"{f' x cp {layout.cp}' if layout.cp_enabled else ''} x tp {layout.tp}) but "
            f"{dist.get_world_size()} were started. Use launch.sh or re-plan for this world size."
        )
    # Size-1 dimensions are kept: every rank then has the same three coordinates and groups, and a
    # collective over one rank costs nothing.
    mesh = init_device_mesh(device.type, layout.mesh_shape, mesh_dim_names=layout.mesh_dims)
    return device, mesh


def grad_norm(
    params: list[nn.Parameter],
    layout: Layout,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    skip: set[int] | None = None,
    experts: tuple[set[int], dist.ProcessGroup] | None = None,
) -> torch.Tensor:
    """L2 norm of the whole model's gradient (all stages, all shards): what gradient clipping would see.

    Sharded gradients (DTensors) are reduced over their mesh; stages add up over the pp ranks. `skip`: ids
    of parameters counted elsewhere (the later copies of a tied weight). `experts`: ids of the expert
    parameters and the ep group: each ep rank holds other experts, so their squares add up over it.
    """
    expert_ids, ep_group = experts if experts is not None else (set(), None)
    by_layout: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and id(p) not in (skip or ()):
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
            by_layout.setdefault((id(p) in expert_ids, key), []).append(g)
    total = torch.zeros((), device=device)
    expert_total = torch.zeros((), device=device)
    for (is_expert, _), grads in sorted(by_layout.items(), key=lambda kv: kv[0][0]):
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if is_expert:
            expert_total += norm.float() ** 2
        else:
            total += norm.float() ** 2
    if ep_group is not None:
        dist.all_reduce(expert_total, group=ep_group)
        total += expert_total
    if layout.pp_enabled:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def peak_memory_bytes(device: torch.device) -> int:
    """The run's peak memory on this rank, at its end (every rank calls it once)."""
    return memory_so_far(device)


def memory_so_far(device: torch.device) -> int:
    """This rank's peak memory up to now, for a step's metrics (peak_memory_bytes is the end-of-run figure,
    which the measurement probe hooks: it is called by every rank once, this only by the reporting one)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _positive_int(text: str) -> int:
    """--steps: 0 or a negative count would train nothing and still replace metrics.json; argparse says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} steps would train nothing: pass 1 or more")
    return value


def parse_args(
    argv: Sequence[str] | None,
    description: str,
    steps: int,
    metrics: Path,
    checkpoint_every: int = 1000,
    init_from: str | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=_positive_int, default=steps, help=f"training steps (default {steps})")
    parser.add_argument(
        "--metrics",
        type=Path,
        default=metrics,
        help="where the last stage writes per-step loss, time and memory (default: next to this script); "
        "each step is also appended to the .jsonl file of the same name as it ends",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--init-from",
        default=init_from,
        metavar="PATH",
        help="start from these weights: a Hugging Face folder (safetensors) or repo id in the local cache, a DCP "
        f"checkpoint or a state_dict file (default: {init_from or 'the model own initialisation'})",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=checkpoint_every, metavar="N",
        help=f"save a checkpoint every N steps and at the end (0: only at the end; default {checkpoint_every})",
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=metrics.with_name("checkpoints"),
        help="where checkpoints go, one step-NNNNNNNN folder each (default: checkpoints/ next to this script)",
    )
    parser.add_argument(
        "--resume", nargs="?", const="", default=None, metavar="DIR",
        help="continue from the newest complete checkpoint under DIR (default: --checkpoint-dir), or from DIR "
        "itself if it is one; any plan of the same model and global batch can resume it",
    )
    parser.add_argument(
        "--sync-checkpoint", action="store_true",
        help="save checkpoints synchronously (default: asynchronously, written while training goes on)",
    )
    parser.add_argument(
        "--data", type=Path, default=None, metavar="PATH",
        help="a flat binary file of token ids (nanoGPT / Megatron-LM style), or a tokenized Hugging Face dataset "
        "folder (save_to_disk), to train on instead of the model file's batches (default: DATA_FILE at the top "
        "of train.py)",
    )
    parser.add_argument("--data-dtype", choices=["uint16", "uint32"], default=None, help="its token id type")
    parser.add_argument(
        "--data-column", default="input_ids", metavar="NAME", help="a dataset folder's token column (input_ids)"
    )
    args = parser.parse_args(argv)
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be 0 or more, got {args.checkpoint_every}")
    return args


def trace_and_cut(
    user: Any,
    spec: ModelFile,
    layout: Layout,
    seed: int,
    example: tuple[torch.Tensor, ...],
    tp_mesh: DeviceMesh | None,
    log: Callable[[str], None] = lambda _: None,
    device_type: str = "cuda",
) -> tuple[fx.GraphModule, list[Piece], dict[str, ParallelStyle], str, Layout]:
    """Trace the model on the meta device and cut it into pieces, each in one stage (the same on every
    rank: every rank cuts the whole model, then builds only its own stages), for a run on `device_type`; and the
    layout with the TP styles of tied copies added (parallel.with_tied_styles)."""
    gm, values, method = trace_for_plan(user, spec, layout, seed, example, log, device_type)
    sp_styles: dict[str, ParallelStyle] = {}
    if layout.tp_enabled and tp_mesh is not None:
        layout = with_tied_styles(layout, gm)
        localise_tp_sizes(gm, values, layout.tp_plan.styles, layout.tp, layout.tp_plan.fused)
    if layout.sp_enabled and tp_mesh is not None:
        sp_styles = sequence_parallel(gm, values, example, tp_mesh, layout)
    return gm, cut_into_pieces(gm, values, layout), sp_styles, method, layout


def accumulate(
    stage: nn.Module,
    layout: Layout,
    batches: list[tuple[torch.Tensor, ...]],
    loss_fn: Callable[..., torch.Tensor],
    n_inputs: int = 1,
    scale: float = 1.0,
) -> torch.Tensor:
    """One step without a pipeline: gradient accumulation over the micro-batches, each loss scaled by
    1/NUM_MICRO_BATCHES (the sum a pipeline schedule makes too) and by fp16's loss `scale`. Returns the mean
    micro-batch loss (unscaled)."""
    n = layout.num_micro_batches
    total = torch.zeros((), device=batches[0][0].device)
    for i, batch in enumerate(batches):
        # Gradients are reduced across dp once, after the last micro-batch.
        assert isinstance(stage, FSDPModule), "parallelize() applies FSDP2 or replicate to every stage"
        stage.set_requires_gradient_sync(i == n - 1)
        mb_loss = loss_fn(stage(*batch[:n_inputs]), *batch)
        (mb_loss * (scale / n)).backward()
        total += mb_loss.detach().float()
    return total / n


def pipeline_step(
    schedule: Any,
    layout: Layout,
    loss: MicroBatchLoss,
    batches: list[tuple[torch.Tensor, ...]],
    has_first: bool,
    has_last: bool,
    n_inputs: int = 1,
) -> torch.Tensor | None:
    """One step through the pipeline schedule; the mean micro-batch loss on the last stage's ranks."""
    loss.batches = batches
    losses: list[torch.Tensor] = []
    inputs = tuple(torch.cat([b[j] for b in batches]) for j in range(n_inputs)) if has_first else ()
    # The micro-batch numbers as the target, see MicroBatchLoss.
    # (not torch.arange: context parallelism's positions take an arange of the sequence's length)
    target = torch.tensor(list(range(layout.num_micro_batches))) if has_last else None
    loss.unscaled = {}
    schedule.step(*inputs, target=target, losses=losses if has_last else None, return_outputs=False)
    # the losses before fp16's scale (the schedule's are scaled; an overflowing step's would read inf)
    mean = torch.stack([x.float() for x in loss.before_scale(losses)]).mean() if has_last else None
    loss.unscaled = {}
    return mean


class Step:
    """One optimizer step as train.py's `train_step` sees it: this replica's micro-batches and the three parts of
    a step, each doing what the plan's layout needs (the pipeline schedule or gradient accumulation, tied weights,
    norms over every parallel group). `number` counts from 0; `stages`, `optimizers` and `schedulers` are this
    rank's, for a step that does more (a second loss, a per-group learning rate, an EMA of the weights)."""

    def __init__(
        self,
        number: int,
        batches: list[tuple[torch.Tensor, ...]],
        stages: list[LocalStage],
        optimizers: list[torch.optim.Optimizer],
        schedulers: list[Any],
        forward_backward: Callable[[list[tuple[torch.Tensor, ...]]], torch.Tensor | None],
        norm: Callable[[], torch.Tensor],
        grad_clip: float | None,
        loss_scale: LossScale | None = None,
        params: list[nn.Parameter] | None = None,
    ) -> None:
        self.number, self.batches, self.stages = number, batches, stages
        self.optimizers, self.schedulers = optimizers, schedulers
        self._forward_backward, self._norm, self._grad_clip = forward_backward, norm, grad_clip
        self.loss_scale = loss_scale if loss_scale is not None else LossScale(False)
        # this rank's parameters (the loop's list, built once; else collected from the stages)
        self._params = params if params is not None else [p for stage in stages for p in stage.parameters()]

    def forward_backward(self, batches: list[tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor | None:
        """Forward and backward over the micro-batches (default: the step's), gradients accumulated and reduced
        as the plan says. The mean micro-batch loss on ranks that hold the last stage, else None."""
        return self._forward_backward(self.batches if batches is None else batches)

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm over every parallel group (DTensor shards, pipeline stages, tied copies and
        expert shards each counted once), without clipping."""
        return self._norm()

    def clip_gradients(self, max_norm: float | None = None) -> torch.Tensor:
        """The global gradient norm over every parallel group; gradients scaled down to `max_norm` (default:
        GRAD_CLIP; None there: not clipped) where it is larger. Returns the norm before clipping."""
        norm = self._norm()
        clip_gradients(self._params, self._grad_clip if max_norm is None else max_norm, norm)
        return norm

    def optimizer_step(self) -> bool:
        """AdamW on this rank's parameters, gradients zeroed, then the learning-rate schedule's step. Under
        fp16 a step whose gradients overflowed on any rank is skipped (gradients zeroed, no update, the schedule
        not advanced) and the loss scale adjusted; returns whether the update was made."""
        skipped = self.loss_scale.found_inf
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            if not skipped:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not skipped:
                scheduler.step()
        self.loss_scale.update()
        return not skipped


def default_train_step(step: Step) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The step train.py writes out for editing: forward and backward, clipping, the optimizer."""
    loss = step.forward_backward()
    grad_norm = step.clip_gradients()
    step.optimizer_step()
    return loss, grad_norm


def run(
    layout: Layout,
    spec: ModelFile,
    training: Training,
    script: str | Path,
    argv: Sequence[str] | None = None,
    description: str = "Train the planned model.",
    init_from: str | None = None,
    train_step: Callable[[Step], tuple[torch.Tensor | None, torch.Tensor]] = default_train_step,
    predicted: dict[str, float] | None = None,
) -> None:
    """Train as the plan says; `script` is the train.py path (metrics.json goes next to it by default);
    `init_from`: the checkpoint the weights start from (train.py's --init-from overrides it); `train_step`: one
    optimizer step (train.py's, which people edit); `predicted`: the plan's step time, MFU and peak memory
    per GPU, written beside the measured ones in metrics.jsonl."""
    # Imported here, not at the top: torch.distributed.pipelining imports torch._dynamo, which nothing else in
    # the runtime needs.
    from .schedule import MicroBatchLoss, PlannedStage, build_schedule

    script = Path(script).resolve()
    args = parse_args(
        argv, description, training.steps, script.with_name("metrics.json"), training.checkpoint_every, init_from
    )
    device, mesh = init_distributed(layout, args.device, script.name)
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
    torch.manual_seed(training.seed)
    user = load_model_file(spec.path)
    loss_fn = getattr(user, spec.loss_fn) if spec.loss_fn else default_loss
    # Loss parallelism (tp, the next-token loss): the LM head's logits stay split by vocabulary (vocab.py).
    layout = with_loss_parallel(layout, getattr(user, spec.loss_fn) if spec.loss_fn else None)
    if layout.loss_parallel:
        loss_fn = VocabParallelLoss(loss_fn)
        log0(f"loss parallelism (the logits split by vocabulary): {', '.join(sorted(layout.sharded_heads))}")
    example = make_batch(user, spec, layout, training.seed, 0, 0)
    weights = open_checkpoint(args.init_from) if args.init_from else None
    data = token_file(args, training, script.parent, example)

    # 1. Trace and cut (pipelines, sequence parallelism) or take the model as it is; 2. build this rank's
    # stages; 3. parallelise each: TP, checkpointing, FSDP/replicate.
    local = layout.stages_on(pp_rank)
    stages: list[LocalStage]
    tied = None
    sp_styles: dict[str, ParallelStyle] = {}
    traced = None
    at_build = weights  # the weights read as the modules are built (a stage's tensors), else after sharding
    if uses_graph(layout):
        try:
            traced = trace_and_cut(
                user, spec, layout, training.seed, example, mesh["tp"] if layout.tp_enabled else None, log0,
                device.type,
            )
        except AsWritten as e:
            log0(str(e))
    if traced is not None:
        gm, pieces, sp_styles, method, layout = traced
        zero_bubble = layout.schedule == "zero-bubble"
        built, model = build_local_stages(
            user, spec, training.seed, gm, pieces, local, device, zero_bubble, weights
        )
        stages = list(built)
        loss_fn = with_structure(loss_fn, pieces[-1].out_spec)
        shared = shared_weights(gm, pieces)
        copies = own_copies(shared, model, stages, local)  # a weight two stages of this rank use: one copy each
        tied = TiedWeights(shared, layout, mesh, model, stages, local, copies)
    else:
        model = build_model(user, spec, training.seed, everything_on_meta=False)
        # The weights come in after sharding (each rank reads its shards), unless TP reorders fused rows or
        # expert parallelism keeps a slice of the experts.
        at_build = weights if layout.tp_plan.fused or layout.ep_enabled else None
        materialise(model, {n for n, _ in model.named_modules()}, device, training.seed, at_build)
        as_written = ModelStage(model, list(layout.stages[0].modules))
        if layout.zero_stage > 0:  # FSDP wraps the units one by one: not those whose weights are read elsewhere
            outside = model_reads_outside(user, spec, as_written.names, training.seed, example)
            if outside is None:
                log0("the model does not run on meta: each planned module is its own FSDP unit")
            elif outside:
                as_written.read_outside = outside
                log0(f"FSDP: {', '.join(outside)} in the stage's unit (weights read outside their forward)")
        stages, method = [as_written], "module"
    n_inputs = input_count(model, len(example))
    # Expert parallelism: this rank keeps its slice of each experts module of its stages (the model as
    # written, or a pipeline stage's pieces, which call the experts as modules), before FSDP/replicate wraps
    # them over the replicas of that slice. The ep group sits inside the stage's dp group (same pp rank).
    ep_mesh, expert_params = None, None
    if layout.ep_enabled:
        ep_mesh = init_device_mesh(
            device.type, (layout.pp, layout.dp // layout.ep, layout.ep, layout.tp),
            mesh_dim_names=("pp", "dp_replica", "ep", "tp"),
        )
        ep_rank, ep_group = ep_mesh["ep"].get_local_rank(), ep_mesh["ep"].get_group()
        roots: list[nn.Module] = [
            piece for stage in stages for piece in (stage.pieces if isinstance(stage, StageModule) else [stage.model])
        ]
        sharded = [e for root in roots for e in shard_experts(root, layout.experts, layout.ep, ep_rank, ep_group)]
        # (A pipeline's stages hold some of them; trace_and_cut checked that the graph calls every one.)
        if not layout.pp_enabled and len(sharded) != len(layout.experts):
            raise RunError(
                f"EXPERTS names {len(layout.experts)} experts module(s), the model has {len(sharded)} of them. "
                "Re-plan (planner plan ...)."
            )
    # Context parallelism: the weights are replicated over the cp ranks, so they sync (and ZeRO shards them) over
    # the dp x cp ranks, as torchtitan's dp_shard_cp; the loss is the whole sequence's (ContextParallelLoss).
    replicas = mesh["dp", "cp"]._flatten("dp_cp") if layout.cp_enabled else mesh["dp"]
    cp_rank = mesh["cp"].get_local_rank() if layout.cp_enabled else 0
    context = None
    if layout.cp_enabled:
        cp_group = mesh["cp"].get_group()
        own = getattr(user, spec.loss_fn) if spec.loss_fn else None
        cp_loss = ContextParallelLoss(own, cp_group, layout.cp, cp_rank)
        if cp_loss.custom is not None:
            log0(f"context parallelism: {spec.loss_fn} is not the next-token loss; it gets the whole sequence's logits")
        loss_fn = with_structure(cp_loss, traced[1][-1].out_spec) if traced is not None else cp_loss
        seq = example[0].shape[1] if example and example[0].dim() == 2 else 0
        context = ContextParallel(
            cp_group, layout.cp, cp_rank, seq, device, stage_buffers(stages),
            mesh["cp"] if device.type == "cuda" else None,
        )
    for i, stage in zip(local, stages, strict=True):
        parallelize(
            stage, mesh, layout, layout.stages[i].recompute, device, sp_styles, training.dtype, ep_mesh,
            replicas if layout.cp_enabled else None, full=layout.stages[i].full,
        )
    if weights is not None and at_build is None:
        load_sharded(model, weights, {n for n, _ in model.named_modules()})
    if ep_mesh is not None:
        ids = {id(p) for s in stages for m in s.modules() if isinstance(m, ExpertParallel) for p in m.parameters()}
        expert_params = (ids, ep_mesh["ep"].get_group())
    params = [p for stage in stages for p in stage.parameters()]
    summed = SummedOverTP(stages, layout, mesh["tp"].get_group()) if layout.sums_over_tp else None
    optimizers, schedulers = build_optimizers(stages, training, args.steps)
    loss_scale = LossScale(training.dtype == "fp16")  # fp16 trains with dynamic loss scaling; bf16 needs none
    checkpoints = Checkpointer(
        args.checkpoint_dir.resolve(), stages, optimizers, schedulers, device, not args.sync_checkpoint, log0,
        fused_params(layout.tp, layout.tp_plan.fused, layout.tp_plan.transposed),
    )
    start_step = 0
    batches_identity = {"kind": "batches", "micro_batch_size": layout.micro_batch_size}
    data_identity = data.identity() if data is not None else batches_identity
    if args.resume is not None:
        where = Path(args.resume) if args.resume else args.checkpoint_dir
        start_step = resume(checkpoints, where, layout, training, data_identity, loss_scale)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    how = "the model as written" if method == "module" else f"traced with {method}"
    log0(
        f"{how}; {layout.num_stages} stage(s), pp {layout.pp} x dp {layout.dp}"
        f"{f' x cp {layout.cp}' if layout.cp_enabled else ''} x tp {layout.tp}, "
        f"schedule {layout.schedule}, ZeRO {layout.zero_stage}; rank 0 holds {held:,} parameter values"
    )

    # 4. The pipeline (PP > 1): one PipelineStage per local stage, all in one schedule.
    loss = MicroBatchLoss(loss_fn)
    schedule = None
    if layout.pp_enabled:
        pipeline = [
            PlannedStage(stage, i, layout.num_stages, device, group=mesh["pp"].get_group())
            for i, stage in zip(local, stages, strict=True)
        ]
        schedule = build_schedule(layout, pipeline, loss)
    has_first, has_last = 0 in local, layout.num_stages - 1 in local
    reports = has_last and dp_rank == 0 and tp_rank == 0 and cp_rank == 0
    is_tokens = not example[0].is_floating_point()
    n = layout.num_micro_batches
    tokens_per_step = layout.dp * n * example[0].numel() if is_tokens else None

    scale_used = [loss_scale.scale]  # the scale the step's backward ran with, for metrics

    def forward_backward(batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        result: torch.Tensor | None
        scale_used[0] = loss_scale.scale
        with context.step() if context is not None else contextlib.nullcontext(), loss_context(layout):
            if schedule is None:
                result = accumulate(stages[0], layout, batches, loss_fn, n_inputs, loss_scale.scale)
            else:
                loss.scale = loss_scale.scale
                result = pipeline_step(schedule, layout, loss, batches, has_first, has_last, n_inputs)
        if tied is not None:
            tied.sum_gradients()
        if summed is not None:
            summed.sum_gradients()
        loss_scale.unscale_(params)  # fp16: gradients back to their size, an overflow on any rank found
        return result

    def norm_of_gradients() -> torch.Tensor:
        return grad_norm(
            params, layout, mesh["pp"].get_group(), device, tied.later_copies() if tied else None, expert_params
        )

    # 5. Train.
    board = tensorboard(args.metrics.parent / "tensorboard") if reports else None
    history = []
    jsonl = args.metrics.with_suffix(".jsonl")
    if reports and start_step == 0:
        jsonl.unlink(missing_ok=True)  # a fresh run's steps; a resumed run appends to the steps before it
    for step in range(start_step, args.steps):
        checkpoints.poll()
        start = time.perf_counter()
        first = dp_rank * n
        batches = [
            tuple(
                t.to(device) for t in (
                    make_batch(user, spec, layout, training.seed, step, first + i) if data is None
                    else data.micro_batch(step, first + i, layout.micro_batch_size, layout.samples_per_step)
                )
            )
            for i in range(n)
        ]
        if layout.cp_enabled:  # this cp rank's share of each sequence, its labels, and the whole tokens (the loss)
            batches = [shard_batch(b, layout.cp, cp_rank) for b in batches]
        step_loss, norm = train_step(Step(
            step, batches, stages, optimizers, schedulers, forward_backward, norm_of_gradients, training.grad_clip,
            loss_scale, params,
        ))
        if not has_last:
            step_loss = None  # only the last stage's ranks have the loss (a step may return something else)
        elif step_loss is None:
            raise RunError("train_step returned no loss on a rank that holds the last stage: return the loss that "
                           "step.forward_backward() gave (train.py's train_step).")
        if step_loss is not None:
            # The step's loss is the mean over the global batch: average the replicas' means (and, with context
            # parallelism, the cp ranks' shares of the sequence, ContextParallelLoss).
            dist.all_reduce(step_loss, group=replicas.get_group())
            step_loss = step_loss / (layout.dp * layout.cp)
        done = step + 1
        if args.checkpoint_every and done % args.checkpoint_every == 0 and done < args.steps:
            # Inside the step's time: what a save blocks the training for (an asynchronous one, its copy to CPU).
            checkpoints.save(done, train_state(done, layout, training, data_identity, loss_scale))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if reports:
            assert step_loss is not None, "the reporting rank runs the last stage, which has the loss"
            record = {"step": step + 1, "loss": step_loss.item(), "grad_norm": norm.item()}
            record["lr"] = optimizers[0].param_groups[0]["lr"] if optimizers else training.lr
            record["step_time_s"] = elapsed
            line = f"step {step + 1:>5}  loss {record['loss']:.6f}  grad norm {record['grad_norm']:.4f}"
            line += f"  {elapsed:.3f}s"
            if tokens_per_step:
                record["tokens_per_s"] = tokens_per_step / elapsed
                line += f"  {record['tokens_per_s']:,.0f} tokens/s"
            record["peak_memory_bytes"] = memory_so_far(device)  # this rank's peak so far
            if loss_scale.enabled:
                record["loss_scale"] = scale_used[0]
                record["skipped"] = loss_scale.found_inf
                if loss_scale.found_inf:
                    line += f"  skipped (fp16 overflow; loss scale now {loss_scale.scale:g})"
            if predicted:
                record.update(against_plan(predicted, elapsed))
                if "mfu" in record:
                    line += f"  MFU {record['mfu']:.1%} (plan {predicted['mfu']:.1%})"
            history.append(record)
            append_jsonl(jsonl, record)
            if board is not None:
                for key in ("loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"):
                    if key in record:
                        board.add_scalar(f"train/{key}", record[key], step + 1)
                board.flush()
            print(line, flush=True)
    if board is not None:
        board.close()
    if args.steps > start_step:
        checkpoints.save(args.steps, train_state(args.steps, layout, training, data_identity, loss_scale), final=True)
    checkpoints.wait()

    # 6. Metrics: every rank's peak memory, gathered to the reporting rank, which writes the file.
    rank_info = {
        "rank": dist.get_rank(),
        "pp": pp_rank,
        "dp": dp_rank,
        "tp": tp_rank,
        **({"cp": cp_rank} if layout.cp_enabled else {}),
        "stages": local,
        "peak_memory_bytes": peak_memory_bytes(device),
        # what the caching allocator held at its peak: allocated plus its fragmentation (CUDA only)
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rank_info)
    if reports:
        write_metrics(args.metrics, layout, history, everyone, device, method)
    # Every rank reaches the end before any tears its groups down.
    dist.barrier()
    if dist.get_backend() == "gloo":
        # gloo's teardown of DeviceMesh sub-groups can abort the process ("terminate called without an
        # active exception") after a finished run; everything is written, so leave without destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def token_file(
    args: argparse.Namespace, training: Training, here: Path, example: tuple[torch.Tensor, ...]
) -> Samples | None:
    """The corpus the run reads (--data, else DATA_FILE relative to train.py's folder), if any: a token file,
    or a tokenized Hugging Face dataset saved with save_to_disk."""
    path = args.data if args.data is not None else (here / training.data_file if training.data_file else None)
    if path is None:
        return None
    if len(example) != 1 or example[0].is_floating_point() or example[0].dim() != 2:
        raise RunError(
            f"--data {path}: a corpus gives (batch, sequence) token ids, but this model takes "
            f"{[tuple(t.shape) for t in example]} ({', '.join(str(t.dtype) for t in example)}). Write a get_batch in "
            "the model file that reads your data instead."
        )
    if is_saved_dataset(Path(path)):
        return SavedDataset(Path(path), args.data_column, example[0].shape[1], training.seed)
    return TokenFile(Path(path), args.data_dtype or training.data_dtype, example[0].shape[1], training.seed)


def train_state(
    step: int, layout: Layout, training: Training, data: dict[str, Any], loss_scale: LossScale | None = None
) -> dict[str, Any]:
    """What a checkpoint records beside the tensors: the step, the data position (batches are a function of
    (seed, step, micro-batch index), so the position is the step: step x global batch samples read) with the
    data's identity, and the facts a resumed run must share with this one."""
    return {
        "step": step,
        "seed": training.seed,
        "global_batch_size": layout.samples_per_step,
        "data": {**data, "step": step, "samples_read": step * layout.samples_per_step},
        "layout": layout.describe(),
        **({"loss_scale": loss_scale.state()} if loss_scale is not None and loss_scale.enabled else {}),
    }


def resume(
    checkpoints: Checkpointer,
    where: Path,
    layout: Layout,
    training: Training,
    data: dict[str, Any],
    loss_scale: LossScale | None = None,
) -> int:
    """Load the newest complete checkpoint under `where` (rank 0 chooses, every rank loads it); the step to
    continue from."""
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        found = latest(where.resolve())
        choice[0] = (str(found.path) if found.path else None, found.skipped_message())
    dist.broadcast_object_list(choice, src=0)
    path, skipped = choice[0]
    if skipped:
        log0(f"resume: {skipped}")
    if path is None:
        raise RunError(
            f"--resume: no complete checkpoint under {where}. Train without --resume, or point it at the folder "
            "holding the step-NNNNNNNN checkpoints (--checkpoint-dir of the run that saved them)."
        )
    state = checkpoints.load(Path(path))
    if state["global_batch_size"] != layout.samples_per_step:
        raise RunError(
            f"{path} was saved by a run of global batch {state['global_batch_size']}, this plan's is "
            f"{layout.samples_per_step}: the batches of the steps to come would differ from those the run would "
            "have seen. Re-plan with --global-batch-size "
            f"{state['global_batch_size']}, or start a new run from its weights."
        )
    if state["seed"] != training.seed:
        raise RunError(
            f"{path} was saved by a run of SEED {state['seed']}, this script's is {training.seed}: its data would "
            f"differ. Set SEED = {state['seed']} at the top of train.py."
        )
    check_same_data(state.get("data"), data, path)
    saved_mbs = state.get("data", {}).get("micro_batch_size")
    if data.get("kind") == "batches" and saved_mbs not in (None, layout.micro_batch_size):
        log0(
            f"resume: note: {path} was saved with micro-batches of {saved_mbs}, this plan's are "
            f"{layout.micro_batch_size}; the model file's batches are drawn per micro-batch, so the steps to come "
            "see other samples than the old run would have (a --data token file does not depend on it)."
        )
    if loss_scale is not None:
        loss_scale.load(state.get("loss_scale"))  # fp16: the scale the run had reached
    before = state["layout"]
    log0(
        f"resumed from {path} at step {state['step']} (saved under pp {before['pp']} x dp {before['dp']} x tp "
        f"{before['tp']}, ZeRO {before['zero_stage']})"
    )
    return int(state["step"])


def against_plan(predicted: dict[str, float], elapsed: float) -> dict[str, float]:
    """A step's measured MFU beside the plan's: the model FLOPs of a step are what the plan counted, so the
    measured MFU is the predicted one scaled by predicted / measured step time."""
    out: dict[str, float] = {}
    step_time = predicted.get("step_time_s")
    if step_time and elapsed > 0:
        out["predicted_step_time_s"] = step_time
        if predicted.get("mfu") is not None:
            out["mfu"] = predicted["mfu"] * step_time / elapsed
            out["predicted_mfu"] = predicted["mfu"]
    if predicted.get("peak_memory_bytes") is not None:
        out["predicted_peak_memory_bytes"] = predicted["peak_memory_bytes"]
    return out


def tensorboard(folder: Path) -> Any:
    """A TensorBoard writer into `folder` where the tensorboard package is installed, else None (metrics.jsonl
    holds the same figures)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(folder))


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One line per step, flushed as it ends (a run killed later keeps the steps it finished)."""
    # strict JSON: a non-finite figure (a diverged loss, an fp16 overflow's norm) is written as null
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean) + "\n")


def write_metrics(
    path: Path,
    layout: Layout,
    history: list[dict[str, Any]],
    ranks: list[dict[str, Any]],
    device: torch.device,
    method: str,
) -> None:
    """metrics.json: the layout, every rank's peak memory, and per step loss, gradient norm and speed."""
    write_json(
        path,
        {
            "layout": {**layout.describe(), "device": device.type, "trace_method": method},
            "memory_kind": "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_max_rss",
            "ranks": ranks,
            "steps": history,
        },
    )
