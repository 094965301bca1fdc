"""The sample model files: meta builds at full size, CPU training, tracing, materialisation, TP layout."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

MODELS_DIR = Path(__file__).resolve().parents[1] / "sample_models"
NAMES = ["gpt", "llama", "mlp"]


def _load(name: str):
    """Import a model file by path, as the planner does (sample_models/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"sample_model_{name}", MODELS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODULES = {name: _load(name) for name in NAMES}
gpt, llama = MODULES["gpt"], MODULES["llama"]


@pytest.fixture(params=NAMES)
def sample(request):
    return MODULES[request.param]


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _gpt_params(layers, hidden, vocab, seq, **_) -> int:
    """Untied GPT: per layer 12h^2 + 13h (q, k, v, o, fc1, fc2 with biases, two LayerNorms)."""
    return layers * (12 * hidden**2 + 13 * hidden) + 2 * vocab * hidden + seq * hidden + 2 * hidden


# Published totals; ours differ only by the untied head (GPT-3 and Megatron count a tied one).
KNOWN_TOTALS = [
    (gpt, "gpt3-175b", 175.0e9),  # Brown et al. 2020, Table 2.1
    (gpt, "megatron-1t", 1008e9),  # Narayanan et al. SC21, Table 1
    (llama, "llama2-70b", 68.98e9),  # the released Llama-2-70b checkpoint
    (llama, "llama2-7b", 6.74e9),
    (llama, "llama3-8b", 8.03e9),
]


@pytest.mark.parametrize(("module", "preset", "total"), KNOWN_TOTALS, ids=[p for _, p, _ in KNOWN_TOTALS])
def test_largest_presets_build_on_meta_with_known_parameter_counts(module, preset, total):
    with torch.device("meta"):
        model = module.build_model(preset=preset)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert _n_params(model) == pytest.approx(total, rel=0.01)


@pytest.mark.parametrize("preset", list(gpt.PRESETS))
def test_every_gpt_preset_matches_the_parameter_formula(preset):
    with torch.device("meta"):
        model = gpt.build_model(preset=preset)
    assert _n_params(model) == _gpt_params(**gpt.PRESETS[preset])


@pytest.mark.parametrize("preset", list(llama.PRESETS))
def test_every_llama_preset_builds_on_meta(preset):
    with torch.device("meta"):
        model = llama.build_model(preset=preset)
    cfg = llama.resolve_config(preset=preset)
    assert len(model.blocks) == cfg.layers
    assert model.blocks[0].attn.k.out_features == cfg.kv_heads * cfg.head_dim


def test_explicit_kwargs_override_the_preset_and_unknown_kwargs_are_ignored():
    cfg = gpt.resolve_config(preset="gpt3-175b", layers=2, seed=3, unrelated="x")
    got = (cfg.layers, cfg.hidden, cfg.heads, cfg.vocab, cfg.seq, cfg.ffn_dim)
    assert got == (2, 12288, 96, 51200, 2048, 49152)
    assert llama.resolve_config(preset="llama3-8b", seq=128).seq == 128
    assert llama.resolve_config().ffn_dim == 256


@pytest.mark.parametrize("module", [gpt, llama], ids=["gpt", "llama"])
def test_unknown_preset_lists_the_known_ones(module):
    with pytest.raises(ValueError, match="known presets: .*" + list(module.PRESETS)[-1]):
        module.build_model(preset="gpt-5")


def test_invalid_dimensions_raise_value_error():
    with pytest.raises(ValueError, match="divisible by heads"):
        gpt.build_model(hidden=130, heads=4)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        llama.build_model(heads=4, kv_heads=3)


def test_example_inputs_are_deterministic_and_shaped(sample):
    a, b, c = sample.example_inputs(3), sample.example_inputs(3, layers=2), sample.example_inputs(3, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    assert a[0].shape[0] == 3 and a[0].device.type == "cpu"
    if sample in (gpt, llama):
        assert a[0].dtype == torch.int64 and a[0].shape == (3, 64) and int(a[0].max()) < 1024


def test_default_model_trains_on_cpu(sample):
    torch.manual_seed(0)
    model = sample.build_model()
    inputs = sample.example_inputs(4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = sample.loss_fn(model(inputs[0]), *inputs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_symbolic_trace_matches_eager(sample):
    model = sample.build_model().eval()
    x = sample.example_inputs(2)[0]
    gm = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(gm(x), model(x))
    # The blocks stay visible as module calls, which is what partitioning by module name needs.
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert called & {"blocks.0.mlp.fc1", "blocks.0.mlp.w1", "blocks.0.fc1"}


def test_torch_export_matches_eager(sample):
    model = sample.build_model().eval()
    inputs = sample.example_inputs(2)
    ep = torch.export.export(model, inputs[:1], strict=False)
    torch.testing.assert_close(ep.module()(inputs[0]), model(inputs[0]))


def test_meta_materialisation_matches_a_cpu_build(sample):
    """to_empty(recurse=False) + reset_parameters() per module, in module order, reproduces a CPU build."""
    torch.manual_seed(0)
    reference = sample.build_model(layers=2)
    with torch.device("meta"):
        model = sample.build_model(layers=2)
    torch.manual_seed(0)
    for module in model.modules():
        module.to_empty(device="cpu", recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"parameter {name}")
    ref_buffers = dict(reference.named_buffers())
    for name, got in model.named_buffers():
        torch.testing.assert_close(got, ref_buffers[name], rtol=0, atol=0, msg=f"buffer {name}")


def test_rotary_buffer_is_recomputed_in_place_after_a_dtype_cast():
    model = llama.build_model(layers=1)
    want = model.blocks[0].attn.rotary.freqs.clone()
    model.to(torch.bfloat16)
    rotary = model.blocks[0].attn.rotary
    rotary.freqs.zero_()
    rotary.reset_parameters()
    assert rotary.freqs.dtype == torch.bfloat16
    torch.testing.assert_close(rotary.freqs.float(), want, rtol=0, atol=4e-3)
    assert "blocks.0.attn.rotary.freqs" not in model.state_dict()
    assert model(llama.example_inputs(1)[0]).dtype == torch.bfloat16


def _shard_linear(linear: nn.Linear, dim: int, rank: int, tp: int, keep_bias: bool) -> nn.Linear:
    """One rank's shard: dim 0 of the weight for a column-parallel Linear, dim 1 for a row-parallel one."""
    weight = linear.weight.detach().chunk(tp, dim=dim)[rank]
    bias = linear.bias
    if bias is not None and dim == 0:
        bias = bias.detach().chunk(tp)[rank]
    shard = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None and keep_bias)
    with torch.no_grad():
        shard.weight.copy_(weight)
        if shard.bias is not None:
            shard.bias.copy_(bias)
    return shard


@pytest.mark.parametrize(
    ("module", "attr", "columns", "row"),
    [
        (gpt, "attn", ["q", "k", "v"], "o"),
        (gpt, "mlp", ["fc1"], "fc2"),
        (llama, "attn", ["q", "k", "v"], "o"),
        (llama, "mlp", ["w1", "w3"], "w2"),
    ],
    ids=["gpt-attn", "gpt-mlp", "llama-attn", "llama-mlp"],
)
def test_tensor_parallel_shards_sum_to_the_full_output(module, attr, columns, row):
    """Column-shard the input projections, row-shard the output one: the shards' outputs sum to the whole.

    This is what Megatron-style TP computes with one all-reduce, and it only works because the code reshapes
    heads with -1 instead of the global head count.
    """
    torch.manual_seed(0)
    model = module.build_model(heads=4, kv_heads=2).eval()
    full = getattr(model.blocks[0], attr)
    x = torch.randn(2, 64, 128)
    tp = 2
    total = torch.zeros_like(x)
    for rank in range(tp):
        shard = copy.deepcopy(full)
        for name in columns:
            setattr(shard, name, _shard_linear(getattr(full, name), 0, rank, tp, keep_bias=True))
        # The row projection's bias is added once, after the all-reduce: keep it on rank 0 only.
        setattr(shard, row, _shard_linear(getattr(full, row), 1, rank, tp, keep_bias=rank == 0))
        with torch.no_grad():
            total += shard(x)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x), rtol=1e-4, atol=1e-5)


def test_gpt_math_attention_matches_sdpa_on_cpu():
    torch.manual_seed(0)
    sdpa = gpt.build_model()
    torch.manual_seed(0)
    math = gpt.build_model(attention="math")
    (tokens,) = gpt.example_inputs(2)
    torch.testing.assert_close(math(tokens), sdpa(tokens), rtol=1e-5, atol=1e-5)


def test_gpt_math_attention_with_dropout_traces_and_runs_on_meta():
    from torch.fx import symbolic_trace

    symbolic_trace(gpt.build_model(attention="math", attn_dropout=0.1))
    with torch.device("meta"):
        model = gpt.build_model(attention="math", attn_dropout=0.1)
        model(torch.zeros(2, model.seq, dtype=torch.long)).sum().backward()
    with pytest.raises(ValueError, match="attention"):
        gpt.build_model(attention="flash")
