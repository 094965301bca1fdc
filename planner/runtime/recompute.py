"""Activation checkpointing of a stage's units (full, or selective: only the attention core recomputed), as the
run applies it and the plan-time check applies it on meta. No torch.distributed here."""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .context import recomputed
from .stages import LocalStage

# SDPA's fused kernels (the backends this torch build has)
FUSED_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _aten_ops(names: tuple[str, ...]) -> set[Any]:
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


# Ops of the attention core (QK^T, softmax, AV): what selective recomputation recomputes in backward
# (Korthikanti et al. 2022, section 5); every other op's output is kept.
ATTENTION_CORE = _aten_ops((*FUSED_ATTENTION, "_scaled_dot_product_attention_math", "_softmax", "bmm"))


def recompute_attention_core(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ATTENTION_CORE else CheckpointPolicy.MUST_SAVE


# Per-op selective checkpointing ("op"), torchtitan's SelectiveAC (torchtitan/distributed/activation_checkpoint.py;
# torchtitan/parallelisms/parallelize_llama.py at 9dec370, _save_list): keep the fused attention kernels' outputs
# and every odd aten.mm's output (the 1st, 3rd, ... of the region), recompute everything else. What it keeps is
# what planner.model.counting counts as `op_sac_saved`.
OP_SAC_SAVED = _aten_ops(FUSED_ATTENTION)


def op_sac_policy() -> Any:
    """A fresh per-region policy: its mm counts restart for every checkpointed call, the forward's and the
    recomputation's apart, so both make the same choices."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in OP_SAC_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_context() -> Any:
    return create_selective_checkpoint_contexts(op_sac_policy(), allow_cache_entry_mutation=True)


def checkpoint_in_place(unit: nn.Module, selective: bool, per_op: bool = False) -> None:
    """Activation checkpointing of `unit` without replacing it: its own forward runs under torch's checkpoint.
    The model still holds its module, so code reading a child's attributes (HF ViT reads
    `embeddings.patch_embeddings`) or checking its type keeps working, and parameter names do not change.
    (torch's composable checkpoint does the same with hooks, but cannot recompute twice, as zero-bubble's
    split backward does.) FSDP's hooks stay outside the checkpointed region, as with a wrapper module."""
    inner = recomputed(unit.forward)  # the class's forward, bound (context parallelism's mode when recomputed)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if per_op:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=_op_sac_context, **kwargs)
        if selective:
            # A saved output that the forward then fills in place (torch's composite rms_norm on CPU and meta:
            # `mean(x*x).add_(eps)`; torchtitan's router: `zeros_like(s).scatter_(...)`) is returned as it was
            # left: the in-place op is saved too, and only the attention core, which reads no tensor that is
            # mutated after it, is recomputed. Without this, such blocks fail in backward ("Tensor cached
            # during selective activation checkpoint has been mutated").
            context = functools.partial(
                create_selective_checkpoint_contexts, recompute_attention_core, allow_cache_entry_mutation=True
            )
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    unit.forward = forward


def apply_ac(stage: LocalStage, recompute: str, schedule: str, full: Collection[str] = ()) -> int:
    """Checkpoint each unit (one block) that holds parameters: keep its inputs, recompute it in backward.
    "full" recomputes the whole block; "selective" keeps everything but the attention core; "op" keeps every
    odd matmul's output and the attention kernels' (torchtitan's SelectiveAC); "none" checkpoints none.
    `full`: planned modules whose units are recomputed fully whatever `recompute` (Megatron-LM's block method:
    the stage's first blocks). Returns the number of units checkpointed fully."""
    if recompute not in ("none", "full", "selective", "op"):
        raise ValueError(f"Unknown recompute policy {recompute!r}: expected none, selective, op or full.")
    # Selective checkpointing allows one backward per region, but zero-bubble splits each backward in two
    # (input gradients, then weight gradients): there, recompute everything instead.
    selective = recompute == "selective" and schedule != "zero-bubble"
    per_op = recompute == "op" and schedule != "zero-bubble"
    blocks = frozenset(full)
    fully = 0
    for owner, unit in stage.owned_units():
        if not any(True for _ in unit.parameters()):
            continue
        if owner is not None and owner in blocks:
            checkpoint_in_place(unit, False)
            fully += 1
        elif recompute != "none":
            checkpoint_in_place(unit, selective, per_op)
            fully += not (selective or per_op)
    return fully
