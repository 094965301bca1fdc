"""A plan as torchtitan configures a run (pytorch/torchtitan, torchtitan/config/configs.py and trainer.py):
the fields of Trainer.Config's `parallelism`, `training` and `activation_checkpoint` sections.

torchtitan's configurations are Python functions returning a Trainer.Config (torchtitan/config/README.md:
"write your own function"); its `--section.option` flags still override them (frozen, kept for existing
scripts). The export writes both: `apply_plan(config)` for a configuration function, and FLAGS."""

from __future__ import annotations

import json
from typing import Any

from planner.errors import ExportError
from planner.export import seq_len, stage_modules
from planner.plan import Plan

# Our schedule names -> torch.distributed.pipelining's, as torchtitan's pipeline_parallel_schedule takes them
# (torch.distributed.pipelining.schedules.get_schedule_class).
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zero-bubble": "ZBVZeroBubble"}
# Recomputation -> the activation_checkpoint subcommand (torchtitan/distributed/activation_checkpoint.py).
# torchtitan's SelectiveAC is per-op (every second matmul and the rest recomputed, the attention kernels kept):
# our "op"; our "selective" (the attention core alone) maps to it as the closest policy torchtitan has.
AC_POLICIES = {
    "full": ("full", "FullAC"),
    "selective": ("selective", "SelectiveAC"),
    "op": ("selective", "SelectiveAC"),
}


def settings(plan: Plan) -> dict[str, Any]:
    """`section.field` -> value: the plan in torchtitan's config fields."""
    p = plan.parallel
    out: dict[str, Any] = {
        # ZeRO-0: replicas (DDP, HSDP's replicate dimension); ZeRO-1/2/3: FSDP2 over dp. ZeRO-1/2 keep the weights
        # gathered between forward and backward, as FSDP's reshard_after_forward=False.
        "parallelism.data_parallel_replicate_degree": p.dp if p.zero_stage == 0 else 1,
        "parallelism.data_parallel_shard_degree": p.dp if p.zero_stage > 0 else 1,
        "parallelism.fsdp_reshard_after_forward": "never" if p.zero_stage in (1, 2) else "default",
        "parallelism.tensor_parallel_degree": p.tp,
        "parallelism.enable_sequence_parallel": bool(p.sequence_parallel and p.tp > 1),
        "parallelism.pipeline_parallel_degree": p.pp,
        "parallelism.expert_parallel_degree": p.ep,
    }
    if p.cp > 1:
        out["parallelism.context_parallel_degree"] = p.cp
    if p.tp_overlap:  # torchtitan's async TP requires the model compiled
        out["parallelism.enable_async_tensor_parallel"] = True
        out["compile.enable"] = True
    if p.pp > 1:
        out["parallelism.pipeline_parallel_schedule"] = SCHEDULES[p.schedule]
        out["parallelism.module_fqns_per_model_part"] = stage_modules(plan)
        out["parallelism.num_pp_microbatches"] = p.num_micro_batches
    seq = seq_len(plan)
    if seq is None:
        raise ExportError(
            "torchtitan counts its batch in tokens (training.num_tokens_per_microbatch_per_dp_rank), but this "
            "plan's model does not take token sequences: export a plan of a language model."
        )
    out["training.num_tokens_per_microbatch_per_dp_rank"] = p.micro_batch_size * seq
    out["training.num_tokens_per_train_step"] = p.global_batch_size * seq
    out["training.max_context_length"] = seq
    out["training.steps"] = plan.training.steps
    out["training.mixed_precision_param"] = "float32" if plan.training.dtype == "fp32" else "bfloat16"
    return out


def activation_checkpoint(plan: Plan) -> tuple[str, str | None]:
    """(subcommand, policy class or None) for the plan's recomputation. torchtitan applies one policy to every
    block; stages that differ are refused."""
    blocks = [s.index for s in sorted(plan.stages, key=lambda s: s.index) if s.recompute_full_blocks]
    if blocks:
        raise ExportError(
            f"The plan recomputes the first blocks of stage(s) {blocks} fully and the rest at the stage's mode "
            "(Megatron-LM's --recompute-method block). torchtitan's activation_checkpoint has no per-stage count: its "
            "mode is full, selective (per op, or every Nth layer of the whole model), memory_budget or none, one "
            "policy for every block. Re-plan without --recompute-blocks (pin --recompute) to export to torchtitan."
        )
    modes = {s.recompute for s in plan.stages}
    if len(modes) > 1:
        raise ExportError(
            f"The plan recomputes differently per stage ({', '.join(sorted(modes))}); torchtitan applies one "
            "activation-checkpoint policy to every block. Re-plan with --recompute full, selective or none."
        )
    mode = modes.pop()
    return AC_POLICIES.get(mode, ("none", None))


def flags(plan: Plan) -> list[str]:
    """The `--section.option value` flags (tyro's syntax: lists as JSON, booleans as True/False)."""
    out = []
    for name, value in settings(plan).items():
        text = json.dumps(value) if isinstance(value, list) else str(value)
        out += [f"--{name}", text]
    sub, _ = activation_checkpoint(plan)
    return [f"activation-checkpoint:{sub}", *out]


def render(plan: Plan) -> str:
    """torchtitan_plan.py: apply_plan(config) and FLAGS."""
    if plan.parallel.schedule == "zero-bubble" and plan.parallel.virtual_stages != 2:
        raise ExportError("torchtitan's ZBVZeroBubble runs two stages per rank (a V): re-plan with --virtual-stages 2.")
    values = settings(plan)
    sub, policy = activation_checkpoint(plan)
    lines = [
        f'"""The layout of {plan.model_class} planned by planner {plan.planner_version}, as torchtitan configures it.',
        "",
        "In a configuration function (torchtitan/config/README.md):",
        "",
        "    from torchtitan_plan import apply_plan",
        "",
        "    def my_run() -> Trainer.Config:",
        "        return apply_plan(llama3_8b())",
        "",
        "or as flags: ./run_train.sh --module ... --config ... $(python torchtitan_plan.py)",
        f"World size: {plan.parallel.world_size} (NGPU x nodes).",
        '"""',
        "",
        "",
        "def apply_plan(config):",
        '    """Set the plan\'s parallelism, batch and activation checkpointing on a Trainer.Config."""',
    ]
    if policy is None:
        lines.append("    config.activation_checkpoint = None")
    else:
        lines += [
            f"    from torchtitan.distributed.activation_checkpoint import {policy}",
            "",
            f"    config.activation_checkpoint = {policy}.Config()",
        ]
    for name, value in values.items():
        lines.append(f"    config.{name} = {value!r}")
    lines += ["    return config", "", "", f"FLAGS = {flags(plan)!r}", "", "", 'if __name__ == "__main__":']
    lines += ["    import shlex", "", '    print(" ".join(shlex.quote(f) for f in FLAGS))', ""]
    return "\n".join(lines)
