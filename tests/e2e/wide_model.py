"""A model of 240 uniquely named (unnumbered) small layers: its stage lists do not compress into
"blocks.{0-5}" runs, so train.py carries them in layout.json (the model-file contract)."""

from __future__ import annotations

import torch
from torch import nn

NAMES = [f"proj_{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(240)]  # proj_aa, proj_ab, ...


class Wide(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        for name in NAMES:
            setattr(self, name, nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in NAMES:
            x = x + 0.1 * torch.tanh(getattr(self, name)(x))
        return x


def build_model(width: int = 8) -> nn.Module:
    return Wide(width)


def example_inputs(batch_size: int, width: int = 8) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, width),)
