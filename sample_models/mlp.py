"""A deep residual MLP regressor: a model-file example whose inputs are not tokens.

Follows the model-file contract. ``example_inputs(batch_size)`` returns ``(x, target)``, and the two
are used differently:

- the model is called on the first input only: ``output = model(x)``;
- the loss function receives the output and *all* inputs: ``loss_fn(output, x, target)``.

So inputs beyond the first (here ``target``) reach only ``loss_fn``. ``target`` is a fixed smooth
function of ``x`` (the same for every seed), so the regression can be learnt, not only memorised.

Keyword arguments (``--model-arg layers=16``), passed to both functions, each ignoring what it does not use:
``layers`` (8), ``width`` (256), ``ffn`` (4 * width), ``in_dim`` (64), ``out_dim`` (1); ``seed`` (0) for the
example batch; ``ffn_cycle`` (1): block i gets ``ffn * (1 + i % ffn_cycle)`` hidden units, so a value above
1 makes the blocks differ (a model that is not one run of identical blocks). Each block is LayerNorm ->
``fc1`` (column) -> GELU -> ``fc2`` (row) with a residual, the pair tensor parallelism shards with one
all-reduce.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

_TARGET_SEED = 1234  # the regression target's weights: fixed, so every batch samples one function


def _dims(layers=8, width=256, ffn=None, in_dim=64, out_dim=1, ffn_cycle=1, **_) -> dict[str, int]:
    dims = {
        "layers": int(layers),
        "width": int(width),
        "ffn": int(ffn or 4 * int(width)),
        "in_dim": int(in_dim),
        "out_dim": int(out_dim),
        "ffn_cycle": int(ffn_cycle),
    }
    for name, value in dims.items():
        if value < 1:
            raise ValueError(f"MLP {name} must be at least 1, got {value}.")
    return dims


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    """``proj_in`` -> ``blocks`` -> ``norm`` -> ``head`` (to ``out_dim``)."""

    def __init__(self, layers: int, width: int, ffn: int, in_dim: int, out_dim: int, ffn_cycle: int = 1):
        super().__init__()
        self.proj_in = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList([Block(width, ffn * (1 + i % ffn_cycle)) for i in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(**kwargs) -> MLP:
    return MLP(**_dims(**kwargs))


def example_inputs(batch_size: int, seed: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, target): x ~ N(0, 1), (batch_size, in_dim); target = tanh(x @ W), (batch_size, out_dim)."""
    d = _dims(**kwargs)
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.randn(int(batch_size), d["in_dim"], generator=gen, device="cpu")
    w_gen = torch.Generator().manual_seed(_TARGET_SEED)
    w = torch.randn(d["in_dim"], d["out_dim"], generator=w_gen, device="cpu") / math.sqrt(d["in_dim"])
    return x, torch.tanh(x @ w)


def loss_fn(output: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error against the target; x is unused (it is the model's input)."""
    return F.mse_loss(output.float(), target.float())
