"""The default loss, used when the model file defines no loss_fn."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def default_loss(output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy when integer tokens produce logits [b, s, vocab]; else the output's mean."""
    tokens = inputs[0]
    if not tokens.is_floating_point() and output.dim() == 3 and output.shape[:2] == tokens.shape:
        return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    return output.float().mean()
