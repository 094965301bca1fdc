"""Models no project file defines: tiny Hugging Face configs built on meta, and fixtures written the way
torchtitan, torchvision-style CNNs and issue 10's head-count GPT hold their blocks. Nothing downloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.model.analysis import analyse_model
from planner.model.load import load_model_file

pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
HF = MODELS / "hf_tiny.py"

# arch -> (repeated block type, count, where, container type)
HF_STRUCTURE = {
    "llama": ["4 x LlamaDecoderLayer in model.layers (ModuleList)"],
    "qwen2": ["4 x Qwen2DecoderLayer in model.layers (ModuleList)"],
    "mixtral": [
        "4 x MixtralDecoderLayer in model.layers (ModuleList)",
        "MoE MixtralSparseMoeBlock in model.layers.0.mlp: 4 experts, top-2, router MixtralTopKRouter (replicated "
        "under TP)",
    ],
    # DeepSeek-V2: the first layer dense, the others routed experts plus a shared one (the MoE line names the
    # first MoE layer); multi-head latent attention. Only torch.export traces it.
    "deepseek_v2": [
        "4 x DeepseekV2DecoderLayer in model.layers (ModuleList)",
        "MoE DeepseekV2Moe in model.layers.1.mlp: 4 experts, top-2, router DeepseekV2TopkRouter (replicated "
        "under TP)",
    ],
    "gemma": ["4 x GemmaDecoderLayer in model.layers (ModuleList)"],
    "gpt_neox": ["4 x GPTNeoXLayer in gpt_neox.layers (ModuleList)"],
    "phi3": ["4 x Phi3DecoderLayer in model.layers (ModuleList)"],
    "gpt2": ["4 x GPT2Block in transformer.h (ModuleList)"],
    "bert": ["4 x BertLayer in bert.encoder.layer (ModuleList)"],
    "t5": ["2 x T5Block in encoder.block (ModuleList)", "2 x T5Block in decoder.block (ModuleList)"],
    "bart": [
        "2 x BartEncoderLayer in model.encoder.layers (ModuleList)",
        "2 x BartDecoderLayer in model.decoder.layers (ModuleList)",
    ],
    "vit": ["4 x ViTLayer in vit.layers (ModuleList)"],
    "resnet": ["6 x ResNetBottleNeckLayer in resnet.encoder.stages.*.layers (Sequential, nested)"],
}
FIXTURE_STRUCTURE = {
    "moduledict_llama": ["4 x TransformerBlock in layers (ModuleDict)"],
    "sequential_cnn": ["4 x ResBlock in (the model) (Sequential)"],
    "headcount_gpt": ["4 x Block in blocks (ModuleList)"],
}

_graphs: dict = {}


def graph_of(name: str):
    """Analyse once per test session (each takes a few seconds on a shared CPU)."""
    if name not in _graphs:
        if name in HF_STRUCTURE:
            loaded = load_model_file(HF, {"arch": name}, dtype="fp32")
        else:
            loaded = load_model_file(MODELS / f"{name}.py", dtype="fp32")
        _graphs[name] = analyse_model(loaded)
    return _graphs[name]


def _reference_params(name: str) -> int:
    import torch

    if name in HF_STRUCTURE:
        loaded = load_model_file(HF, {"arch": name})
        with torch.device("meta"):
            model = loaded.build(arch=name)
    else:
        loaded = load_model_file(MODELS / f"{name}.py")
        with torch.device("meta"):
            model = loaded.build()
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted({**HF_STRUCTURE, **FIXTURE_STRUCTURE}))
def test_units_found_and_every_parameter_owned_once(name):
    g = graph_of(name)
    expected = {**HF_STRUCTURE, **FIXTURE_STRUCTURE}[name]
    assert g.structure == expected
    blocks = [u for u in g.units if u.kind == "block"]
    assert len(blocks) == sum(int(s.split(" x ")[0]) for s in expected if " x " in s)
    assert len(g.units) > len(blocks)  # embedding / stem and head are units of their own
    total = _reference_params(name)
    assert g.total_params == total
    # Tied weights (GPT-2's wte/lm_head, T5's shared embedding) are counted once overall.
    assert sum(u.params for u in g.units) >= total


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "moduledict_llama", "headcount_gpt"])
def test_decoder_flops_are_six_n_tokens_plus_attention(name):
    """Forward + backward FLOPs of a decoder: 6 x (non-embedding parameters) x tokens (Kaplan et al. 2020,
    the LM head included) plus attention's QK^T and AV (forward 1x, backward 2x)."""
    g = graph_of(name)
    tokens = g.tokens_per_sample
    embedding = sum(u.params for u in g.units[:1])
    matmul_params = g.total_params - embedding
    if name == "gpt2":  # tied: the head reuses the embedding matrix
        matmul_params += g.units[0].params - 64 * 64  # wte is the head, wpe (64 positions x 64) is not
    expected = 6 * matmul_params * tokens + 3 * sum(u.attention_flops for u in g.units)
    got = g.fwd_flops_per_sample + g.bwd_flops_per_sample
    assert got == pytest.approx(expected, rel=0.1)


