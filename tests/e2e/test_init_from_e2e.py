"""Pretrained weights in: a tiny Hugging Face Llama saved with save_pretrained, trained by the generated
launch.sh with --init-from its folder on 4 CPU ranks. The first step's loss equals transformers' own forward
(from_pretrained, labels = inputs) over the same global batch within 1e-5, in dp4, pp2 x dp2 and tp2 x dp2:
every rank read its modules' tensors (each pipeline stage its own) before TP and FSDP sharded them."""

from __future__ import annotations

import json

import pytest
import torch
from e2e.hf_plans import HF, hf_plan, llama_tp_plan
from e2e.test_train_e2e import run

from planner.codegen.render import runtime_objects, write_scripts
from planner.runtime.model import load_model_file, make_batch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

LAYOUTS = {
    "dp4_zero3": lambda: hf_plan("llama", dp=4, zero_stage=3),
    "pp2_dp2": lambda: hf_plan("llama", pp=2, dp=2),
    "tp2_dp2": lambda: hf_plan("llama", tp=2, dp=2, tp_plan=llama_tp_plan()),
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    torch.manual_seed(11)
    folder = tmp_path_factory.mktemp("pretrained") / "llama"
    load_model_file(str(HF / "llama.py")).build_model().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_first_loss_equals_transformers_forward_of_the_checkpoint(layout, pretrained, tmp_path):
    plan = LAYOUTS[layout]()
    out = tmp_path / "plan"
    write_scripts(plan, out)
    run(["bash", str(out / "launch.sh"), "--steps", "1", "--init-from", str(pretrained)], tmp_path)
    loss = json.loads((out / "metrics.json").read_text())["steps"][0]["loss"]

    lay, spec, training = runtime_objects(plan)
    user = load_model_file(spec.path)
    model = transformers.LlamaForCausalLM.from_pretrained(pretrained).train()
    batches = [make_batch(user, spec, lay, training.seed, 0, i) for i in range(lay.dp * lay.num_micro_batches)]
    with torch.no_grad():
        losses = [model(input_ids=ids, labels=ids).loss for ids, *_ in batches]
    expected = torch.stack(losses).mean().item()
    assert loss == pytest.approx(expected, abs=1e-5), (layout, loss, expected)
