"""Tensor parallelism of torchtitan-style code, without torchtitan installed: complex rotary embeddings
(view_as_complex / view_as_real, as torchtitan's RoPE) keep the heads apart, so attention is a TP pair; and
an Embedding that runs its own vocabulary-parallel lookup (torchtitan's: a `tp_group` attribute, a forward
that unwraps a DTensor weight) is sharded the way torchtitan shards it, on 2 gloo ranks like one process."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from planner.model.analysis import analyse_model
from planner.model.load import load_model_file
from planner.runtime.layout import Layout, TPPlan
from planner.runtime.stages import ModelStage

ROPE_MODEL = textwrap.dedent(
    '''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    def rope(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


    class Attention(nn.Module):
        def __init__(self, dim, n_heads, seq):
            super().__init__()
            self.head_dim = dim // n_heads
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, dim, bias=False)
            self.wv = nn.Linear(dim, dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)
            angles = torch.outer(torch.arange(seq).float(), torch.ones(self.head_dim // 2))
            self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

        def forward(self, x):
            b, s, _ = x.shape
            freqs = self.freqs[:s].view(1, s, 1, -1)  # broadcast over batch and heads, as torchtitan's cache
            q = rope(self.wq(x).view(b, s, -1, self.head_dim), freqs)
            k = rope(self.wk(x).view(b, s, -1, self.head_dim), freqs)
            v = self.wv(x).view(b, s, -1, self.head_dim)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, s, -1))


    class Block(nn.Module):
        def __init__(self, dim, n_heads, seq):
            super().__init__()
            self.norm = nn.RMSNorm(dim)
            self.attention = Attention(dim, n_heads, seq)

        def forward(self, x):
            return x + self.attention(self.norm(x))


    class Model(nn.Module):
        def __init__(self, layers=2, dim=32, n_heads=4, seq=8, vocab=64):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, seq) for i in range(layers)})
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h)
            return self.output(h)


    def build_model(**_):
        return Model()


    def example_inputs(batch_size, seed=0, **_):
        return (torch.randint(0, 64, (batch_size, 8), generator=torch.Generator().manual_seed(seed)),)
    '''
)


def test_complex_rotary_attention_is_a_tp_pair(tmp_path):
    """torchtitan's RoPE multiplies view_as_complex(q) by a [1, seq, 1, head_dim/2] table: the heads stay the
    sharded dimension through it (it was taken for the sequence, and attention refused as a position bias)."""
    path = tmp_path / "rope_model.py"
    path.write_text(ROPE_MODEL)
    graph = analyse_model(load_model_file(path, dtype="fp32"))
    block = next(u for u in graph.units if u.name.startswith("layers."))
    prefix = block.name + ".attention."
    assert not block.tp_refused, block.tp_refused
    assert block.tp_shards_attention
    assert any(p.column == [prefix + c for c in ("wk", "wq", "wv")] and p.row == prefix + "wo" for p in block.tp_pairs)
    embedding = next(u for u in graph.units if "tok_embeddings" in u.name)
    assert embedding.tp_styles == {"tok_embeddings": "rowwise"}


class OwnVocabEmbedding(nn.Embedding):
    """torchtitan's Embedding (torchtitan.models.common.embedding), its forward as written there."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num, dim)
        self.tp_group = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if self.tp_group is None:
            return F.embedding(input, weight)
        tp_size = dist.get_world_size(self.tp_group)
        chunk = (self.num_embeddings + tp_size - 1) // tp_size
        offset = dist.get_rank(self.tp_group) * chunk
        mask = (input >= offset) & (input < offset + weight.shape[0])
        out = F.embedding((input - offset).clamp(0, weight.shape[0] - 1), weight)
        return out * mask.unsqueeze(-1).to(out.dtype)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = OwnVocabEmbedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx) * 2.0)


def _worker(rank: int, init: str, results: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from planner.runtime.parallel import apply_tp

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
        torch.manual_seed(0)
        whole = TinyLM()
        idx = torch.randint(0, 16, (2, 5))
        want = whole(idx)
        (want * torch.arange(want.numel()).view_as(want).sin()).sum().backward()
        lm = copy.deepcopy(whole)
        layout = Layout(pp=1, dp=1, tp=2, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["emb", "head"])],
                        tp_plan=TPPlan(styles={"emb": "rowwise", "head": "colwise_gather"}))
        apply_tp(ModelStage(lm, ["emb", "head"]), mesh["tp"], layout, {})
        assert isinstance(lm.emb.weight, DTensor) and lm.emb.weight.to_local().shape == (8, 8)
        got = lm(idx)
        (got * torch.arange(got.numel()).view_as(got).sin()).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lm.emb.weight.grad.full_tensor(), whole.emb.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lm.head.weight.grad.full_tensor(), whole.head.weight.grad, rtol=1e-5, atol=1e-6)
        # Both ranks done with every collective before the group goes: a rank that destroys it while gloo still
        # works for the other aborted at exit once in CI ("terminate called without an active exception").
        dist.barrier()
        if rank == 0:
            Path(results).write_text("ok")
    finally:
        dist.destroy_process_group()


def test_an_embedding_that_splits_its_own_vocabulary_trains_like_one_process(tmp_path):
    """torch's RowwiseParallel hands such an embedding DTensor ids, which its forward mixes with its local
    weight ("aten.embedding: mixed torch.Tensor and DTensor"); the runtime gives it its tp group instead and
    sums its partial rows. Output and weight gradients equal the unsharded model's. Spawned (see
    test_runtime_parallel: a fork of a pytest-xdist worker can hang in gloo)."""
    import torch.multiprocessing as mp

    results = tmp_path / "ok"
    mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(results)), nprocs=2, join=True)
    assert results.read_text() == "ok"


class RouterBlock(nn.Module):
    """What torchtitan's blocks do in place inside a checkpointed block: nn.RMSNorm (torch's composite
    rms_norm on CPU and meta: `mean(x * x).add_(eps)`) and a routing mask filled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.gate = nn.Linear(8, 4, bias=False)
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.gate(h).softmax(-1)
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(2, dim=-1).indices, True)
        weight = (scores * mask).sum(-1, keepdim=True)
        return x + self.proj(h) * weight


def test_selective_recompute_of_a_block_that_fills_tensors_in_place_matches_no_recompute():
    """Selective recompute saves every op's output but the attention core's; outputs the block then mutates
    in place are kept as left ("Tensor cached during selective activation checkpoint has been mutated"
    before, which refused torchtitan deepseek_v3 at plan time). Loss and gradients equal the plain run."""
    from planner.runtime.recompute import checkpoint_in_place

    torch.manual_seed(0)
    plain = RouterBlock()
    checked = copy.deepcopy(plain)
    checkpoint_in_place(checked, selective=True)
    x = torch.randn(2, 5, 8)
    want, got = plain(x), checked(x)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
