"""torchtitan model sources: torchtitan:MODEL --flavor NAME compiled into a model file and built on meta."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import ModelLoadError
from planner.model.sources import compile_source

pytest.importorskip("torchtitan")


def test_unknown_model_lists_the_known_ones(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no model 'llama9'.*llama3.*deepseek_v3|no model 'llama9'.*deepseek"):
        compile_source("torchtitan:llama9", tmp_path, flavor="8B")
    assert not (tmp_path / "model_source.py").exists()


def test_unknown_flavor_lists_the_known_ones(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no flavor '9B'.*debugmodel, 1B, 3B, 8B, 70B, 405B"):
        compile_source("torchtitan:llama3", tmp_path, flavor="9B")
    with pytest.raises(ModelLoadError, match="needs a flavor"):
        compile_source("torchtitan:llama3", tmp_path)


def test_flavor_without_titan_source_is_refused(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "plan", "sample_models/gpt.py", "--flavor", "8B", "--gpu", "cpu", "--global-batch-size", "8",
            "--out", str(tmp_path / "p"), "--quiet",
        ],
    )
    assert result.exit_code == 2
    assert "not a torchtitan:MODEL source" in result.output
    assert not (tmp_path / "p").exists()


def test_debugmodel_units_are_the_moduledict_blocks(tmp_path):
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    path = compile_source("torchtitan:llama3", tmp_path, seq=32, flavor="debugmodel")
    text = path.read_text()
    assert "ScaledDotProductAttention" in text and "'rope_max_seq_len': 32" in text
    graph = analyse_model(load_model_file(path, {"seq": 32}))
    names = [u.name for u in graph.units]
    assert [n for n in names if n.startswith("layers.")] == [f"layers.{i}" for i in range(6)], names
    assert graph.source_settings["attention"] == "sdpa_causal"


def test_debugmodel_tp_shards_attention_mlp_and_the_vocabulary(tmp_path):
    """The fused qkv (heads grouped with their q, k, v: plain column split), wo, the MLP, tok_embeddings and
    the LM head are sharded; nothing is refused (the complex rotary table broadcasts over heads)."""
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    path = compile_source("torchtitan:llama3", tmp_path, seq=32, flavor="debugmodel")
    graph = analyse_model(load_model_file(path, {"seq": 32}))
    block = next(u for u in graph.units if u.name == "layers.0")
    assert not block.tp_refused, block.tp_refused
    assert block.tp_shards_attention and not block.tp_fused
    styles = {k.removeprefix("layers.0."): v for k, v in block.tp_styles.items()}
    assert styles == {
        "attention.qkv_linear.wqkv": "colwise", "attention.wo": "rowwise", "feed_forward.w1": "colwise",
        "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    }
    others = {k: v for u in graph.units if not u.name.startswith("layers.") for k, v in u.tp_styles.items()}
    assert others == {"tok_embeddings": "rowwise", "lm_head": "colwise_gather"}


def test_deepseek_v3_plans_on_meta_with_selective_recompute(tmp_path):
    """torchtitan's MoE router runs its gate under torch.autocast(device_type=x.device.type), which the meta
    device has not (both tracers failed: "unsupported autocast device_type 'meta'"); its blocks fill tensors
    in place under selective recompute. Planned with the plan-time check, written."""
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "plan", "torchtitan:deepseek_v3", "--flavor", "debugmodel", "-a", "seq=32", "--gpu", "cpu", "--nodes",
            "1", "--gpus-per-node", "4", "--global-batch-size", "8", "--micro-batch-size", "2", "--dp", "4",
            "--recompute", "selective", "--out", str(out), "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (out / "plan.json").exists() and (out / "train.py").exists()


def _titan_meta(tmp_path, model: str, flavor: str, seq: int = 32):
    """torchtitan's model for `flavor`, built on meta by the compiled model file, and the loaded file."""
    import torch

    from planner.model.load import load_model_file

    loaded = load_model_file(compile_source(f"torchtitan:{model}", tmp_path, seq=seq, flavor=flavor), {"seq": seq})
    with torch.device("meta"):
        return loaded.module.build_model(seq=seq), loaded


