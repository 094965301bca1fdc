"""A tiny GPT-like model following the model-file contract, for the codegen end-to-end tests.

Mirrors the layout of the sample models (an nn.ModuleList `blocks`, separate q/k/v/o projections, an MLP
with fc1/fc2, head counts written as -1 in views) but differs where the generated script must cope: no
loss_fn (the default next-token loss applies), a root-level nn.Parameter used functionally (pos_emb), a
module without reset_parameters() (LayerScale), and optionally a branch that torch.fx cannot trace and
tied embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LayerScale(nn.Module):
    """A learnt per-channel gain, deliberately without reset_parameters() (the script's default init)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.scale = LayerScale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.scale(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, check_length: bool, tie: bool):
        super().__init__()
        self.check_length = check_length
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.empty(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:  # GPT-2's tied input and output embeddings
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # A branch on a tensor made from the input's shape: torch.fx cannot trace it, nor can the trace with meta
        # values (a meta tensor holds no value); torch.export can (a fake tensor keeps the constant).
        if self.check_length and torch.tensor(idx.shape[1]) > self.pos_emb.shape[0]:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than the model's {self.pos_emb.shape[0]}")
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(
    vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 32, check_length: bool = False,
    tie: bool = False, **_: object,
) -> TinyGPT:
    """check_length=True adds a Python branch on a tensor of the input's shape, which sends tracing to torch.export;
    tie=True shares the embedding with the output head."""
    return TinyGPT(vocab, dim, heads, layers, seq, check_length, tie)


def example_inputs(batch_size: int, vocab: int = 256, seq: int = 32, seed: int = 0, **_: object):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch_size, seq), generator=g),)
