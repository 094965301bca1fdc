"""A plan as Megatron-LM's command-line arguments (NVIDIA/Megatron-LM, megatron/training/arguments.py and the
config dataclasses it turns into flags): tensor, pipeline, virtual, expert and sequence parallelism, micro and
global batch, recomputation and the distributed optimizer."""

from __future__ import annotations

import shlex

from planner.errors import ExportError
from planner.export import blocks_per_stage, seq_len
from planner.plan import Plan


def arguments(plan: Plan) -> list[str]:
    """The flags, in Megatron-LM's names."""
    p = plan.parallel
    if p.schedule in ("gpipe", "zero-bubble"):
        raise ExportError(
            f"Megatron-LM runs 1F1B, or interleaved 1F1B with virtual stages; it has no {p.schedule} schedule. "
            "Re-plan with --schedule 1f1b or interleaved-1f1b to export."
        )
    args = [
        "--tensor-model-parallel-size", str(p.tp),
        "--pipeline-model-parallel-size", str(p.pp),
        "--micro-batch-size", str(p.micro_batch_size),
        "--global-batch-size", str(p.global_batch_size),
    ]
    blocks = blocks_per_stage(plan)
    args += ["--num-layers", str(sum(blocks))]
    if p.pp > 1:
        args += _pipeline_split(blocks, p.virtual_stages)
    if p.ep > 1:
        args += ["--expert-model-parallel-size", str(p.ep)]
    if p.cp > 1:
        args += ["--context-parallel-size", str(p.cp)]
    if p.sequence_parallel and p.tp > 1:
        args.append("--sequence-parallel")
    if p.tp_overlap:  # Megatron's own overlap of the same collectives (Transformer Engine userbuffers)
        args.append("--tp-comm-overlap")
    seq = seq_len(plan)
    if seq is not None:
        args += ["--seq-length", str(seq)]
    modes = {s.recompute for s in plan.stages}
    if any(s.recompute_full_blocks for s in plan.stages):
        args += _block_recompute(plan, blocks)
    elif modes == {"full"}:
        # Every layer recomputed from its input: Megatron's full granularity, one layer per checkpoint.
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif modes == {"selective"}:
        args += ["--recompute-granularity", "selective"]
    elif modes == {"op"}:
        raise ExportError(
            "The plan recomputes per op (torchtitan's selective policy: every second matmul); Megatron-LM has no such "
            "granularity. Re-plan with --recompute full, selective or none."
        )
    elif modes != {"none"}:
        raise ExportError(
            f"The plan recomputes differently per stage ({', '.join(sorted(modes))}); Megatron-LM's "
            "--recompute-granularity is one for the model. Re-plan with --recompute full, selective or none."
        )
    if p.zero_stage in (1, 2):
        args.append("--use-distributed-optimizer")  # optimizer state (and gradient reduce-scatter) over dp
    elif p.zero_stage == 3:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    if plan.training.dtype == "bf16":
        args.append("--bf16")
    elif plan.training.dtype == "fp16":
        args.append("--fp16")
    return args


def block_recompute_counts(plan: Plan, blocks: list[int]) -> list[int]:
    """Each stage's blocks recomputed fully, in stage order (a stage at full recomputation counts all its
    `blocks`)."""
    stages = sorted(plan.stages, key=lambda s: s.index)
    return [b if s.recompute == "full" else s.recompute_full_blocks for s, b in zip(stages, blocks, strict=True)]


def block_recompute_layers(plan: Plan, blocks: list[int]) -> int:
    """N of `--recompute-num-layers` for a plan whose stages recompute their first blocks fully: the largest of
    `block_recompute_counts` where they differ (Megatron takes one N for every stage; stages planned with fewer
    then recompute more than planned, slower but within memory)."""
    return max(block_recompute_counts(plan, blocks))


def _block_recompute(plan: Plan, blocks: list[int]) -> list[str]:
    """Megatron-LM's block method: the first N layers of each (virtual) pipeline stage recomputed fully, the rest
    not at all (--recompute-granularity full excludes selective)."""
    rest = {s.recompute for s in plan.stages} - {"full"}
    if rest != {"none"}:
        raise ExportError(
            f"The plan recomputes its stages' first blocks fully and the rest {', '.join(sorted(rest))}; Megatron-LM's "
            "block method (--recompute-granularity full --recompute-method block) leaves the other layers without "
            "recomputation, and its granularity is full or selective, not both. Re-plan with --recompute none "
            "--recompute-blocks N to export."
        )
    n = block_recompute_layers(plan, blocks)
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]


def _pipeline_split(blocks: list[int], virtual: int) -> list[str]:
    """Megatron splits the layers evenly over the stages, or takes the first and last pipeline stage's counts
    (--decoder-first/last-pipeline-num-layers) with the others even; interleaving needs even stages."""
    if len(set(blocks)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(blocks[0])] if virtual > 1 else []
    middle = blocks[1:-1]
    if virtual == 1 and len(set(middle)) <= 1:
        out = ["--decoder-first-pipeline-num-layers", str(blocks[0])]
        return out + ["--decoder-last-pipeline-num-layers", str(blocks[-1])]
    raise ExportError(
        f"The plan's stages hold {blocks} layers; Megatron-LM takes even stages, or under 1F1B a first and a "
        "last stage of their own size. Re-plan (e.g. with --pp and a layer count it divides) to export."
    )


def render(plan: Plan) -> str:
    """megatron_args.sh: a bash array of the flags, to splice into a pretrain_gpt.py command line."""
    args = arguments(plan)
    counts = block_recompute_counts(plan, blocks_per_stage(plan))
    notes = []
    if any(s.recompute_full_blocks for s in plan.stages) and len(set(counts)) > 1:
        notes.append(
            f"# The plan recomputes {counts} blocks fully per stage; Megatron takes one --recompute-num-layers for "
            f"every stage: the largest, {max(counts)} (the others recompute more than planned: slower, less memory)."
        )
    lines = [
        "# The layout of "
        f"{plan.model_class} planned by planner {plan.planner_version}, as Megatron-LM's arguments. Use:",
        "#   source megatron_args.sh",
        f"#   torchrun --nproc-per-node ... pretrain_gpt.py \"${{PLANNED_ARGS[@]}}\" ...  (world size "
        f"{plan.parallel.world_size})",
        "# Megatron builds its own model: --num-layers and --seq-length must match the planned one's.",
        *notes,
        "PLANNED_ARGS=(",
    ]
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"    {args[i]} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            lines.append(f"    {args[i]}")
            i += 1
    return "\n".join([*lines, ")", ""])
