"""planner.runtime.parallel without a process group: the TP plan's checks, head-count attributes divided by
tp, and the model-as-written stage whose planned modules are the checkpoint / FSDP units."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.runtime import Layout, RunError, TPPlan
from planner.runtime.parallel import apply_head_attrs, chunk_shard_order, interleave_fused
from planner.runtime.recompute import apply_ac
from planner.runtime.stages import ModelStage
from planner.runtime.tp_rules import check_tp


class Attention(nn.Module):
    """Reshapes by an absolute head count, as torchtitan's and many hand-written models do."""

    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _layout(tp, tp_plan=None, heads=None):
    return Layout(pp=1, dp=1, tp=tp, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["attn", "head"])],
                  tp_plan=TPPlan(styles=tp_plan or {}, head_attrs=heads or {}))


def test_head_attributes_are_divided_by_tp():
    net = Net()
    layout = _layout(2, {"attn.qkv": "colwise", "attn.o": "rowwise"}, {"attn": ["heads"]})
    check_tp([net], layout)
    apply_head_attrs([net], layout)
    assert net.attn.heads == 2


@pytest.mark.parametrize(
    ("tp", "plan", "heads", "message"),
    [
        (3, {"attn.o": "rowwise"}, {}, r"splits attn.o \(rowwise, size 8\) over tp=3"),
        (2, {}, {"attn": ["heads", "missing"]}, r"attn.missing, which is NoneType, not a head count"),
        (8, {}, {"attn": ["heads"]}, r"attn.heads = 4 heads cannot be split over tp=8"),
        (2, {"attn": "colwise"}, {}, r"shards attn, a Attention \(colwise\), but torch's ColwiseParallel"),
        (2, {"attn": "norm_heads"}, {}, r"runs attn, a Attention, as a norm over each head \(norm_heads\), but"),
    ],
)
def test_tp_decisions_that_cannot_apply_are_refused(tp, plan, heads, message):
    with pytest.raises(RunError, match=message):
        check_tp([Net()], _layout(tp, plan, heads))


class Vocab(nn.Module):
    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)


@pytest.mark.parametrize(
    ("vocab", "tp", "ok"), [(5, 2, True), (5, 3, True), (5, 4, False), (3, 4, False), (7, 4, True)]
)
def test_a_vocabulary_splits_unevenly_while_every_rank_keeps_a_row(vocab, tp, ok):
    # torch.chunk's shares: 5 over 4 is 2, 2, 1 and an empty fourth, which FSDP2 cannot shard.
    layout = Layout(pp=1, dp=1, tp=tp, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["emb", "head"])],
                    tp_plan=TPPlan(styles={"emb": "rowwise", "head": "colwise_gather"}))
    if ok:
        check_tp([Vocab(vocab)], layout)
    else:
        with pytest.raises(RunError, match=rf"splits emb \(rowwise, size {vocab}\) over tp={tp}"):
            check_tp([Vocab(vocab)], layout)


def test_an_uneven_split_of_a_paired_projection_is_refused():
    # a column-parallel Linear feeds a row-parallel one: must divide
    layout = Layout(pp=1, dp=1, tp=2, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["emb", "head"])],
                    tp_plan=TPPlan(styles={"head": "colwise"}))
    with pytest.raises(RunError, match=r"splits head \(colwise, size 5\) over tp=2"):
        check_tp([Vocab(5)], layout)


