"""GPT-2 / GPT-3 style decoder (learned positions, pre-LayerNorm, GELU MLP) following the model-file contract.

``build_model(**kwargs)`` and ``example_inputs(batch_size, **kwargs)`` receive the same keyword arguments
(``--model-arg layers=4``): ``preset`` names a published configuration, and ``layers``, ``hidden``,
``heads``, ``vocab``, ``seq``, ``ffn``, ``dropout`` override it; ``seed`` seeds the example tokens.
Arguments a function does not use are ignored. Without arguments the model is small enough to train on a CPU.

``attention`` picks the attention core: ``"sdpa"`` (the default) calls ``F.scaled_dot_product_attention``,
which runs a fused flash kernel on a GPU; ``"math"`` spells it out as Megatron-LM did in 2021 (Narayanan
et al. SC21): QK^T, causal mask, softmax and ``attn_dropout`` over the b x heads x s x s score tensor in
memory, then AV. The two give the same output with ``attn_dropout`` 0.

The layout is the one tensor parallelism expects (as in torchtitan): separate ``q``/``k``/``v`` column
projections and an ``o`` row projection, ``fc1`` (column) -> GELU -> ``fc2`` (row), and heads reshaped
with ``-1`` so that the same code runs when a rank holds only a shard of the heads. Every module that owns
parameters is a leaf with PyTorch's own ``reset_parameters()``, so a model built on the meta device can be
materialised module by module with ``to_empty(recurse=False)`` + ``reset_parameters()``.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

# name -> layers, hidden, heads, vocab, seq. GPT-2 from Radford et al. 2019 (Table 2; heads from the
# released checkpoints), GPT-3 from Brown et al. 2020 (Table 2.1), Megatron from Narayanan et al. SC21
# (Table 1).
_GPT2 = {"vocab": 50257, "seq": 1024}
# GPT-3 used 50257 tokens; Megatron pads the vocabulary to 51200 (a multiple of 1024).
_GPT3 = {"vocab": 51200, "seq": 2048}
PRESETS: dict[str, dict[str, int]] = {
    "gpt2-124m": {"layers": 12, "hidden": 768, "heads": 12, **_GPT2},
    "gpt2-350m": {"layers": 24, "hidden": 1024, "heads": 16, **_GPT2},
    "gpt2-774m": {"layers": 36, "hidden": 1280, "heads": 20, **_GPT2},
    "gpt2-1.5b": {"layers": 48, "hidden": 1600, "heads": 25, **_GPT2},
    # Table 2.1 gives 24 heads of 128 for d_model 2048, which do not multiply out; 16 x 128 is consistent.
    "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, **_GPT3},
    "gpt3-2.7b": {"layers": 32, "hidden": 2560, "heads": 32, **_GPT3},
    "gpt3-6.7b": {"layers": 32, "hidden": 4096, "heads": 32, **_GPT3},
    # The paper lists d_model 5140, which 40 heads do not divide; 5120 (head dim 128) is what is trained.
    "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40, **_GPT3},
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, **_GPT3},
    "megatron-1.7b": {"layers": 24, "hidden": 2304, "heads": 24, **_GPT3},
    "megatron-3.6b": {"layers": 30, "hidden": 3072, "heads": 32, **_GPT3},
    "megatron-7.5b": {"layers": 36, "hidden": 4096, "heads": 32, **_GPT3},
    "megatron-18b": {"layers": 40, "hidden": 6144, "heads": 48, **_GPT3},
    "megatron-39b": {"layers": 48, "hidden": 8192, "heads": 64, **_GPT3},
    "megatron-76b": {"layers": 60, "hidden": 10240, "heads": 80, **_GPT3},
    "megatron-145b": {"layers": 80, "hidden": 12288, "heads": 96, **_GPT3},
    "megatron-310b": {"layers": 96, "hidden": 16384, "heads": 128, **_GPT3},
    "megatron-530b": {"layers": 105, "hidden": 20480, "heads": 128, **_GPT3},
    "megatron-1t": {"layers": 128, "hidden": 25600, "heads": 160, **_GPT3},
}


@dataclass(frozen=True)
class GPTConfig:
    """The default is a small model that trains in seconds on a CPU; ``ffn`` 0 means 4 * hidden."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    vocab: int = 1024
    seq: int = 64
    ffn: int = 0
    dropout: float = 0.0  # 0 keeps training deterministic, so loss curves can be compared run to run
    attention: str = "sdpa"  # "sdpa" (fused) or "math" (unfused, the s x s scores in memory)
    attn_dropout: float = 0.0  # dropout on the attention probabilities; "math" only (SC21 used 0.1)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden


_FIELDS = {
    "layers": int,
    "hidden": int,
    "heads": int,
    "vocab": int,
    "seq": int,
    "ffn": int,
    "dropout": float,
    "attention": str,
    "attn_dropout": float,
}
ATTENTION = ("sdpa", "math")


