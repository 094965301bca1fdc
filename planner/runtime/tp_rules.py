"""The TP plan's rules on the model's own modules: which weight dimension a style splits, and whether the plan
applies (module types, divisibility). No torch.distributed here: the plan-time check applies them on meta
without importing DTensor and FSDP (parallel.py shards with them)."""

from __future__ import annotations

import torch
from torch import nn

from .errors import RefusedLayout, RunError
from .layout import Layout, chunk_widths
from .stages import has_module, owner_of


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is stored [in, out], applied as x @ W + b."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def split_dim(module: nn.Module, style: str) -> int:
    """The weight dimension a TP style splits: Linear weights are [out, in], Conv1D's [in, out], Embedding's
    [vocab, features] (colwise splits the outputs / features, rowwise the inputs / vocabulary)."""
    column = style.startswith("colwise")
    if is_conv1d(module):
        return 1 if column else 0
    if isinstance(module, nn.Embedding):
        return 1 if column else 0
    return 0 if column else 1


# norm_heads: the dimension of the norm's input that holds the heads ([b, s, heads, head_dim]); its input is
# split there, one rank's heads, and its weight (over head_dim) stays whole.
NORM_HEADS_DIM = 2


def splits_own_vocab(module: nn.Module) -> bool:
    """torchtitan's Embedding (torchtitan.models.common.embedding): its own forward runs the vocabulary-parallel
    lookup once given a `tp_group` (masks the ids outside its rows, looks up in its local weight, returns
    partial rows), and unwraps a DTensor weight, so torch's RowwiseParallel (DTensor ids) cannot drive it."""
    return (
        isinstance(module, nn.Embedding) and hasattr(module, "tp_group")
        and type(module).forward is not nn.Embedding.forward
    )