def test_a_model_stage_runs_the_model_and_checkpoints_its_planned_modules():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 5, 8)
    want = net(x)
    stage = ModelStage(net, ["attn", "head", "not-a-module"])
    assert stage.names == ["attn", "head"]
    attn, head = net.attn, net.head
    apply_ac(stage, "full", "1f1b")
    # Checkpointed in place: the model keeps its own modules (their forward runs under checkpoint).
    assert net.attn is attn and net.head is head and "forward" in vars(attn) and "forward" in vars(head)
    got = stage(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert net.attn.qkv.weight.grad is not None


# --- chunk-wise (fused q, k, v) and transposed (Conv1D) sharding ----------------------------------------------


class Conv1D(nn.Module):
    """HF's Conv1D as transformers writes it (y = x @ W + b, W stored [in, out], nf read in forward)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class SplitAttention(nn.Module):
    """A fused qkv split by an absolute width and reshaped by an absolute head count (headcount_gpt, GPT-2)."""

    def __init__(self, conv: bool, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.qkv = Conv1D(3 * dim, dim) if conv else nn.Linear(dim, 3 * dim)
        self.proj = Conv1D(dim, dim) if conv else nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(self.dim, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.dim))


def _attention_layout(conv: bool, tp: int) -> Layout:
    return Layout(
        pp=1, dp=1, tp=tp, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["attn"])],
        tp_plan=TPPlan(
            styles={"attn.qkv": "colwise", "attn.proj": "rowwise"}, head_attrs={"attn": ["dim", "heads"]},
            fused={"attn.qkv": 3}, transposed=["attn.qkv", "attn.proj"] if conv else [],
        ),
    )


def test_chunk_shard_order_gives_each_rank_its_share_of_every_chunk():
    # 3 chunks of width 4 over tp=2: rank 0 holds q[0:2] k[0:2] v[0:2], rank 1 the second halves.
    assert chunk_shard_order(12, 3, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert chunk_shard_order(6, 3, 1).tolist() == list(range(6))


@pytest.mark.parametrize("conv", [False, True], ids=["fused-linear", "conv1d"])
def test_fused_and_transposed_shards_reproduce_the_unsharded_output(conv):
    """Simulate tp=2 in one process: each rank's slices (after the chunk reorder) run the model with its head
    attributes divided; the row projection's partial outputs summed equal the whole module's output."""
    torch.manual_seed(0)
    tp = 2
    whole = nn.Module()
    whole.attn = SplitAttention(conv)
    x = torch.randn(2, 5, 8)
    want = whole.attn(x)
    layout = _attention_layout(conv, tp)
    check_tp([whole], layout)
    reordered = copy.deepcopy(whole)
    interleave_fused(reordered.attn.qkv, "colwise", 3, tp)
    col = 1 if conv else 0  # the output-feature dimension of the column's weight: Conv1D stores [in, out]
    row = 0 if conv else 1
    total = torch.zeros_like(want)
    for r in range(tp):
        local = copy.deepcopy(whole)
        apply_head_attrs([local], layout)
        assert (local.attn.dim, local.attn.heads) == (4, 2)
        q_w = reordered.attn.qkv.weight.detach().chunk(tp, dim=col)[r]
        q_b = reordered.attn.qkv.bias.detach().chunk(tp)[r]
        p_w = whole.attn.proj.weight.detach().chunk(tp, dim=row)[r]
        with torch.no_grad():
            local.attn.qkv.weight = nn.Parameter(q_w.clone())
            local.attn.qkv.bias = nn.Parameter(q_b.clone())
            local.attn.proj.weight = nn.Parameter(p_w.clone())
            local.attn.proj.bias = nn.Parameter(torch.zeros_like(whole.attn.proj.bias))
            if conv:
                local.attn.qkv.nf, local.attn.proj.nf = 12, 8
            total += local.attn(x)
    torch.testing.assert_close(total + whole.attn.proj.bias.detach(), want, rtol=1e-5, atol=1e-6)


def _tp_worker(rank: int, init: str, results: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh


    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
        for conv in (False, True):
            _check_attention_shards(mesh, conv)
        _check_tied_weights_stay_tied(mesh)
        _check_norm_heads(mesh)
        _check_multihead_attention(mesh)
        _check_sequence_parallel_on_a_cp_share(mesh)
        dist.barrier()
        if rank == 0:
            Path(results).write_text("ok")
    finally:
        dist.destroy_process_group()


def _check_attention_shards(mesh, conv: bool) -> None:
    """SplitAttention sharded by apply_tp equals the whole one: output, input gradient, weight gradients."""
    from torch.distributed.tensor import DTensor

    from planner.runtime.parallel import apply_tp

    torch.manual_seed(0)
    whole = nn.Module()
    whole.attn = SplitAttention(conv)
    sharded = copy.deepcopy(whole)
    x = torch.randn(2, 5, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    want = whole.attn(x)
    (want * torch.arange(want.numel()).view_as(want).sin()).sum().backward()
    stage = ModelStage(sharded, ["attn"])
    apply_tp(stage, mesh["tp"], _attention_layout(conv, 2), {})
    assert isinstance(sharded.attn.qkv.weight, DTensor)
    got = sharded.attn(x2)
    (got * torch.arange(got.numel()).view_as(got).sin()).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6)
    order = chunk_shard_order(24, 3, 2)
    col = 1 if conv else 0
    for name in ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias"):
        ref = whole.attn.get_parameter(name).grad
        grad = sharded.attn.get_parameter(name).grad
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        if name.startswith("qkv"):  # the fused column holds its features chunk-reordered
            ref = ref.index_select(col if name.endswith("weight") else 0, order)
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-6, msg=name)


class HeadNormAttention(nn.Module):
    """Qwen3's shape: q and k normalised per head by one RMSNorm over head_dim, shared by all heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(2), nn.RMSNorm(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, -1, 2)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, -1, 2)).transpose(1, 2)
        v = self.v(x).view(b, s, -1, 2).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def _check_norm_heads(mesh) -> None:
    """norm_heads: each rank normalises its own heads; the norms' weight gradients, summed over tp by
    DTensor, equal the whole model's (a plain replicated weight would get its own heads' share only)."""
    from torch.distributed.tensor import DTensor

    from planner.runtime.parallel import apply_tp

    torch.manual_seed(2)
    whole = nn.Module()
    whole.attn = HeadNormAttention()
    with torch.no_grad():
        whole.attn.q_norm.weight.uniform_(0.5, 1.5)
        whole.attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 8)
    want = whole.attn(x)
    (want * torch.arange(want.numel()).view_as(want).sin()).sum().backward()
    sharded = copy.deepcopy(whole)
    sharded.zero_grad(set_to_none=True)
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "attn.q_norm": "norm_heads", "attn.k_norm": "norm_heads"}
    layout = Layout(pp=1, dp=1, tp=2, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["attn"])],
                    tp_plan=TPPlan(styles=plan))
    apply_tp(ModelStage(sharded, ["attn"]), mesh["tp"], layout, {})
    got = sharded.attn(x)
    (got * torch.arange(got.numel()).view_as(got).sin()).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Every gradient, so that every collective behind them is waited for before the group goes away.
    for name, param in sharded.attn.named_parameters():
        grad = param.grad
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        torch.testing.assert_close(full, whole.attn.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)


