"""Loss parallelism, as torchtitan's: the vocabulary-parallel LM head's logits stay split by vocabulary (each tp rank
its [b, s, vocab / tp] share, a DTensor Shard(-1)) and the next-token cross-entropy runs on them under torch's
loss_parallel(), whose log-softmax and nll_loss reduce their maxima, sums and picked logits over tp: no rank holds
the whole logits, their fp32 copy or their gradient. Where the loss is another function of the logits, it gets them
whole (gathered, with their gradient split back), as a head with its output gathered gives them."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from .layout import Layout
from .loss import output_field

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# (DTensor and loss_parallel are imported where used: planning on meta imports neither, test_speed_imports)


def with_loss_parallel(layout: Layout, own_loss: Callable[..., torch.Tensor] | None) -> Layout:
    """`layout` with its vocabulary-parallel heads (TP_PLAN's colwise_gather) kept sharded where loss parallelism
    applies: tp > 1, no context parallelism (whose loss splits the sequence instead, ContextParallelLoss), and the
    loss the next-token cross-entropy: the default loss, or a model file's `own_loss` that computes it
    (`is_next_token_loss`). Else `layout` as it is: the heads' logits are gathered."""
    if not layout.tp_enabled or layout.cp_enabled or layout.loss_parallel:
        return layout
    from .context import is_next_token_loss

    heads = frozenset(n for n, s in layout.tp_plan.styles.items() if s == "colwise_gather")
    if not heads or (own_loss is not None and not is_next_token_loss(own_loss)):
        return layout
    return dataclasses.replace(layout, sharded_heads=heads)


def sharded_logits(output: Any) -> DTensor | None:
    """The logits the default loss reads (the output, its `logits`, or a tuple's first tensor) where they are a
    DTensor split on their last dimension, the vocabulary."""
    from torch.distributed.tensor import DTensor

    if isinstance(output, torch.Tensor):
        found: Any = output
    else:
        found = output_field(output, "logits")
        if found is None and isinstance(output, (tuple, list)) and output:
            found = output[0]
    if isinstance(found, DTensor) and found.placements and found.placements[-1].is_shard(found.dim() - 1):
        return found
    return None


class VocabParallelLoss:
    """`loss_fn` (the default loss, or a model file's loss_fn computing the same) on logits split by vocabulary:
    the next-token cross-entropy on this rank's share, to be run (forward and backward) under `loss_context`.
    An output it does not fit (a model's own `loss`, non-token inputs) reaches `loss_fn` with its DTensors whole."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, *inputs: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        logits = sharded_logits(output)
        tokens = inputs[0] if inputs else None
        if (
            logits is not None and output_field(output, "loss") is None and tokens is not None
            and not tokens.is_floating_point() and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(tokens.shape)
        ):
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
            # Replicated over tp: every rank's is the whole loss. A copy, not the DTensor's view: zero-bubble's split
            # backward detaches the last stage's output (the loss) in place, which a view refuses.
            return loss.to_local().clone() if isinstance(loss, DTensor) else loss
        return self.loss_fn(tree_map_only(DTensor, lambda t: t.full_tensor(), output), *inputs)


def loss_context(layout: Layout | None) -> contextlib.AbstractContextManager[None]:
    """torch's loss_parallel() where `layout` keeps logits sharded (around the loss's forward and its backward,
    which both run its vocabulary-parallel kernels), else (or without a layout) nothing."""
    if layout is None or not layout.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