def splits_unevenly(module: nn.Module, style: str, size: int, tp: int, chunks: int = 1) -> bool:
    """Whether `size` rows of this module may be split over tp ranks in unequal shares: the vocabulary of an
    LM head whose logits are all-gathered (colwise_gather) or of an nn.Embedding looked up row-parallel.
    DTensor shards them as torch.chunk does (GPT-2's 50257 tokens over tp 2: 25129 and 25128 rows) and
    gathers or sums the whole result, so nothing downstream sees the split; but every rank must get a row
    (FSDP2 cannot shard an empty tensor). Everything else must divide: a column-parallel Linear feeds its
    shard to a row-parallel one, and head counts split with it."""
    if chunks > 1 or is_conv1d(module) or size <= -(-size // tp) * (tp - 1):
        return False
    if style == "colwise_gather":
        return isinstance(module, nn.Linear)
    return style == "rowwise" and isinstance(module, nn.Embedding) and not splits_own_vocab(module)


def mha_shardable(module: nn.MultiheadAttention) -> str:
    """Why tp cannot shard an nn.MultiheadAttention by heads (parallel.ShardedMultiheadAttention), or ''."""
    if not module._qkv_same_embed_dim:
        return "its keys and values have their own widths (kdim / vdim: separate q, k, v weights)"
    if module.bias_k is not None or module.add_zero_attn:
        return "it adds a learned key / value bias or a zero attention slot (add_bias_kv, add_zero_attn)"
    return ""


def _check_mha(name: str, module: nn.MultiheadAttention, style: str, layout: Layout) -> None:
    why = mha_shardable(module)
    if style != "colwise" or layout.tp_plan.fused.get(name) != 3 or why:
        raise RunError(
            f"TP_PLAN shards {name}, an nn.MultiheadAttention, as {style} with TP_FUSED "
            f"{layout.tp_plan.fused.get(name)}: the script shards one only colwise in 3 chunks (q, k, v by heads)"
            + (f", and not this one: {why}" if why else "") + ". Re-plan the model."
        )
    if module.num_heads % layout.tp:
        raise RefusedLayout(
            f"{name} has {module.num_heads} heads, which cannot be split over tp={layout.tp}: it must divide. "
            "Re-plan with a tp degree that divides the head count."
        )


def check_tp(roots: list[nn.Module], layout: Layout, heads: bool = True) -> None:
    """Whether the TP plan applies to the modules under `roots`: each sharded weight's split dimension (each
    chunk's, for a fused projection; a vocabulary may split unevenly, `splits_unevenly`) and each head-count
    attribute divides by tp, and each module is what the plan says (nn.Linear / nn.Embedding, or a Conv1D
    listed in TP_TRANSPOSED). Raises RunError naming the module (also at plan time). `heads`: also the head
    attributes (False for a traced stage's pieces, which hold only the weights: their graph's sizes are made
    the rank's instead, tp_graph; the model's attributes are checked on the model)."""
    for root in roots:
        for name, style in layout.tp_plan.styles.items():
            if not has_module(root, name):
                continue
            module = root.get_submodule(name)
            if style == "norm_heads":
                if not isinstance(getattr(module, "weight", None), nn.Parameter):
                    raise RunError(
                        f"TP_PLAN runs {name}, a {type(module).__name__}, as a norm over each head (norm_heads), "
                        "but it has no weight. Re-plan the model."
                    )
                continue
            if isinstance(module, nn.MultiheadAttention):
                _check_mha(name, module, style, layout)
                continue
            conv = is_conv1d(module)
            if conv != (name in layout.tp_plan.transposed):
                listed = "lists it in" if name in layout.tp_plan.transposed else "does not list it in"
                raise RunError(
                    f"TP_PLAN shards {name}, a {type(module).__name__}, but the plan {listed} TP_TRANSPOSED "
                    "(weight stored [in, out] is HF's Conv1D only). Re-plan the model."
                )
            if not conv and not isinstance(module, (nn.Linear, nn.Embedding)):
                raise RunError(
                    f"TP_PLAN shards {name}, a {type(module).__name__} ({style}), but torch's ColwiseParallel and "
                    "RowwiseParallel take only nn.Linear and nn.Embedding (and the script HF's Conv1D). Re-plan "
                    "without this pair (or with tp=1)."
                )
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            size = weight.shape[split_dim(module, style)]
            fused = layout.tp_plan.fused.get(name, 1)
            what = f"{fused} equal chunks" if isinstance(fused, int) else f"chunks of widths {fused}"
            try:
                widths = chunk_widths(size, fused)
            except ValueError:
                widths = []
            if fused != 1 and (style != "colwise" or not widths):
                raise RunError(
                    f"TP_FUSED splits {name} ({style}, size {size}) into {what}: only a colwise projection whose "
                    "width the chunks tile can be. Re-plan the model."
                )
            chunks = len(widths)
            bad = [w for w in widths if w % layout.tp]
            if bad and not splits_unevenly(module, style, size, layout.tp, chunks):
                what = f"each of its {chunks} chunks (sizes {widths})" if chunks > 1 else f"size {size}"
                raise RefusedLayout(
                    f"TP_PLAN splits {name} ({style}, {what}) over tp={layout.tp}: the size must divide. "
                    "Re-plan with a tp degree that divides it."
                )
        for name in layout.tp_plan.summed:
            try:
                root.get_parameter(name)
            except AttributeError:
                if heads:  # the whole model (a traced stage's pieces hold only their own weights)
                    raise RunError(
                        f"TP_SUMMED names {name}, which is not a parameter of the model: the weights whose "
                        "gradient is summed over tp must be the model's own. Re-plan the model."
                    ) from None
                continue
            styled = owner_of(name.rpartition(".")[0], layout.tp_plan.styles)
            if styled is not None:
                raise RunError(
                    f"TP_SUMMED names {name}, a weight of {styled}, which TP_PLAN shards "
                    f"({layout.tp_plan.styles[styled]}): a weight summed over tp is one every rank holds "
                    "whole. Re-plan the model."
                )
        for name, attrs in layout.tp_plan.head_attrs.items() if heads else ():
            if not has_module(root, name):
                continue
            module = root.get_submodule(name)
            for attr in attrs:
                value = getattr(module, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise RunError(
                        f"TP_HEAD_ATTRS names {name}.{attr}, which is {type(value).__name__}, not a head count. "
                        "Re-plan the model."
                    )
                if value % layout.tp:
                    raise RefusedLayout(
                        f"{name}.{attr} = {value} heads cannot be split over tp={layout.tp}: it must divide. "
                        "Re-plan with a tp degree that divides the head count."
                    )
