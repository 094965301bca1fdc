"""The models' own initialisation in the generated job: transformers' `_init_weights`, a top-level
`init_weights()` (torchtitan's), else each module's `reset_parameters`, the same values for every layout."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.runtime.layout import ModelFile
from planner.runtime.loss import default_loss
from planner.runtime.model import build_model, load_model_file, materialise, micro_batch

pytest.importorskip("transformers")

from test_real_models import HF  # noqa: E402

CPU = torch.device("cpu")
SEED = 1234
# The corpus' causal LMs (tests/test_real_models.py) whose from-scratch loss is checked.
CAUSAL = ["llama", "gpt2", "qwen2", "gpt_neox", "phi3", "gemma"]


def _ours(arch: str, names: set[str] | None = None) -> nn.Module:
    spec = ModelFile(str(HF), "build_model", "example_inputs", None, None, {"arch": arch})
    user = load_model_file(spec.path)
    model = build_model(user, spec, SEED, everything_on_meta=False)
    materialise(model, {n for n, _ in model.named_modules()} if names is None else names, CPU, SEED)
    return model


def _transformers_own(arch: str) -> nn.Module:
    user = load_model_file(str(HF))
    torch.manual_seed(0)
    return user.build_model(arch=arch)  # _from_config: post_init() runs transformers' own initialisation


@pytest.mark.parametrize("arch", CAUSAL)
def test_every_parameter_starts_as_transformers_initialises_it(arch):
    ours, theirs = dict(_ours(arch).named_parameters()), dict(_transformers_own(arch).named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        q = theirs[name].detach()
        if q.numel() > 1 and q.std() > 0:
            # Two independent draws: their sample stds differ by about std / sqrt(n).
            tol = max(0.05, 4 / math.sqrt(q.numel()))
            assert abs(p.std().item() / q.std().item() - 1) < tol, (name, p.std().item(), q.std().item())
        else:
            torch.testing.assert_close(p.detach(), q, msg=name)


@pytest.mark.parametrize("arch", CAUSAL)
def test_first_loss_from_scratch_is_near_ln_vocab(arch):
    model = _ours(arch)
    spec = ModelFile(str(HF), "build_model", "example_inputs", None, None, {"arch": arch})
    batch = micro_batch(load_model_file(str(HF)), spec, 4, SEED, 0, 0)
    with torch.no_grad():
        loss = default_loss(model(batch[0]), *batch).item()
    assert abs(loss / math.log(128) - 1) < 0.10, loss


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_pipeline_stage_starts_from_the_same_values(arch):
    """dp and tp materialise every module (tp shards afterwards), a pipeline stage some of them: each holds
    the same values. GPT-2's attention sets its child c_proj (scaled by depth) and lm_head is tied to wte."""
    full = dict(_ours(arch).named_parameters())
    layers = "model.layers" if arch == "llama" else "transformer.h"
    first = ("model.embed_tokens",) if arch == "llama" else ("transformer.wte", "transformer.wpe")
    last = ("model.norm", "lm_head") if arch == "llama" else ("transformer.ln_f", "lm_head")
    for stage in ((*first, f"{layers}.0", f"{layers}.1"), (f"{layers}.2", f"{layers}.3", *last)):
        names = {n for n, _ in _meta(arch).named_modules() if n.startswith(tuple(f"{h}." for h in stage))}
        model = _ours(arch, names | set(stage))
        real = {n: p for n, p in model.named_parameters() if not p.is_meta}
        # (GPT-2's lm_head is wte: the last stage holds wte.weight under its first name)
        assert any(n.startswith(stage[-1]) for n in real) or "transformer.wte.weight" in real, sorted(real)
        for n, p in real.items():
            torch.testing.assert_close(p, full[n], rtol=0, atol=0, msg=n)


