"""torchtitan model sources: torchtitan:MODEL --flavor NAME compiled into a model file and built on meta."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app
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
