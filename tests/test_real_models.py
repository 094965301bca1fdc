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
    "mixtral": ["4 x MixtralDecoderLayer in model.layers (ModuleList)"],
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
    assert len(blocks) == sum(int(s.split(" x ")[0]) for s in expected)
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
