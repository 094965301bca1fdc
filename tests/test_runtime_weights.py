"""planner.runtime.weights: a rank's modules start from a checkpoint (Hugging Face safetensors folder, DCP
folder, state_dict file), reading only the tensors it holds; a checkpoint of another model is refused by
name, before anything is read, at plan time (exit 2) as at run time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from e2e.hf_plans import HF, hf_plan
from typer.testing import CliRunner

from planner.cli.main import app
from planner.codegen.render import write_scripts
from planner.runtime.errors import RunError
from planner.runtime.layout import ModelFile
from planner.runtime.model import build_model, load_model_file, materialise
from planner.runtime.weights import SafetensorsCheckpoint, check_matches, open_checkpoint

pytest.importorskip("transformers")

CPU = torch.device("cpu")


def _pretrained(tmp_path, **args):
    """A tiny Llama with transformers' own initialisation, saved by save_pretrained."""
    torch.manual_seed(7)
    model = load_model_file(str(HF / "llama.py")).build_model(**args)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def _ours(held=None, weights=None, **args):
    spec = ModelFile(str(HF / "llama.py"), "build_model", "example_inputs", None, None, args)
    model = build_model(load_model_file(spec.path), spec, 0, everything_on_meta=False)
    materialise(model, {n for n, _ in model.named_modules()} if held is None else held, CPU, 0, weights)
    return model


def test_a_stage_reads_only_its_own_tensors_from_a_save_pretrained_folder(tmp_path, monkeypatch):
    ref, folder = _pretrained(tmp_path)
    ckpt = open_checkpoint(folder)
    assert isinstance(ckpt, SafetensorsCheckpoint)
    read: list[str] = []
    original = SafetensorsCheckpoint.read
    monkeypatch.setattr(SafetensorsCheckpoint, "read", lambda self, names: read.extend(names) or original(self, names))
    held = {"", "model", "model.layers", "model.layers.1", "model.norm", "lm_head"}
    held |= {n for n, _ in ref.named_modules() if n.startswith("model.layers.1.")}
    model = _ours(held, ckpt)
    assert read and all(n.startswith(("model.layers.1.", "model.norm", "lm_head")) for n in read), read
    expected = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not p.is_meta:
            torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)
    assert model.model.embed_tokens.weight.is_meta


@pytest.mark.parametrize("kind", ["state_dict", "dcp", "dcp_training_state"])
def test_state_dict_and_dcp_checkpoints(tmp_path, kind):
    ref, _ = _pretrained(tmp_path)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    if kind == "state_dict":
        path = tmp_path / "model.pt"
        torch.save(state, path)
    else:
        path = tmp_path / "dcp"
        dcp.save({"model": state, "step": torch.tensor(3)} if kind == "dcp_training_state" else state,
                 checkpoint_id=str(path), no_dist=True)
    model = _ours(weights=open_checkpoint(path))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, state[name], rtol=0, atol=0, msg=name)


def test_another_models_checkpoint_names_the_first_keys_that_differ(tmp_path):
    _, folder = _pretrained(tmp_path)
    gpt2 = load_model_file(str(HF / "gpt2.py")).build_model()
    with pytest.raises(RunError, match=r"not this model's: the model's transformer\.wpe\.weight, "
                                      r"transformer\.h\.0\.ln_1\.weight.* it holds model\.embed_tokens\.weight"):
        check_matches(open_checkpoint(folder), gpt2)


def test_a_shape_that_differs_names_the_parameter(tmp_path):
    _, folder = _pretrained(tmp_path, vocab=96)
    with pytest.raises(RunError, match=r"model\.embed_tokens\.weight with shape \[96, 32\].*parameter "
                                       r"model\.embed_tokens\.weight has shape \[128, 32\]"):
        _ours(weights=open_checkpoint(folder))


def test_plan_and_emit_check_the_checkpoint_and_exit_2(tmp_path):
    _, folder = _pretrained(tmp_path, vocab=96)
    plan_dir = tmp_path / "plan"
    write_scripts(hf_plan("llama", dp=2), plan_dir)
    (plan_dir / "plan.json").write_text(hf_plan("llama", dp=2).to_json())
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["emit", str(plan_dir / "plan.json"), "--out", str(out), "--init-from",
                                      str(folder)])
    assert result.exit_code == 2, result.output
    assert "model.embed_tokens.weight" in result.output and "Traceback" not in result.output
    assert not out.exists()
    _, good = _pretrained(tmp_path / "good")
    result = CliRunner().invoke(app, ["emit", str(plan_dir / "plan.json"), "--out", str(out), "--init-from",
                                      str(good), "--quiet"])
    assert result.exit_code == 0, result.output
    assert f'INIT_FROM = "{good.absolute()}"' in (out / "train.py").read_text()


def test_a_repo_id_missing_from_the_local_cache_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RunError, match="not in the local Hugging Face cache"):
        open_checkpoint("nobody/tiny-llama")


def test_a_sharded_rank_reads_only_its_shard(tmp_path, monkeypatch):
    """Rank 1 of 2 (torch's fake process group: no peers needed) holding row and column shards reads those
    slices of the safetensors file, nothing more."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from planner.runtime.weights import load_sharded

    full = {"a.weight": torch.arange(24.0).reshape(6, 4), "b.weight": torch.arange(12.0).reshape(3, 4)}
    save_file(full, tmp_path / "model.safetensors")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 6, bias=False), "b": torch.nn.Linear(4, 3, bias=False)})
        for name, placement in (("a", Shard(0)), ("b", Shard(1))):
            module = model[name]
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [placement]))
        read: list[tuple] = []
        original = SafetensorsCheckpoint.read_slice
        monkeypatch.setattr(SafetensorsCheckpoint, "read_slice",
                            lambda self, n, i: read.append((n, i)) or original(self, n, i))
        load_sharded(model, open_checkpoint(tmp_path), set())
        torch.testing.assert_close(model["a"].weight.to_local(), full["a.weight"][3:])
        torch.testing.assert_close(model["b"].weight.to_local(), full["b.weight"][:, 2:])
        assert read == [("a.weight", (slice(3, 6), slice(0, 4))), ("b.weight", (slice(0, 3), slice(2, 4)))]
    finally:
        dist.destroy_process_group()


def test_a_repo_id_in_the_local_hugging_face_cache(tmp_path, monkeypatch):
    """huggingface_hub's cache layout (models--org--name/refs/main -> snapshots/<commit>/), found offline."""
    ref, folder = _pretrained(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    folder.rename(repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    model = _ours(weights=open_checkpoint("someone/tiny-llama"))
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight, rtol=0, atol=0)
