"""runtime.tp_graph: a traced graph's sizes of the sharded dimension made one tp rank's. nanoGPT's attention
(fused c_attn split by self.n_embd, heads by self.n_head and C // self.n_head) traced as the run traces it,
rewritten for tp 2, run on each rank's shard of the weights: the ranks' partial outputs sum to the model's."""

from __future__ import annotations

import importlib.util
import operator
from pathlib import Path

import torch
from torch import nn

from planner.runtime.parallel import chunk_shard_order
from planner.runtime.stages import trace
from planner.runtime.tp_graph import localise_tp_sizes

NANOGPT = Path(__file__).resolve().parent / "fixtures" / "models" / "nanogpt.py"


def _nanogpt():
    spec = importlib.util.spec_from_file_location("nanogpt_fixture", NANOGPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Wrapped(nn.Module):
    """One attention module at the root, so its Linears have the names TP_PLAN would give them."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _shard(full: nn.Linear, dim: int, rank: int, tp: int, chunks: int = 1) -> nn.Linear:
    weight, bias = full.weight.detach(), full.bias.detach() if full.bias is not None else None
    if chunks > 1:  # the fused projection reordered as parallel.interleave_fused does: [q_r | k_r | v_r]
        order = chunk_shard_order(weight.shape[0], chunks, tp)
        weight, bias = weight[order], bias[order] if bias is not None else None
    w = weight.chunk(tp, dim=dim)[rank]
    local = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        local.weight.copy_(w)
        if bias is not None:
            local.bias.copy_(bias.chunk(tp)[rank] if dim == 0 else bias / tp)  # rowwise: bias added once in total
    return local


def test_nanogpt_attention_rewritten_for_tp2_sums_to_the_whole():
    ng = _nanogpt()
    torch.manual_seed(0)
    cfg = ng.GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=8)
    model = Wrapped(ng.CausalSelfAttention(cfg))
    x = torch.randn(2, 8, 32)
    expected = model(x)

    tp = 2
    gm, values, method = trace(model, (x,))
    plan = {"attn.c_attn": "colwise", "attn.c_proj": "rowwise"}
    assert localise_tp_sizes(gm, values, plan, tp) >= 5  # the split, three head views, the merge view
    split = next(n for n in gm.graph.nodes if n.target == "split")
    assert split.args[1] == cfg.n_embd // tp
    total = torch.zeros_like(expected)
    for rank in range(tp):
        gm.attn.c_attn = _shard(model.attn.c_attn, 0, rank, tp, chunks=3)
        gm.attn.c_proj = _shard(model.attn.c_proj, 1, rank, tp)
        total += gm(x)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_sizes_outside_the_sharded_path_are_left_alone():
    """The head dimension (C // n_head), the batch and the sequence are the model's own: only the split width,
    the head counts and the merged width change; an unsharded projection's graph is not touched."""
    ng = _nanogpt()
    cfg = ng.GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=8)
    model = Wrapped(ng.CausalSelfAttention(cfg))
    gm, values, _ = trace(model, (torch.randn(2, 8, 32),))
    assert localise_tp_sizes(gm, values, {}, 2) == 0
    localise_tp_sizes(gm, values, {"attn.c_attn": "colwise", "attn.c_proj": "rowwise"}, 2)
    heads = [a for n in gm.graph.nodes if n.target == "view" for a in n.args[1:] if isinstance(a, int)]
    assert heads == [cfg.n_head // 2] * 3  # q, k, v: this rank's heads
    divisors = sorted(n.args[1] for n in gm.graph.nodes if n.target is operator.floordiv)
    # C // self.n_head (the head dimension, three times) keeps the model's head count; the merged width
    # view(B, T, C) gets C // tp
    assert divisors == [2, cfg.n_head, cfg.n_head, cfg.n_head]