def resolve_config(preset: str | None = None, **kwargs) -> GPTConfig:
    """The preset's values (or the small default), overridden by any explicit field; other kwargs ignored."""
    cfg = GPTConfig()
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"Unknown GPT preset {preset!r}; known presets: {', '.join(PRESETS)}.")
        cfg = replace(cfg, **PRESETS[preset])
    cfg = replace(cfg, **{k: cast(kwargs[k]) for k, cast in _FIELDS.items() if kwargs.get(k) is not None})
    for name in ("layers", "hidden", "heads", "vocab", "seq"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"GPT {name} must be at least 1, got {getattr(cfg, name)}.")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"GPT hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads}); change either.")
    if cfg.attention not in ATTENTION:
        raise ValueError(f"GPT attention must be one of {', '.join(ATTENTION)}, got {cfg.attention!r}.")
    if not 0.0 <= cfg.attn_dropout < 1.0:
        raise ValueError(f"GPT attn_dropout must be in [0, 1), got {cfg.attn_dropout}.")
    if cfg.attn_dropout and cfg.attention != "math":
        raise ValueError('GPT attn_dropout needs attention="math" (the fused SDPA path has no dropout here).')
    return cfg


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections (column) and an o projection (row)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.seq = cfg.seq
        self.attention = cfg.attention
        self.attn_dropout = cfg.attn_dropout
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.o = nn.Linear(cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, heads * head_dim) -> (b, heads, s, head_dim); -1 so that a shard of the heads works too.
        q = self.q(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.k(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.v(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        if self.attention == "math":
            y = self._math_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.o(y.transpose(1, 2).flatten(2)))

    def _math_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unfused causal attention with the (b, heads, s, s) scores in memory, as Megatron-LM ran in 2021.

        The scale goes on q (Megatron folds it into the QK^T GEMM as baddbmm's alpha), so that the s x s
        tensor sees only the mask, the softmax and the dropout. The softmax keeps the input dtype: PyTorch's
        kernel, like Megatron's fused scale-mask-softmax, reads fp16/bf16, accumulates in fp32 and writes
        fp16/bf16. Dropout calls ``torch.native_dropout``, the fused kernel ``F.dropout`` uses on a GPU (one
        pass, a one-byte mask), so that a meta-device analysis sees the GPU's ops. The mask is built here
        from ``seq`` (no buffer to materialise) and traces with torch.fx.
        """
        scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
        future = torch.ones(self.seq, self.seq, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        if self.training and self.attn_dropout > 0:
            probs = torch.native_dropout(probs, self.attn_dropout, True)[0]
        return probs @ v


class MLP(nn.Module):
    """fc1 (column) -> GELU -> fc2 (row)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_dim)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token + learned position embedding, ``blocks``, final LayerNorm and an untied ``head`` to logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.seq = cfg.seq
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # The sequence length comes from the model, not tokens.shape, so symbolic tracing needs no shapes.
        pos = torch.arange(self.seq, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(**kwargs) -> GPT:
    return GPT(resolve_config(**kwargs))


def example_inputs(batch_size: int, seed: int = 0, **kwargs) -> tuple[torch.Tensor]:
    """One micro-batch of random tokens, (batch_size, seq) int64 on the CPU, the same for the same seed."""
    cfg = resolve_config(**kwargs)
    gen = torch.Generator().manual_seed(int(seed))
    return (torch.randint(cfg.vocab, (int(batch_size), cfg.seq), generator=gen, device="cpu"),)


def loss_fn(output: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits at position t predict token t + 1 (mean over all positions)."""
    logits = output[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, tokens[:, 1:].flatten())


_ROWS = 256  # rows of logits the fused loss works on at a time (its only temporaries, fp32)


class _InPlaceCrossEntropy(torch.autograd.Function):
    """Cross-entropy as flash-attn's fused kernel computes it (CrossEntropyLoss(inplace_backward=True), which
    llm-foundry's MPT trains with: ComposerMPTCausalLM's loss_fn 'fused_crossentropy'): each row's log-sum-exp in
    fp32, keeping only the logits it was given (in their dtype) and one fp32 number per row for backward, whose
    gradient it writes over those logits in place. No fp32 copy of the logits is kept; its only temporaries are a
    block of rows at a time. Rows whose target is -100 count nothing (the mean is over the others)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        lse = torch.cat([torch.logsumexp(b.float(), dim=-1) for b in logits.split(_ROWS)])
        kept = targets != -100
        picked = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1).float()
        count = kept.sum().clamp(min=1)
        ctx.save_for_backward(logits, targets, lse, count)
        return ((lse - picked) * kept).sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        logits, targets, lse, count = ctx.saved_tensors
        scale = grad / count
        for start in range(0, logits.shape[0], _ROWS):
            rows, t = logits[start : start + _ROWS], targets[start : start + _ROWS, None]
            p = torch.exp(rows.float() - lse[start : start + _ROWS, None])
            p.scatter_add_(1, t.clamp(min=0), torch.full_like(p[:, :1], -1.0))
            rows.copy_(p * (scale * (t != -100)))
        return logits, None


def fused_loss_fn(output: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """loss_fn with flash-attn's fused cross-entropy (`_InPlaceCrossEntropy`) as llm-foundry's MPT calls it: on the
    logits as they are (a view, no copy), the targets the tokens shifted left with the last position ignored. The
    same loss, holding the logits in their dtype instead of their fp32 log-softmax and its gradients (plan with
    --loss-fn fused_loss_fn)."""
    targets = torch.roll(tokens, shifts=-1, dims=1)
    targets[:, -1] = -100
    return _InPlaceCrossEntropy.apply(output.reshape(-1, output.shape[-1]), targets.flatten())
