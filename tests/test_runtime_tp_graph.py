"""runtime.tp_graph: a traced graph's sizes of the sharded dimension made one tp rank's. nanoGPT's attention
(fused c_attn split by self.n_embd, heads by self.n_head and C // self.n_head) traced as the run traces it,
rewritten for tp 2, run on each rank's shard of the weights: the ranks' partial outputs sum to the model's."""

from __future__ import annotations

import importlib.util
import operator
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.runtime.parallel import chunk_shard_order
from planner.runtime.stages import trace
from planner.runtime.tp_graph import indexed_dim, localise_tp_sizes

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


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv (Llama, Mistral, Qwen2), as written there."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class GQAAttention(nn.Module):
    """Grouped-query attention as Hugging Face's Llama writes it: heads reshaped with -1, each kv head repeated
    for its group of query heads by repeat_kv (a new dimension after the kv heads, then expand)."""

    def __init__(self, hidden: int = 64, heads: int = 8, kv_heads: int = 4) -> None:
        super().__init__()
        self.head_dim, self.groups = hidden // heads, heads // kv_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = repeat_kv(self.k_proj(x).view(shape).transpose(1, 2), self.groups)
        v = repeat_kv(self.v_proj(x).view(shape).transpose(1, 2), self.groups)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


def test_gqa_repeat_kv_rewritten_for_tp2_sums_to_the_whole():
    """8 query heads, 4 kv heads, tp 2: each rank holds 2 kv heads, each repeated for 2 query heads. repeat_kv's
    `[:, :, None]` puts the new dimension after the kv heads, so the expand's kv-head count (not the group size)
    is this rank's; reading the new dimension as one in front divided the group size instead ("expanded size 4
    must match 2" in the plan-time check of an HF Llama under tp x pp)."""
    torch.manual_seed(0)
    model = Wrapped(GQAAttention())
    x = torch.randn(4, 8, 64)  # batch 4 = the kv heads: sizes cannot tell the dimensions apart
    expected = model(x)

    tp = 2
    gm, values, method = trace(model, (x,))
    assert method == "fx-meta"  # repeat_kv unpacks x.shape: every size is baked into the graph
    plan = {f"attn.{p}_proj": "colwise" for p in "qkv"} | {"attn.o_proj": "rowwise"}
    assert localise_tp_sizes(gm, values, plan, tp) >= 2
    expands = [n for n in gm.graph.nodes if n.target == "expand"]
    # batch, this rank's 2 kv heads, each repeated for its group of 2 query heads, sequence, head dimension
    assert [n.args[1:] for n in expands] == [(4, 2, 2, 8, 8)] * 2
    total = torch.zeros_like(expected)
    for rank in range(tp):
        for p in "qkv":
            setattr(gm.attn, f"{p}_proj", _shard(getattr(model.attn, f"{p}_proj"), 0, rank, tp))
        gm.attn.o_proj = _shard(model.attn.o_proj, 1, rank, tp)
        total += gm(x)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


S = slice(None)


@pytest.mark.parametrize(
    ("index", "rank", "pos", "expected"),
    [
        ((S, S, None, S, S), 4, 1, 1),  # repeat_kv: the new dimension after the kv heads leaves them in place
        ((S, None), 4, 1, 2),  # a new dimension before them moves them up
        ((None,), 4, 1, 2),
        ((Ellipsis, None), 4, 3, 3),
        ((S, None, Ellipsis, None), 3, 2, 3),
        ((0,), 4, 1, 0),  # an int takes a dimension before them away
        ((0,), 4, 0, None),  # or takes them away
        ((S, slice(0, 2)), 3, 1, 1),
        (S, 2, 1, 1),
    ],
)
def test_indexed_dim_reads_where_the_sharded_dimension_goes(index, rank, pos, expected):
    assert indexed_dim(index, rank, pos) == expected


def test_an_index_it_cannot_read_is_refused():
    with pytest.raises(ValueError):
        indexed_dim((S, torch.tensor([0, 1])), 3, 1)


def test_chunks_of_any_widths_are_split_chunk_by_chunk_and_their_slices_made_the_ranks():
    """A fused output of q (4 columns) | k (2) | v (2), at tp 2: each rank's rows hold half of each chunk in
    order (q_r | k_r | v_r), and the slices that take the chunks at the model's offsets take them at half
    those offsets; equal chunks give the order they always gave."""
    from planner.runtime.parallel import chunk_shard_order
    from planner.runtime.tp_graph import _local_slice

    assert chunk_shard_order(8, [4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert chunk_shard_order(6, 3, 2).tolist() == chunk_shard_order(6, [2, 2, 2], 2).tolist() == [0, 2, 4, 1, 3, 5]
    with pytest.raises(ValueError, match="do not tile"):
        chunk_shard_order(8, [4, 2], 2)
    assert _local_slice((Ellipsis, slice(None, 4)), 3, 2, 2) == (Ellipsis, slice(None, 2))
    assert _local_slice((Ellipsis, slice(4, 6)), 3, 2, 2) == (Ellipsis, slice(2, 3))
    assert _local_slice((slice(None), slice(None), slice(-2, None)), 3, 2, 2) == (
        slice(None), slice(None), slice(-1, None)
    )
    assert _local_slice((Ellipsis, slice(None, 4)), 3, 1, 2) is None  # another dimension: the model's own
    assert _local_slice((Ellipsis, 3), 3, 2, 2) is None