def _check_multihead_attention(mesh) -> None:
    """nn.MultiheadAttention sharded by heads (ShardedMultiheadAttention, out_proj row-parallel) equals the whole
    one: outputs, averaged attention weights, input and weight gradients; batch-first and not, a key padding mask
    with a boolean attention mask, a per-head float mask, a causal hint, cross-attention."""
    from torch.distributed.tensor import DTensor

    from planner.runtime.parallel import ShardedMultiheadAttention, apply_tp

    def run(attn, q, kv, **kw):
        out, weights = attn(q, kv, kv, **kw)
        loss = (out * torch.arange(out.numel()).view_as(out).sin()).sum()
        if weights is not None:
            loss = loss + (weights * torch.arange(weights.numel()).view_as(weights).cos()).sum()
        loss.backward()
        return out, weights

    heads, width, b, s = 4, 8, 2, 5
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    cases = [
        (True, False, dict(need_weights=False)),
        (False, False, dict(key_padding_mask=torch.tensor([[False] * 4 + [True], [False] * 5]), attn_mask=causal)),
        (True, False, dict(attn_mask=torch.randn(b * heads, s, s), need_weights=False)),
        (True, False, dict(attn_mask=causal, is_causal=True, need_weights=False)),
        (True, True, dict(need_weights=True)),  # cross-attention: keys and values from another sequence
    ]
    for i, (batch_first, cross, kw) in enumerate(cases):
        torch.manual_seed(10 + i)
        whole = nn.Module()
        whole.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        sharded = copy.deepcopy(whole)
        shape = (b, s, width) if batch_first else (s, b, width)
        q = torch.randn(*shape, requires_grad=True)
        kv = torch.randn(*shape, requires_grad=True) if cross else q
        q2 = q.detach().clone().requires_grad_(True)
        kv2 = kv.detach().clone().requires_grad_(True) if cross else q2
        want, want_w = run(whole.attn, q, kv, **kw)
        layout = Layout(pp=1, dp=1, tp=2, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["attn"])],
                        tp_plan=TPPlan(styles={"attn": "colwise", "attn.out_proj": "rowwise"}, fused={"attn": 3}))
        apply_tp(ModelStage(sharded, ["attn"]), mesh["tp"], layout, {})
        assert isinstance(sharded.attn, ShardedMultiheadAttention) and sharded.attn.num_heads == 2
        got, got_w = run(sharded.attn, q2, kv2, **kw)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"case {i}")
        if want_w is not None:
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6, msg=f"case {i}")
        torch.testing.assert_close(q2.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"case {i}")
        if cross:
            torch.testing.assert_close(kv2.grad, kv.grad, rtol=1e-5, atol=1e-6, msg=f"case {i}")
        order = chunk_shard_order(3 * width, 3, 2)
        for name, param in sharded.attn.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            ref = whole.attn.get_parameter(name).grad
            if name.startswith("in_proj"):  # the packed q | k | v rows, chunk-reordered
                ref = ref.index_select(0, order)
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6, msg=f"case {i} {name}")


