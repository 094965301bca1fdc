"""The default loss, used when the model file defines no loss_fn."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F


def output_field(output: Any, name: str) -> torch.Tensor | None:
    """`output[name]` or `output.name` when the model's output (dict, dataclass, Hugging Face ModelOutput)
    holds a tensor under that name, else None."""
    if isinstance(output, dict):
        value = output.get(name)
    elif dataclasses.is_dataclass(output) or hasattr(type(output), "__dataclass_fields__"):
        value = getattr(output, name, None)
    else:
        return None
    return value if isinstance(value, torch.Tensor) else None


def logits_of(output: Any) -> torch.Tensor:
    """The tensor the default loss works on: the output itself, its `logits`, or a tuple's first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    found = output_field(output, "logits")
    if found is not None:
        return found
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"The model returns {type(output).__name__} without a `loss` or `logits` tensor, so the default loss "
        "does not know what to train: define loss_fn(output, *inputs) in the model file."
    )


def default_loss(output: Any, *inputs: torch.Tensor) -> torch.Tensor:
    """The output's own `loss` if it has one; else, on its logits (the output, or its `logits`), next-token
    cross-entropy when integer tokens produce logits [b, s, vocab], and the mean otherwise."""
    loss = output_field(output, "loss")
    if loss is not None:
        return loss.float()
    logits = logits_of(output)
    tokens = inputs[0]
    if not tokens.is_floating_point() and logits.dim() == 3 and logits.shape[:2] == tokens.shape:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    return logits.float().mean()
