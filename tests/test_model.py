"""Loading, tracing (fx and the torch.export fallback) and grouping into analysed units."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import ModelLoadError, TraceError
from planner.model.analysis import analyse_model
from planner.model.load import load_model_file

FIXTURES = Path(__file__).parent / "fixtures"

SHAPE_BRANCH = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        if h.shape[1] % 2 == 0:  # symbolic tracing cannot branch on a traced shape; export specialises it
            h = h * 2
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 4, 8),)


def get_data(step, micro_batch_size, **kwargs):
    return example_inputs(micro_batch_size)
'''

VALUE_BRANCH = SHAPE_BRANCH.replace("if h.shape[1] % 2 == 0:", "if h.sum() > 0:")
# A branch on a tensor made from a shape: fake tensors keep such a constant's value (torch.export follows it),
# meta tensors do not (the trace with meta values fails on it).
CONSTANT_BRANCH = SHAPE_BRANCH.replace("if h.shape[1] % 2 == 0:", "if torch.tensor(h.shape[1]) % 2 == 0:")


def test_tiny_gpt_units_tp_and_repeated_blocks(tmp_path):
    graph = analyse_model(load_model_file(FIXTURES / "tiny_gpt.py", {"layers": 3}))
    assert graph.trace_method == "fx"
    assert [u.name for u in graph.units] == ["tok_emb+pos_emb", "blocks.0", "blocks.1", "blocks.2", "norm+head"]
    assert [u.kind for u in graph.units] == ["other", "block", "block", "block", "other"]
    blocks = graph.units[1:4]
    assert len({u.signature for u in blocks}) == 1
    assert graph.distinct_blocks == 3  # embedding, one block, head: each analysed once
    b = blocks[1]
    assert b.tp_styles == {
        "blocks.1.attn.q": "colwise", "blocks.1.attn.k": "colwise", "blocks.1.attn.v": "colwise",
        "blocks.1.attn.o": "rowwise", "blocks.1.fc1": "colwise", "blocks.1.fc2": "rowwise",
    }
    assert b.tp_granularity == 4  # four heads
    # hidden 32, seq 16, 4 Linears of 32x32 and two of 32x128: forward matmul FLOPs 2*tokens*params
    assert b.matmul_flops == pytest.approx(2 * 16 * (4 * 32 * 32 + 2 * 32 * 128))
    assert b.bwd_matmul_flops == pytest.approx(2 * b.matmul_flops)
    assert b.attention_flops == pytest.approx(4 * 4 * 16 * 16 * 8)  # 4 b h s^2 d
    assert b.output_bytes == 16 * 32 * 2  # bf16 residual stream per sample
    assert b.activation_bytes > 10 * b.output_bytes
    assert graph.units[-1].tp_styles == {"head": "colwise_gather"}
    assert graph.total_params == sum(u.params for u in graph.units)


def test_a_head_narrower_than_its_input_stays_replicated():
    """sample_models/mlp.py ends in a regression head of one output: not worth a vocab-parallel split (and a
    single row cannot go to every rank), so tensor parallelism shards the blocks only."""
    mlp = Path(__file__).parents[1] / "sample_models" / "mlp.py"
    graph = analyse_model(load_model_file(mlp, {"layers": 2, "width": 64}))
    assert graph.units[-1].tp_styles == {}
    assert graph.units[1].tp_styles == {"blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise"}


@pytest.mark.parametrize(("text", "method"), [(SHAPE_BRANCH, "fx-meta"), (CONSTANT_BRANCH, "export")])
def test_fallbacks_plan_what_symbolic_tracing_cannot(tmp_path, text, method):
    """A branch on a shape: the symbolic trace with meta values follows it; a branch on a tensor made from a
    shape: torch.export does. Either way the same units, pairs and FLOPs as plain fx finds without the branch."""
    f = tmp_path / "branchy.py"
    f.write_text(text)
    graph = analyse_model(load_model_file(f))
    assert graph.trace_method == method
    assert [u.name for u in graph.units] == ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]
    assert graph.units[1].tp_styles == {"blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise"}
    assert graph.units[1].fwd_flops == pytest.approx(2 * 4 * (16 * 32 + 32 * 16))


def test_untraceable_model_names_the_line(tmp_path):
    f = tmp_path / "untraceable.py"
    f.write_text(VALUE_BRANCH)
    with pytest.raises(TraceError, match=r"untraceable.py, line 25: if h.sum\(\) > 0:"):
        analyse_model(load_model_file(f))


def test_contract_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_file(tmp_path / "missing.py")
    f = tmp_path / "nobuild.py"
    f.write_text("def example_inputs(b):\n    return ()\n")
    with pytest.raises(ModelLoadError, match="does not define build_model"):
        load_model_file(f)
    g = tmp_path / "branchy.py"
    g.write_text(SHAPE_BRANCH)
    assert load_model_file(g, batch_fn="get_data").source.batch_fn == "get_data"
    with pytest.raises(ModelLoadError, match="does not define nope"):
        load_model_file(g, batch_fn="nope")
    with pytest.raises(ModelLoadError, match="rejected its arguments"):
        analyse_model(load_model_file(FIXTURES / "tiny_gpt.py", {"hidden": "wide"}))


def test_math_attention_building_its_mask_from_q_device_keeps_attention_sharded():
    # The sample GPT's unfused attention builds its causal mask with device=q.device: following the
    # `.device` attribute once sent the walk into the mask and refused q/k/v (SC21's 145B row then OOMed).
    graph = analyse_model(
        load_model_file(Path(__file__).parents[1] / "sample_models" / "gpt.py",
                        {"layers": 2, "hidden": 64, "heads": 4, "seq": 16, "attention": "math"})
    )
    block = next(u for u in graph.units if u.kind == "block")
    assert block.tp_styles["blocks.0.attn.q"] == "colwise"
    assert block.tp_styles["blocks.0.attn.o"] == "rowwise"
    assert not any(u.tp_refused for u in graph.units)


ATTENTION = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (4, -1)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(o.transpose(1, 2).flatten(-2))


class Net(nn.Module):
    def __init__(self, branch):
        super().__init__()
        self.branch = branch
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        h = self.inp(x)
        if self.branch and torch.tensor(h.shape[1]) % 2 == 0:  # only torch.export follows this branch
            h = h * 1.0
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def build_model(branch=False, **kwargs):
    return Net(branch)


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 64, 8),)
'''


def test_attention_in_an_exported_graph_is_costed_as_flash_attention_too(tmp_path):
    """scaled_dot_product_attention reaches the counter as F.scaled_dot_product_attention from an fx graph and
    as aten.scaled_dot_product_attention from an exported one (the fallback for models fx cannot follow: HF
    models, torchtitan's deepseek_v3): both are costed as flash attention (attention FLOPs, no s x s map
    saved), so the same block gets the same attention figures whichever tracer followed it."""
    f = tmp_path / "attention.py"
    f.write_text(ATTENTION)
    fx_graph = analyse_model(load_model_file(f, {"branch": False}))
    ex_graph = analyse_model(load_model_file(f, {"branch": True}))
    assert (fx_graph.trace_method, ex_graph.trace_method) == ("fx", "export")
    fx_block, ex_block = fx_graph.unit("blocks.0"), ex_graph.unit("blocks.0")
    assert fx_block.uses_flash_attention and ex_block.uses_flash_attention
    assert ex_block.attention_flops == fx_block.attention_flops == 4 * 4 * 64 * 64 * 8
    assert ex_block.bwd_attention_flops == fx_block.bwd_attention_flops == 2 * fx_block.attention_flops
    assert ex_block.matmul_flops == fx_block.matmul_flops
    # No 4 x 64 x 64 attention map saved (64 KiB; counted before, 106,496 bytes against fx's 25,600), and
    # the same saved tensors as fx's: the block's weights, which the exported graph reads at its top and the
    # split hands to the unit as inputs, are not counted as activations (they were: 33,792 bytes, the 8 KiB
    # of bf16 weights more).
    assert ex_block.activation_bytes == fx_block.activation_bytes