class NormedBlock(nn.Module):
    """A pre-norm residual block around HeadNormAttention's shape (heads by -1): sequence parallelism's norm,
    residual add and gathers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = HeadNormAttention()
        self.out = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))
        return self.out(h)


def _check_sequence_parallel_on_a_cp_share(mesh) -> None:
    """The graph traced on the whole sequence (16 tokens), rewritten for sequence parallelism, runs on a cp rank's
    share (8 tokens, split 4 + 4 over tp) as the whole model runs on those 8: the rewrite reads the length from the
    tensors, so context parallelism may divide the sequence first (cp x tp with sp)."""
    from torch import fx
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from planner.runtime.parallel import parallel_style, plan_sequence_parallel

    torch.manual_seed(3)
    whole = NormedBlock()
    gm = fx.symbolic_trace(copy.deepcopy(whole))
    values: dict = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    with torch.no_grad():
        Record(gm).run(torch.randn(2, 16, 8))
    plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "attn.q_norm": "norm_heads", "attn.k_norm": "norm_heads"}
    styles = plan_sequence_parallel(gm, values, 16, mesh["tp"], plan)
    assert {"norm", "out"} & set(styles)  # a norm runs on sequence slices
    parallelize_module(gm, mesh["tp"], {
        **{n: styles.get(n) or parallel_style(st, gm.get_submodule(n)) for n, st in plan.items()},
        **{n: st for n, st in styles.items() if n not in plan},
    })
    x = torch.randn(2, 8, 8)  # the cp rank's share: the same on both tp ranks
    x2 = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    want = whole(x)
    (want * torch.arange(want.numel()).view_as(want).sin()).sum().backward()
    got = gm(x2)
    (got * torch.arange(got.numel()).view_as(got).sin()).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6)
    for name, param in gm.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, whole.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # GPT-2's wte / lm_head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def _check_tied_weights_stay_tied(mesh) -> None:
    """The vocab-parallel embedding and LM head share one sharded weight, so they train as one."""
    torch.manual_seed(1)
    whole = TiedLM()
    idx = torch.randint(0, 16, (2, 5))
    want = whole(idx)
    want.square().sum().backward()
    lm = copy.deepcopy(whole)
    layout = Layout(pp=1, dp=1, tp=2, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["emb", "head"])],
                    tp_plan=TPPlan(styles={"emb": "rowwise", "head": "colwise_gather"}))
    from planner.runtime.parallel import apply_tp

    apply_tp(ModelStage(lm, ["emb", "head"]), mesh["tp"], layout, {})
    assert lm.head.weight is lm.emb.weight and len(list(lm.parameters())) == 1
    got = lm(idx)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm.emb.weight.grad.full_tensor(), whole.emb.weight.grad, rtol=1e-5, atol=1e-6)
    # Split two ways (features for one, vocabulary for the other), the copies could not stay one weight.
    split = copy.deepcopy(whole)
    layout = Layout(pp=1, dp=1, tp=2, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["emb", "head"])],
                    tp_plan=TPPlan(styles={"emb": "colwise", "head": "colwise_gather"}))
    with pytest.raises(RunError, match="are one tied weight, but TP_PLAN splits them differently"):
        apply_tp(ModelStage(split, ["emb", "head"]), mesh["tp"], layout, {})


def test_apply_tp_on_two_gloo_ranks_matches_one_process(tmp_path):
    """apply_tp itself, fused qkv Linear (chunk reorder + ColwiseParallel) and Conv1D (ShardedConv1D): output,
    input and weight gradients; tied embedding / LM head weights; norms over each head (norm_heads); sequence
    parallelism's rewrite run on a shorter sequence than traced (a cp rank's share).
    Spawned: a fork of a pytest-xdist worker can hang in gloo."""
    import torch.multiprocessing as mp

    results = tmp_path / "ok"
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_tp_worker, args=(init, str(results)), nprocs=2, join=True)
    assert results.read_text() == "ok"
