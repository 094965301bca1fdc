"""planner.runtime.model: deterministic initialisation per module name, and batches that depend only on
(seed, step, micro-batch)."""

from __future__ import annotations

import torch
from e2e.plans import TINY, make_plan
from torch import nn

from planner.codegen.render import runtime_objects
from planner.runtime.model import build_model, default_init, derived_seed, load_model_file, make_batch, materialise

CPU = torch.device("cpu")


def test_derived_seeds_depend_on_every_part():
    assert derived_seed(0, "init", "blocks.1") == derived_seed(0, "init", "blocks.1")
    seeds = {derived_seed(s, "init", n) for s in (0, 1) for n in ("blocks.1", "blocks.10", "head")}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)


def test_initial_weights_do_not_depend_on_what_a_rank_holds():
    """A module's initial weights depend on (seed, its name) only, not on which other modules are built."""
    layout, spec, training = runtime_objects(make_plan("tiny", pp=2))
    user = load_model_file(spec.path)
    everything = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(everything, {n for n, _ in everything.named_modules()}, CPU, training.seed)
    part = build_model(user, spec, training.seed, everything_on_meta=False)
    owned = {n for n, _ in part.named_modules() if n.startswith(("blocks.2", "blocks.3", "head", "ln_f"))} | {""}
    materialise(part, owned, CPU, training.seed)
    full = dict(everything.named_parameters())
    held = {n: p for n, p in part.named_parameters() if not p.is_meta}
    assert {n.split(".")[0] for n in held} == {"pos_emb", "blocks", "ln_f", "head"}
    for n, p in held.items():
        torch.testing.assert_close(p, full[n], rtol=0, atol=0)
    torch.testing.assert_close(full["blocks.0.scale.gain"], torch.ones(64))  # default init of a 1-d weight
    other = build_model(user, spec, 1, everything_on_meta=False)
    materialise(other, {n for n, _ in other.named_modules()}, CPU, 1)
    assert not torch.equal(dict(other.named_parameters())["head.weight"], full["head.weight"])


def test_default_init():
    w, g, b = torch.empty(8, 4), torch.empty(8), torch.empty(8)
    torch.manual_seed(0)
    default_init("weight", w)
    default_init("norm.gain", g)
    default_init("bias", b)
    assert abs(w.std().item() - 0.02) < 0.01 and torch.equal(g, torch.ones(8)) and torch.equal(b, torch.zeros(8))


def test_batches_come_from_get_batch_when_the_plan_names_it(tmp_path):
    model_file = tmp_path / "data_model.py"
    model_file.write_text(
        "import torch\n"
        "from torch import nn\n\n\n"
        "def build_model(**kwargs):\n"
        "    return nn.Linear(4, 1)\n\n\n"
        "def example_inputs(batch_size, **kwargs):\n"
        "    return (torch.zeros(batch_size, 4),)\n\n\n"
        "def get_batch(step, micro_batch_size, micro_batch=-1, width=0, **kwargs):\n"
        "    return (torch.full((micro_batch_size, 4), float(step * 100 + micro_batch + width)),)\n"
    )
    plan = make_plan("mlp", dp=2, num_micro_batches=3)
    model = plan.model.model_copy(update={"path": str(model_file), "batch_fn": "get_batch", "loss_fn": None})
    layout, spec, training = runtime_objects(plan.model_copy(update={"model": model}))
    user = load_model_file(spec.path)
    (x,) = make_batch(user, spec, layout, training.seed, 3, 5)
    assert x.shape == (2, 4) and x[0, 0].item() == 300 + 5 + TINY["mlp"]["width"]  # model args passed too
    assert isinstance(build_model(user, spec, 0, everything_on_meta=True), nn.Linear)


def test_synthetic_batches_depend_on_step_and_micro_batch_only():
    layout, spec, training = runtime_objects(make_plan("gpt", dp=2))
    user = load_model_file(spec.path)
    a, b, c = (make_batch(user, spec, layout, training.seed, 1, i)[0] for i in (2, 2, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (2, TINY["gpt"]["seq"]) and a.dtype == torch.int64