def test_numbers_an_init_draws_itself_are_the_same_for_a_pipeline_stage():
    """transformers' Mamba draws its dt_proj bias with torch.rand inside `_init_weights` (not an initialiser
    seeded per parameter): drawn from wherever the global generator stood, the first pipeline stage's mixers
    got the values of the last layers' (2.6e-4 off one process after 3 steps of pp2 x dp2). Each module's
    `_init_weights` now draws from a seed of its own name."""
    path = Path(__file__).parent / "fixtures" / "models" / "authored" / "hf_mamba.py"
    spec = ModelFile(str(path), "build_model", "example_inputs", None, None, {})
    user = load_model_file(spec.path)

    def built(names: set[str] | None) -> nn.Module:
        model = build_model(user, spec, SEED, everything_on_meta=False)
        materialise(model, {n for n, _ in model.named_modules()} if names is None else names, CPU, SEED)
        return model

    full = dict(built(None).named_parameters())
    meta = build_model(user, spec, SEED, everything_on_meta=True)
    for stage in (("backbone.embeddings", "backbone.layers.0", "backbone.layers.1"),
                  ("backbone.layers.2", "backbone.layers.3", "backbone.norm_f", "lm_head")):
        names = {n for n, _ in meta.named_modules() if n.startswith(tuple(f"{h}." for h in stage))} | set(stage)
        real = {n: p for n, p in built(names).named_parameters() if not p.is_meta}
        assert any(n.endswith("dt_proj.bias") for n in real), sorted(real)
        for n, p in real.items():
            torch.testing.assert_close(p, full[n], rtol=0, atol=0, msg=n)
    # still Mamba's initialisation: softplus(bias) is a time step in [time_step_min, time_step_max]
    dt = torch.nn.functional.softplus(full["backbone.layers.0.mixer.dt_proj.bias"])
    assert 1e-3 - 1e-6 <= dt.min() and dt.max() <= 0.1 + 1e-6
    assert not torch.equal(full["backbone.layers.0.mixer.dt_proj.bias"], full["backbone.layers.1.mixer.dt_proj.bias"])


def _meta(arch: str) -> nn.Module:
    spec = ModelFile(str(HF), "build_model", "example_inputs", None, None, {"arch": arch})
    return build_model(load_model_file(spec.path), spec, SEED, everything_on_meta=True)


class TitanStyle(nn.Module):
    """torchtitan's contract: modules built on meta, then `init_weights(buffer_device)` on the whole model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.out = nn.Linear(32, 64, bias=False)
        self.register_buffer("table", torch.arange(4.0))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.emb.weight)
        for i, layer in enumerate(self.layers):
            nn.init.trunc_normal_(layer.weight, std=0.02 / (2 * (i + 1)) ** 0.5)
            nn.init.zeros_(layer.bias)
        nn.init.trunc_normal_(self.out.weight, std=32**-0.5, a=-0.1, b=0.1)
        self.table = torch.arange(4.0, device=buffer_device) * 2


def test_a_top_level_init_weights_runs_the_same_for_every_layout(tmp_path):
    (tmp_path / "titan.py").write_text(
        "import sys\nsys.path.insert(0, " + repr(str(__import__("pathlib").Path(__file__).parent)) + ")\n"
        "from test_runtime_init import TitanStyle\n\ndef build_model(**_):\n    return TitanStyle()\n\n"
        "def example_inputs(b, **_):\n    import torch\n    return (torch.zeros(b, 4, dtype=torch.long),)\n"
    )
    spec = ModelFile(str(tmp_path / "titan.py"), "build_model", "example_inputs", None, None, {})
    user = load_model_file(spec.path)
    full = build_model(user, spec, SEED, everything_on_meta=False)
    materialise(full, {n for n, _ in full.named_modules()}, CPU, SEED)
    assert abs(full.emb.weight.std().item() - 1) < 0.05
    assert torch.equal(full.layers[0].bias, torch.zeros(32)) and torch.equal(full.table, torch.arange(4.0) * 2)
    assert full.out.weight.abs().max() <= 0.1
    assert abs(full.layers[2].weight.std().item() / (0.02 / 6**0.5) - 1) < 0.1
    part = build_model(user, spec, SEED, everything_on_meta=False)
    materialise(part, {"", "layers", "layers.2", "out"}, CPU, SEED)
    assert part.emb.weight.is_meta
    torch.testing.assert_close(part.layers[2].weight, full.layers[2].weight, rtol=0, atol=0)
    torch.testing.assert_close(part.out.weight, full.out.weight, rtol=0, atol=0)


def test_lora_adapters_start_as_peft_initialises_them():
    """peft's default: A Kaiming-uniform, B zero, so the adapted model starts as the base model."""
    pytest.importorskip("peft")
    from e2e.plans import TINY

    path = str(__import__("pathlib").Path(__file__).parent / "fixtures" / "models" / "finetune_gpt.py")
    spec = ModelFile(path, "build_model", "example_inputs", "loss_fn", None, {**TINY["gpt"], "mode": "lora"})
    user = load_model_file(path)
    model = build_model(user, spec, SEED, everything_on_meta=False)
    materialise(model, {n for n, _ in model.named_modules()}, CPU, SEED)
    q = model.blocks[0].attn.q
    assert torch.equal(q.lora_B["default"].weight, torch.zeros(64, 4))
    assert q.lora_A["default"].weight.abs().max() <= 1 / 8  # kaiming_uniform_(a=sqrt(5)): bound 1/sqrt(fan_in)
    assert q.lora_A["default"].weight.std() > 0.03
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        f"blocks.{i}.attn.{m}.lora_{ab}.default.weight" for i in range(4) for m in "qv" for ab in "AB"
    ]
