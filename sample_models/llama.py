"""Llama 2 / Llama 3 style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases).

Follows the model-file contract: ``build_model(**kwargs)`` and ``example_inputs(batch_size, **kwargs)``
receive the same keyword arguments (``--model-arg preset='llama3-8b'``): ``preset`` names a published
configuration and ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``, ``vocab``, ``seq``,
``rope_theta``, ``norm_eps`` override it; ``seed`` seeds the example tokens. Arguments a function does not
use are ignored. Without arguments the model is small enough to train on a CPU.

The layout is the one tensor parallelism expects (as in torchtitan): ``q``/``k``/``v`` column projections,
an ``o`` row projection, SwiGLU with ``w1``/``w3`` column and ``w2`` row, and every head count written as
``-1`` in reshapes so that a rank holding a shard of the heads runs the same code. The two custom modules
(RMSNorm and the rotary table) define ``reset_parameters()``, so a model built on the meta device can be
materialised module by module with ``to_empty(recurse=False)`` + ``reset_parameters()``.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

# Touvron et al. 2023 (Llama 2, Table 1 and the released configs); Llama 3 from Meta's released configs.
_LLAMA2 = {"vocab": 32000, "seq": 4096, "rope_theta": 10000.0}
_LLAMA3 = {"vocab": 128256, "seq": 8192, "rope_theta": 500000.0}
PRESETS: dict[str, dict[str, float]] = {
    "llama2-7b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32, "ffn": 11008, **_LLAMA2},
    "llama2-13b": {"layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 40, "ffn": 13824, **_LLAMA2},
    "llama2-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, **_LLAMA2},
    "llama3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, **_LLAMA3},
    "llama3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, **_LLAMA3},
}


@dataclass(frozen=True)
class LlamaConfig:
    """The default is a small model that trains in seconds on a CPU; ``ffn`` 0 means 2 * hidden."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 0
    vocab: int = 1024
    seq: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 2 * self.hidden


_FIELDS = {
    "layers": int,
    "hidden": int,
    "heads": int,
    "kv_heads": int,
    "ffn": int,
    "vocab": int,
    "seq": int,
    "rope_theta": float,
    "norm_eps": float,
}


def resolve_config(preset: str | None = None, **kwargs) -> LlamaConfig:
    """The preset's values (or the small default), overridden by any explicit field; other kwargs ignored."""
    cfg = LlamaConfig()
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"Unknown Llama preset {preset!r}; known presets: {', '.join(PRESETS)}.")
        cfg = replace(cfg, **{k: _FIELDS[k](v) for k, v in PRESETS[preset].items()})
    cfg = replace(cfg, **{k: cast(kwargs[k]) for k, cast in _FIELDS.items() if kwargs.get(k) is not None})
    for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "seq"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"Llama {name} must be at least 1, got {getattr(cfg, name)}.")
    if cfg.hidden % cfg.heads or cfg.head_dim % 2:
        raise ValueError(
            f"Llama hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads}) with an even head "
            "dimension (rotary embeddings rotate pairs); change hidden or heads."
        )
    if cfg.heads % cfg.kv_heads:
        raise ValueError(
            f"Llama heads ({cfg.heads}) must be a multiple of kv_heads ({cfg.kv_heads}); change kv_heads."
        )
    return cfg


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the training dtype (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021), real-valued in the rotate-half layout.

    ``freqs`` holds [cos | sin] of the angles, shape (seq, head_dim). It is a non-persistent buffer (not in
    the state dict), so ``reset_parameters()`` recomputes it after ``to_empty``.
    """

    def __init__(self, head_dim: int, seq: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.half = head_dim // 2
        self.seq = seq
        self.theta = theta
        self.register_buffer("freqs", torch.empty(seq, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Angles in fp32 on the buffer's device, whatever dtype the buffer has been cast to since.
        dev = self.freqs.device
        exponents = torch.arange(0, self.half, device=dev, dtype=torch.float32) / self.half
        inv_freq = 1.0 / self.theta**exponents
        angles = torch.outer(torch.arange(self.seq, device=dev, dtype=torch.float32), inv_freq)
        with torch.no_grad():
            self.freqs.copy_(torch.cat([angles.cos(), angles.sin()], dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (batch, seq, heads, head_dim); heads may be any (sharded) count."""
        cos = self.freqs[:, None, : self.half].type_as(x)  # (seq, 1, half): broadcasts over batch and heads
        sin = self.freqs[:, None, self.half :].type_as(x)
        x1 = x[..., : self.half]
        x2 = x[..., self.half :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention: each of ``kv_heads`` key/value heads serves several query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Query heads per kv head: the same on every tensor-parallel rank, since TP shards both by its degree.
        self.n_rep = cfg.heads // cfg.kv_heads
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k = nn.Linear(cfg.hidden, kv_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, kv_dim, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.seq, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.rotary(self.q(x).unflatten(-1, (-1, self.head_dim)))  # (b, s, heads, head_dim)
        k = self.rotary(self.k(x).unflatten(-1, (-1, self.head_dim)))  # (b, s, kv_heads, head_dim)
        v = self.v(x).unflatten(-1, (-1, self.head_dim))
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x); w1, w3 column-parallel, w2 row-parallel."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token embedding, ``blocks``, final RMSNorm and an untied ``head`` to logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(**kwargs) -> Llama:
    return Llama(resolve_config(**kwargs))


def example_inputs(batch_size: int, seed: int = 0, **kwargs) -> tuple[torch.Tensor]:
    """One micro-batch of random tokens, (batch_size, seq) int64 on the CPU, the same for the same seed."""
    cfg = resolve_config(**kwargs)
    gen = torch.Generator().manual_seed(int(seed))
    return (torch.randint(cfg.vocab, (int(batch_size), cfg.seq), generator=gen, device="cpu"),)


def loss_fn(output: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits at position t predict token t + 1 (mean over all positions)."""
    logits = output[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, tokens[:, 1:].flatten())