def test_resnet_buffers_and_batch_norm_analyse_on_meta():
    g = graph_of("resnet")
    assert all(u.fwd_flops > 0 for u in g.units)
    assert g.units[0].name == "resnet.embedder"
    assert g.units[-1].name.endswith("classifier")


def _block(g):
    return next(u for u in g.units if u.kind == "block")


# arch -> (attention column names in the first block, its row) for models whose attention TP shards.
ATTENTION = {
    "llama": (["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"], "self_attn.o_proj"),
    "qwen2": (["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"], "self_attn.o_proj"),
    "mixtral": (["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"], "self_attn.o_proj"),
    "gemma": (["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"], "self_attn.o_proj"),
    # GPT-NeoX's fused query_key_value holds q, k, v head by head (viewed as [.., heads, 3 x head_dim], then
    # chunked): a contiguous column split gives each rank whole heads, no chunk-wise sharding needed.
    "gpt_neox": (["attention.query_key_value"], "attention.dense"),
    "bert": (["attention.self.key", "attention.self.query", "attention.self.value"], "attention.output.dense"),
    "vit": (["attention.k_proj", "attention.q_proj", "attention.v_proj"], "attention.o_proj"),
    "moduledict_llama": (["attention.wk", "attention.wq", "attention.wv"], "attention.wo"),
    "gpt2": (["attn.c_attn"], "attn.c_proj"),
    "headcount_gpt": (["attn.qkv"], "attn.proj"),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_is_a_tp_pair(name):
    u = _block(graph_of(name))
    cols, row = ATTENTION[name]
    prefix = u.name + "."
    assert any(p.column == [prefix + c for c in cols] and p.row == prefix + row for p in u.tp_pairs), u.tp_pairs
    assert u.tp_shards_attention and not u.tp_refused
    assert u.tp_styles[prefix + row] == "rowwise"


def test_deepseek_v2_latent_attention_stays_replicated_with_its_reason():
    """DeepSeek-V2 writes its keys in place (`k[..., d:].copy_(k_rot)`) from a rotary key that one replicated
    projection (kv_a_proj_with_mqa) gives all heads: sharding the heads would leave each rank only its heads'
    share of that projection's gradient. Attention is not paired (with the reason); the shared expert is."""
    g = graph_of("deepseek_v2")
    u = next(u for u in g.units if u.name == "model.layers.1")
    assert not u.tp_shards_attention
    assert not any("self_attn" in m for m in u.tp_styles)
    assert any(
        "self_attn.o_proj is not sharded: its heads also read model.layers.1.self_attn.kv_a_proj_with_mqa" in r
        for r in u.tp_refused
    ), u.tp_refused
    assert u.tp_styles["model.layers.1.mlp.shared_experts.down_proj"] == "rowwise"
    assert not any(m.endswith(".mlp.gate") or ".mlp.experts" in m for m in u.tp_styles)  # router, routed experts


def test_head_count_gpt_divides_its_head_attributes_and_splits_the_fused_qkv():
    """Issue 10's example: `split(self.dim)` and `view(b, s, self.heads, -1)` on a fused qkv."""
    u = _block(graph_of("headcount_gpt"))
    assert u.tp_head_attrs == {f"{u.name}.attn": ["dim", "heads"]}
    assert u.tp_fused == {f"{u.name}.attn.qkv": 3}
    assert u.tp_granularity == 8  # the head count: tp must divide it
    # All but the two LayerNorms (weight + bias) and the row Linears' biases (added once, after the reduce).
    assert u.tp_shardable_params == u.params - 4 * 64 - 2 * 64


def test_a_head_count_no_attribute_holds_refuses_attention_and_is_not_costed_as_sharded():
    loaded = load_model_file(MODELS / "headcount_gpt.py", {"literal": True}, dtype="fp32")
    g = analyse_model(loaded)
    u = _block(g)
    assert not u.tp_shards_attention
    assert u.tp_refused and "reshapes by the number 8" in u.tp_refused[0]
    assert f"{u.name}.attn.qkv" not in u.tp_styles and f"{u.name}.attn.proj" not in u.tp_styles
    mlp = 64 * 256 + 256 + 256 * 64  # fc weight + bias, out weight: what TP still shards
    assert u.tp_shardable_params == mlp
    assert u.tp_shardable_flops < u.matmul_flops - u.attention_flops  # attention's projections stay whole


def test_gpt2_conv1d_is_sharded_transposed_with_its_widths_divided():
    u = _block(graph_of("gpt2"))
    p = u.name
    assert u.tp_transposed == sorted(f"{p}.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert u.tp_head_attrs == {f"{p}.attn": ["split_size"], f"{p}.attn.c_attn": ["nf"], f"{p}.mlp.c_fc": ["nf"]}
    assert u.tp_fused == {f"{p}.attn.c_attn": 3}


GQA_FUSED = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.q_dim, self.kv_dim = dim, dim * kv_heads // heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim)  # q | k | v of unequal widths (GQA)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()
        self.fc = nn.Linear(64, 128)
        self.out = nn.Linear(128, 64)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.out(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(128, 64)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(64, 128, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(**_):
    return Net()


def example_inputs(batch_size, **_):
    return (torch.randint(0, 128, (batch_size, 16), generator=torch.Generator().manual_seed(0)),)
"""


def test_a_fused_projection_split_into_unequal_chunks_is_sharded_chunk_by_chunk(tmp_path):
    """A GQA qkv split into q wider than k and v (`split([q_dim, kv_dim, kv_dim], dim=-1)`, as ChatGLM writes
    it): TP_FUSED gives the chunks' widths, each split over tp on its own, and the 2 key/value heads set the
    granularity; the costed shardable parameters count the attention with the MLP."""
    path = tmp_path / "gqa_fused.py"
    path.write_text(GQA_FUSED)
    u = _block(analyse_model(load_model_file(path, dtype="fp32")))
    assert not u.tp_refused and u.tp_shards_attention and u.tp_granularity == 2
    assert u.tp_fused == {f"{u.name}.attn.qkv": [64, 32, 32]}
    assert u.tp_styles[f"{u.name}.attn.qkv"] == "colwise" and u.tp_styles[f"{u.name}.attn.proj"] == "rowwise"
    mlp = 64 * 128 + 128 + 128 * 64
    assert u.tp_shardable_params == mlp + 64 * 128 + 128 + 64 * 64  # qkv with its bias, proj without


def test_phi3_qkv_sliced_at_fixed_offsets_shards_chunk_by_chunk():
    """Phi-3 takes q, k and v from its fused qkv_proj by slicing at offsets computed from the config
    (`qkv[..., :heads * head_dim]`; 4 query heads, 2 key/value heads of 16): each chunk is split over tp on its
    own (TP_FUSED gives their widths) and the run's traced graph takes them at offsets made the rank's; tp must
    divide the key/value heads. The fused gate_up_proj, chunked in two equal halves, shards as before."""
    u = _block(graph_of("phi3"))
    assert not u.tp_refused and u.tp_shards_attention and u.tp_granularity == 2
    assert u.tp_styles[f"{u.name}.self_attn.qkv_proj"] == "colwise"
    assert u.tp_styles[f"{u.name}.self_attn.o_proj"] == "rowwise"
    assert u.tp_styles[f"{u.name}.mlp.gate_up_proj"] == "colwise"
    assert u.tp_fused == {f"{u.name}.mlp.gate_up_proj": 2, f"{u.name}.self_attn.qkv_proj": [64, 32, 32]}


def test_qwen3_head_norms_shard_with_attention_as_norm_heads():
    """Qwen3 normalises each head's q and k with one RMSNorm weight (q_norm, k_norm) shared by all heads.
    Split by heads with that weight a plain replicated tensor, each rank summed only its heads' gradient
    (tp2 x dp2 trained 4.5e-5 off one process, and growing): the norms get the norm_heads style (their
    input split by heads, the weight a replicated DTensor whose gradient DTensor sums over tp)."""
    u = _block(analyse_model(load_model_file(HF, {"arch": "qwen3"}, dtype="fp32")))
    assert u.tp_shards_attention and not u.tp_refused
    assert [p.row for p in u.tp_pairs] == [f"{u.name}.mlp.down_proj", f"{u.name}.self_attn.o_proj"]
    assert u.tp_styles[f"{u.name}.self_attn.q_norm"] == u.tp_styles[f"{u.name}.self_attn.k_norm"] == "norm_heads"




def test_a_weight_shared_by_all_heads_that_is_no_norm_shards_attention_and_has_its_gradient_summed():
    """A learned vector over head_dim multiplying every head (no norm module): each rank computes its heads'
    share of its gradient, which the run sums over tp (tp_summed); the attention is sharded."""
    loaded = load_model_file(MODELS / "attention_variants.py", {"variant": "head_scale"}, dtype="fp32")
    u = _block(analyse_model(loaded))
    assert u.tp_summed == [f"{u.name}.scale"] and not u.tp_refused
    assert u.tp_shards_attention and [p.row for p in u.tp_pairs] == [f"{u.name}.o"]


def test_gptj_attention_and_mlp_are_tp_pairs():
    """GPT-J's rotary stacks each head's (x2, x1) pairs in a new last dimension and flattens them, and its
    NewGELU reads fc_in's output twice (x and x + 0.044715 x^3): both once refused every pair (the stack
    moved the sharded heads dimension; the column itself counted as a side input holding all columns)."""
    u = _block(analyse_model(load_model_file(HF, {"arch": "gptj"}, dtype="fp32")))
    attn = [f"{u.name}.attn.{p}_proj" for p in ("k", "q", "v")]
    assert [(p.column, p.row) for p in u.tp_pairs] == [
        (attn, f"{u.name}.attn.out_proj"), ([f"{u.name}.mlp.fc_in"], f"{u.name}.mlp.fc_out")
    ], u.tp_refused
    assert u.tp_shards_attention and not u.tp_refused


def test_a_layer_shared_by_every_layer_counts_its_sharded_weights_once():
    """ALBERT runs one layer's modules 4 times: one pair per call (each call's FLOPs and all-reduce), its
    parameters once. Counted per call, the sharded parameters exceeded the model's and `--tp 2` ended in an
    internal error (negative weight bytes)."""
    import json

    g = analyse_model(load_model_file(HF, {"arch": "albert"}, dtype="fp32"))
    assert all(u.tp_shardable_params <= u.params for u in g.units)
    result = _dry_run(str(HF), "--model-arg", "arch='albert'", "--tp", "2", "--dp", "2")
    assert result.exit_code == 0, result.output
    layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
    assert json.loads(result.output)["tp_plan"][f"{layer}.ffn_output"] == "rowwise"


def test_bloom_alibi_over_all_heads_refuses_attention_and_the_mlp_still_shards():
    """BLOOM adds its ALiBi bias ([batch x heads, 1, seq], all heads) in baddbmm: attention was paired, and
    the plan-time check then refused every tp plan (the sharded run's shapes disagree)."""
    u = _block(analyse_model(load_model_file(MODELS / "hf_zoo.py", {"arch": "bloom"}, dtype="fp32")))
    assert any("query_key_value is not sharded: baddbmm combines it" in r for r in u.tp_refused), u.tp_refused
    assert not u.tp_shards_attention
    assert [p.row for p in u.tp_pairs] == [f"{u.name}.mlp.dense_4h_to_h"]


def test_t5_position_bias_over_all_heads_refuses_attention():
    u = _block(graph_of("t5"))
    assert not u.tp_shards_attention
    assert any("holds all 4 heads" in r for r in u.tp_refused)
    assert any(p.row.endswith("DenseReluDense.wo") for p in u.tp_pairs)  # the MLP still shards


def test_mixtral_router_stays_replicated():
    u = _block(graph_of("mixtral"))
    assert not any("gate" in m or "router" in m for m in u.tp_styles)
    assert u.tp_shardable_params < u.params  # experts and router are not sharded by TP


# --- planning them: dry-run for 4 CPU ranks, and the hf: source -----------------------------------------------

PINS = {"dp4": ["--dp", "4"], "pp2xdp2": ["--pp", "2", "--dp", "2"], "tp2xdp2": ["--tp", "2", "--dp", "2"]}
CNNS = {"resnet", "sequential_cnn"}


def _dry_run(model: str, *args: str):
    from typer.testing import CliRunner

    from planner.cli.main import app

    return CliRunner().invoke(
        app,
        ["dry-run", model, *args, "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8",
         "--micro-batch-size", "1", "--json"],
    )


def _model_args(name: str) -> list[str]:
    if name in HF_STRUCTURE:
        return [str(HF), "--model-arg", f"arch={name!r}"]
    return [str(MODELS / f"{name}.py")]


@pytest.mark.parametrize("pins", sorted(PINS))
@pytest.mark.parametrize("name", sorted({**HF_STRUCTURE, **FIXTURE_STRUCTURE}))
def test_dry_run_with_pins_for_four_cpu_ranks(name, pins):
    import json

    result = _dry_run(*_model_args(name), *PINS[pins])
    if pins == "tp2xdp2" and name in CNNS:
        # Convolutions have no column/row pairs: the planner says so instead of reporting a tp it does not do.
        assert result.exit_code == 2, result.output
        assert "tensor" in result.output.lower()
        return
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    p = plan["parallel"]
    want = {"dp4": (4, 1, 1), "pp2xdp2": (2, 1, 2), "tp2xdp2": (2, 2, 1)}[pins]
    assert (p["dp"], p["tp"], p["pp"]) == want
    assert plan["structure"] == {**HF_STRUCTURE, **FIXTURE_STRUCTURE}[name]
    if pins == "tp2xdp2":
        assert plan["tp_plan"]  # something really is sharded
        if name in ("gpt2", "headcount_gpt"):
            # Fused qkv (and GPT-2's Conv1D, transposed) are sharded by the script now, not refused.
            assert plan["tp_fused"] and (name != "gpt2" or plan["tp_transposed"])


def test_hf_source_from_a_config_json_compiles_a_model_file(tmp_path):
    import json

    cfg = MODELS / "hf_llama_config"
    result = _dry_run("hf:meta-llama/Llama-3.1-8B", "--hf-config", str(cfg), "--model-arg", "seq=32", "--dp", "4")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["model_class"] == "LlamaForCausalLM"
    assert plan["source_spec"] == "hf:meta-llama/Llama-3.1-8B"
    assert plan["source_settings"] == {"attn_implementation": "sdpa", "return_dict": True, "use_cache": False}
    assert plan["structure"] == ["4 x LlamaDecoderLayer in model.layers (ModuleList)"]
    assert plan["tokens_per_sample"] == 32
    # hf:path/to/config.json works the same way, and the local HF cache layout is found.
    direct = _dry_run(f"hf:{cfg / 'config.json'}", "--dp", "4", "--model-arg", "seq=32")
    assert direct.exit_code == 0, direct.output


def test_hf_source_of_an_architecture_without_sdpa_uses_eager_attention_and_says_so(tmp_path):
    """transformers refuses sdpa for Gemma-2 (logit soft-capping); asking for it failed every hf: plan."""
    import json

    import transformers as tf

    cfg = tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=64, vocab_size=128)
    cfg.architectures = ["Gemma2ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    result = _dry_run("hf:google/gemma-2-tiny", "--hf-config", str(tmp_path / "config.json"), "--model-arg",
                      "seq=32", "--pp", "2", "--dp", "2")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["source_settings"] == {"attn_implementation": "eager", "return_dict": True, "use_cache": False}
    assert plan["structure"] == ["2 x Gemma2DecoderLayer in model.layers (ModuleList)"]


def test_module_factory_source(tmp_path, monkeypatch):
    import json

    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text((MODELS / "moduledict_llama.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _dry_run("module:mypkg.models:build_model", "--dp", "4")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["structure"] == ["4 x TransformerBlock in layers (ModuleDict)"]
    bad = _dry_run("module:mypkg.nothing_here:build_model", "--dp", "4")
    assert bad.exit_code == 2 and "cannot be imported" in bad.output


def test_deepseek_style_experts_in_a_module_list_are_not_pipeline_blocks():
    """Experts in a ModuleList run side by side on the same tokens: the decoder layer stays one block."""
    import torch
    import torch.nn as nn

    from planner.model.grouping import discover_structure

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k = 2
            self.gate = nn.Linear(8, 4, bias=False)
            mlp = [nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8)) for _ in range(4)]
            self.experts = nn.ModuleList(mlp)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.mlp = MoE()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.layers = nn.ModuleList([Layer() for _ in range(3)])

    with torch.device("meta"):
        st = discover_structure(Model())
    assert st.roots == ["embed", "layers.0", "layers.1", "layers.2"]
    assert st.found == ["3 x Layer in layers (ModuleList)", "MoE MoE in layers.0.mlp: 4 experts, top-2, router Linear "
                        "(replicated under TP)"]


def test_tp_in_a_traced_stage_runs_on_a_graph_traced_with_meta_values():
    """HF Llama traces with torch.fx and meta values (its Python reads shapes): a pipeline with tp runs that graph
    with the sizes of the sharded dimension made each rank's (runtime.tp_graph), so tp x pp plans."""
    import json

    cfg = MODELS / "hf_llama_config"
    src = ["hf:meta-llama/Llama-3.1-8B", "--hf-config", str(cfg), "--model-arg", "seq=32"]
    piped = _dry_run(*src, "--tp", "2", "--pp", "2")
    assert piped.exit_code == 0, piped.output
    par = json.loads(piped.output)["parallel"]
    assert (par["tp"], par["pp"]) == (2, 2)


# Mistral and Qwen2 (the same repeat_kv) under -m corpus, to keep CI within its time
@pytest.mark.parametrize("arch", ["llama", *(pytest.param(a, marks=pytest.mark.corpus) for a in ("mistral", "qwen2"))])
def test_gqa_with_several_kv_heads_per_rank_plans_tp2_pp2_through_the_check(arch, tmp_path):
    """8 query heads, 4 kv heads, tp 2 x pp 2, as an hf: source: each rank's traced stage repeats its 2 kv heads
    (repeat_kv's expand made the rank's) and the plan-time check runs each stage's tp shard. It failed the check
    with "The expanded size of the tensor (4) must match the existing size (2)"."""
    from e2e.hf_plans import gqa_plan_args
    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.plan import load_plan

    out = tmp_path / "plan"
    pins = ("--tp", "2", "--pp", "2", "--schedule", "1f1b")
    result = CliRunner().invoke(app, ["plan", *gqa_plan_args(arch, tmp_path, *pins), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert (plan.parallel.tp, plan.parallel.pp) == (2, 2) and plan.trace_method == "fx-meta"
    assert {plan.tp.styles[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"} == {"colwise"}


def test_a_traced_stage_refuses_tp_only_on_a_graph_from_torch_export():
    """Conv1D (kept as a call) and head counts read in forward (made the rank's in the graph) run in a traced
    stage; a graph from torch.export, every shape fixed, does not."""
    from planner.search.space import runtime_traced_tp_refusal

    g = graph_of("gpt2")
    assert runtime_traced_tp_refusal(g) is None
    assert "only torch.export" in runtime_traced_tp_refusal(g.model_copy(update={"trace_method": "export"}))
    assert runtime_traced_tp_refusal(graph_of("headcount_gpt")) is None
    assert runtime_traced_tp_refusal(graph_of("moduledict_llama")) is None


def test_an_embedding_that_computes_its_own_indices_stays_replicated():
    """BART's learned positions look up `arange(...) + offset` inside their forward: a vocab-parallel split
    masks only the indices a module is called with, so they stay whole (GPT-2's wpe, called with its
    position ids, is split)."""
    emb = next(u for u in graph_of("bart").units if "embed_positions" in u.name)
    assert not any("embed_positions" in m for m in emb.tp_styles)
    assert any("computes its indices in its own forward" in r for r in emb.tp_refused), emb.tp_refused
    assert "transformer.wpe" in graph_of("gpt2").units[0].tp_styles


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_unit_input_is_what_crosses_the_boundary_not_the_weights(name):
    """torch.export lifts parameters into the graph's inputs: a block's input_bytes (what full recompute
    keeps) is the activation entering it, as the previous unit's output_bytes says, not its weights."""
    g = graph_of(name)
    for prev, unit in zip(g.units, g.units[1:]):
        assert unit.input_bytes == prev.output_bytes, (unit.name, unit.input_bytes, prev.output_bytes)
        assert unit.input_bytes < unit.param_bytes or unit.kind != "block"


def test_nanogpt_gpt3_175b_on_1024_a100_plans_tp8_x_pp_with_attention_sharded():
    """nanoGPT's code at GPT-3 175B (96 layers, 96 heads, 12288 wide) on 128 nodes of 8 A100: tp 8 inside a
    pipeline runs its fused c_attn chunk by chunk and its heads from the traced graph (issue 27), and each
    pipeline stage of blocks holds 1/8 of every projection, attention included (bf16 weights)."""
    import json

    from typer.testing import CliRunner

    from planner.cli.main import app

    result = CliRunner().invoke(
        app,
        ["dry-run", str(MODELS / "nanogpt.py"), "--model-arg", "preset='gpt3-175b'", "--gpu", "a100-sxm-80gb",
         "--nodes", "128", "--global-batch-size", "1536", "--tp", "8", "--json"],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["parallel"]["tp"] == 8 and plan["parallel"]["pp"] > 1
    assert plan["tp_fused"] and plan["tp_head_attrs"]
    h, tp = 12288, 8
    sharded = 12 * h * h + 7 * h  # c_attn (w, b), attn c_proj w, c_fc (w, b), mlp c_proj w
    replicated = 6 * h  # two LayerNorms (w, b) and the two row-parallel biases
    blocks_only = [s for s in plan["stages"] if all(u.startswith("transformer.h.") for u in s["units"])]
    assert blocks_only
    for stage in blocks_only:
        expected = len(stage["units"]) * (sharded // tp + replicated) * 2
        assert stage["memory"]["weights"] == pytest.approx(expected, rel=1e-3), stage["units"]
    # what it would hold with attention replicated (only the MLP sharded): far more
    mlp_only = len(blocks_only[0]["units"]) * (4 * h * h + 4 * h + (8 * h * h + 4 * h) // tp + 2 * h) * 2
    assert blocks_only[0]["memory"]["weights"] < 0.5 * mlp_only