def test_deepseek_v3_expert_flops_are_the_routed_work(tmp_path):
    """torchtitan's MoE (routed_experts: token reordering around grouped weights [E, out, in] that
    torch._grouped_mm runs, which torch's FLOP counter does not count; a router holding top_k and its gate;
    a shared expert) is recognised: a MoE block's matmul FLOPs are its dense twin's (same attention) with
    the dense FFN replaced by the router, the shared expert and tokens x top_k routed expert matmuls, exactly;
    backward twice that. plan.json's experts, the ep granularity, the all-to-all bytes and the MoE line."""
    from planner.model.analysis import analyse_model
    from planner.runtime.experts import _grouped_experts

    model, loaded = _titan_meta(tmp_path, "deepseek_v3", "debugmodel")
    graph = analyse_model(loaded)
    s = graph.tokens_per_sample
    moe = model.layers["1"].moe
    e, f, d = moe.routed_experts.inner_experts.w1_EFD.shape
    k = moe.router.top_k
    assert (e, f, d, k) == (8, 256, 256, 3)
    ffn = model.layers["0"].feed_forward.w1.out_features
    shared = moe.shared_experts.w1.out_features
    dense, block = graph.unit("layers.0"), graph.unit("layers.1")
    routed = s * k * 3 * 2 * d * f
    assert routed == 37_748_736
    want = dense.matmul_flops - s * 3 * 2 * d * ffn + s * 2 * d * e + s * 3 * 2 * d * shared + routed
    assert block.matmul_flops == want
    assert block.bwd_matmul_flops == 2 * want
    assert block.expert_params == e * 3 * f * d
    assert block.experts == {"layers.1.moe.routed_experts": 8} and block.ep_granularity == 8
    assert block.moe_dispatch_bytes == s * k * d * graph.dtype_bytes
    assert dense.experts == {} and dense.expert_params == 0
    assert sum(len(u.experts) for u in graph.units) == 5
    assert "MoE MoE in layers.1.moe: 8 experts, top-3, router TokenChoiceTopKRouter" in " ".join(graph.structure)
    # The runtime's expert parallelism recognises the same module (its grouped weights beside a dispatcher).
    assert _grouped_experts(moe.routed_experts) is moe.routed_experts.inner_experts
    assert _grouped_experts(moe.shared_experts) is None


@pytest.mark.parametrize(("model", "flavor"), [("qwen3", "debugmodel_moe"), ("gpt_oss", "debugmodel")])
def test_other_torchtitan_moe_models_are_recognised(model, flavor):
    """qwen3's MoE flavors and gpt_oss use the same torchtitan MoE; gpt_oss's experts also hold biases
    [E, out], which are not matrices: one routed token costs 2 x (the weights of one expert) forward."""
    import importlib

    import torch

    from planner.model.moe import find_moe_layers

    with torch.device("meta"):
        built = importlib.import_module(f"torchtitan.models.{model}").model_registry(flavor).model.build()
    layers = find_moe_layers(built)
    blocks = [name for name, mod in built.layers.items() if getattr(mod, "moe", None) is not None]
    assert [layer.name for layer in layers] == [f"layers.{b}.moe" for b in blocks] and layers
    inner = built.layers[blocks[0]].moe.routed_experts.inner_experts
    weights = [p for p in inner.parameters() if p.dim() == 3]
    assert len(weights) == (3 if model == "qwen3" else 2)
    for layer in layers:
        assert layer.experts == f"{layer.name}.routed_experts"
        assert layer.num_experts == inner.num_experts and layer.top_k == built.layers[blocks[0]].moe.router.top_k
        assert layer.fwd_flops_per_token == sum(2 * w.shape[1] * w.shape[2] for w in weights)
        assert layer.expert_params == sum(p.numel() for p in inner.parameters())


def test_gpt_oss_is_refused_rather_than_planned_with_other_attention(tmp_path):
    """gpt_oss's attention (learned sinks, sliding windows on alternate layers) has no causal-SDPA
    equivalent: refused with the reason, exit 2, nothing written."""
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "plan", "torchtitan:gpt_oss", "--flavor", "debugmodel", "-a", "seq=32", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "4", "--global-batch-size", "8", "--out", str(out), "--quiet",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "sliding-window attention" in result.output and "sinks" in result.output
    assert "Traceback" not in result.output and not out.exists()
