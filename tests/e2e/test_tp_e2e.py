"""Tensor parallelism the generated script really runs, on models nobody here wrote: each planned by
`planner plan --tp 2 --dp 2` for 4 CPU ranks, trained 3 steps by the generated launch.sh, and its losses and
gradient norms equal to a single-process run of the same micro-batches.

What each model adds to the sharding:
- llama, qwen2, moduledict_llama: separate q/k/v and gate/up Linears (qwen2: q/k/v biases), GQA heads;
- mixtral: attention sharded, the router and experts replicated (the non-expert parts);
- deepseek_v2: the shared expert sharded; the latent attention, the routed experts and the router
  replicated (all heads read one rotary key projection, whose gradient a head split would divide);
  only torch.export traces it;
- gpt2: HF Conv1D (weight stored [in, out]) sharded transposed, its fused c_attn chunk by chunk (q, k, v),
  split_size and nf divided by tp;
- headcount_gpt: a fused qkv Linear split with `split(self.dim)` and heads reshaped by `self.heads`;
- bert, vit: encoders (bert with its attention mask), t5 (position bias over all heads: attention stays
  replicated, the MLP is sharded) and bart (encoder-decoder, cross attention);
- pp2 x tp2 for moduledict_llama (fx-traced, heads reshaped with -1: TP inside pipeline stages);
- grouped-query attention with 2 kv heads per rank (hf: sources of Llama, Mistral, Qwen2: 8 heads, 4 kv heads)
  under tp2 x pp2: repeat_kv's expand in each traced stage made the rank's;
- nanogpt (karpathy's model.py): fused c_attn, `view(B, T, self.n_head, C // self.n_head)`, traced with meta
  values; tp2 x dp2, tp2 x pp2 and tp2 + sequence parallelism (its loss computed in forward on the gathered
  sequence), each run on the traced graph with its sizes made the rank's (runtime.tp_graph);
- phi3: q, k and v sliced out of the fused qkv_proj at fixed offsets (grouped-query: widths 64, 32, 32), each
  chunk split over tp, the slices' offsets made the rank's in the traced graph;
- falcon (tests/fixtures/models/hf_zoo.py): FalconLinear, an nn.Linear subclass with its own forward, kept as a
  Linear call (runtime.linears); its MLP's row-parallel output, which the model adds to in place, given as a copy.
ResNet and the sequential CNN have no column/row pair: `planner plan --tp 2` refuses before writing anything.

Each case is one torchrun (~20 s on 2 cores) plus a single-process reference (~5 s, once per model and
micro-batch layout).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from e2e.hf_plans import GQA_CONFIGS, LOSS_REL, LOSS_TOL, NORM_TOL, gqa_plan_args
from e2e.hf_plans import HF_ARCHS as CORPUS_HF_ARCHS
from e2e.plans import ci_cases, reference_of
from e2e.test_train_e2e import STEPS, assert_same_training, plan_and_train, run, train
from typer.testing import CliRunner

from planner.cli.main import app
from planner.plan import load_plan

pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
NO_TP_PAIRS = ("resnet", "sequential_cnn")
HF_ARCHS = tuple(a for a in CORPUS_HF_ARCHS if a not in NO_TP_PAIRS)  # every HF model of the corpus with TP pairs
FIXTURES = ("headcount_gpt", "moduledict_llama")


# hf_tiny.py keeps the configs' default dropout (GPT-2, BERT, T5, BART: 0.1), and random dropout masks cannot
# match a single-process run: the same corpus with every dropout probability of the config set to 0.
NO_DROPOUT = """\"\"\"hf_tiny's models with dropout off, so a parallel run can equal a single-process one.\"\"\"
import importlib.util

_spec = importlib.util.spec_from_file_location("hf_tiny", {path!r})
hf_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_tiny)
example_inputs = hf_tiny.example_inputs


def build_model(arch="llama", vocab=hf_tiny.VOCAB, **_):
    import transformers as tf

    cfg = hf_tiny._config(arch, vocab)
    for key, value in sorted(vars(cfg).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    cfg._attn_implementation = "sdpa" if arch != "resnet" else None
    return getattr(tf, hf_tiny._CLASSES[arch])._from_config(cfg)
"""


def model_args(name: str, where: Path) -> list[str]:
    if name in (*HF_ARCHS, "resnet", "qwen3"):
        path = where / "hf_tiny_no_dropout.py"
        path.write_text(NO_DROPOUT.format(path=str(MODELS / "hf_tiny.py")))
        return [str(path), "--model-arg", f"arch={name!r}"]
    if name == "sample_mlp":
        return [str(MODELS.parents[2] / "sample_models" / "mlp.py")]
    if name.startswith("zoo_"):  # tests/fixtures/models/hf_zoo.py: more architectures, configs as published
        return [str(MODELS / "hf_zoo.py"), "--model-arg", f"arch={name.removeprefix('zoo_')!r}"]
    if name.startswith("attention_"):  # tests/fixtures/models/attention_variants.py, by variant
        return [str(MODELS / "attention_variants.py"), "--model-arg", f"variant={name.removeprefix('attention_')!r}"]
    return [str(MODELS / f"{name}.py")]


def plan_cli(name: str, out: Path, *pins: str):
    return CliRunner().invoke(
        app,
        [
            "plan", *model_args(name, out.parent), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4",
            "--global-batch-size", "8", "--micro-batch-size", "2", *pins, "--lr", "1e-3", "--out", str(out),
            "--quiet",
        ],
    )


CASES = {
    **{f"{name}_tp2_dp2": (name, ("--tp", "2", "--dp", "2")) for name in (*HF_ARCHS, *FIXTURES)},
    "moduledict_llama_pp2_tp2": ("moduledict_llama", ("--tp", "2", "--pp", "2", "--schedule", "1f1b")),
    # Phi-3's q, k and v sliced at fixed offsets, inside pipeline stages (each stage's graph localised)
    "phi3_pp2_tp2": ("phi3", ("--tp", "2", "--pp", "2", "--schedule", "1f1b")),
    # nanoGPT as published: fused c_attn split by self.n_embd, heads by self.n_head and C // self.n_head (no
    # attribute a rank could divide), traced with meta values: the traced graph's sizes made each rank's.
    "nanogpt_tp2_dp2": ("nanogpt", ("--tp", "2", "--dp", "2", "--no-sequence-parallel")),
    "nanogpt_tp2_pp2": ("nanogpt", ("--tp", "2", "--pp", "2", "--schedule", "1f1b", "--no-sequence-parallel")),
    "nanogpt_tp2_dp2_sp": ("nanogpt", ("--tp", "2", "--dp", "2", "--sequence-parallel")),
    # An odd vocabulary (GPT-2's is 50257): the tied wte / lm_head split 64 + 63 rows, under FSDP2 too.
    # A regression head of one output (sample_models/mlp.py): narrower than its input, it stays replicated.
    "sample_mlp_tp2_dp2": ("sample_mlp", ("--tp", "2", "--dp", "2")),
    # Qwen3's per-head q_norm / k_norm (norm_heads: their weights' gradients summed over tp).
    "qwen3_tp2_dp2": ("qwen3", ("--tp", "2", "--dp", "2")),
    # Falcon: FalconLinear (an nn.Linear subclass computing `x @ weight.T`) kept as a Linear call, and its MLP's
    # row-parallel output changed in place (`mlp_output += attention_output`), given as a copy (TP_COPIED); the
    # multi-query fused query_key_value (one k/v head) stays replicated.
    "falcon_tp2_dp2": ("zoo_falcon", ("--tp", "2", "--dp", "2")),
    "gpt2_odd_vocab_tp2_dp2_zero3": (
        "gpt2", ("--tp", "2", "--dp", "2", "--zero-stage", "3", "--model-arg", "vocab=127")
    ),
}


def test_a_weight_applied_alike_to_every_head_trains_like_one_process_at_a_large_learning_rate(tmp_path):
    """attention_variants' head_scale (one learned vector over head_dim multiplying every head of q), tp 2: each
    rank's backward gives its own heads' share of that vector's gradient, summed over tp after the backward
    (TP_SUMMED). At lr 0.05 a run without the sum is 3.8e-4 off one process by step 3; with it, 4e-7."""
    args = [str(MODELS / "attention_variants.py"), "--model-arg", "variant='head_scale'", "--gpu", "cpu", "--nodes",
            "1", "--gpus-per-node", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--tp", "2",
            "--lr", "0.05"]
    plan, metrics, expected = plan_and_train(tmp_path, args)
    assert plan.tp.summed == ["blocks.0.scale", "blocks.1.scale"] and plan.tp.styles["blocks.0.qkv"] == "colwise"
    assert_same_training(metrics, expected)


_references: dict[str, dict] = {}


def reference_metrics(plan, tmp_path_factory) -> dict:
    """The single-process run of the plan's model and micro-batches, once per distinct one (the cases of one
    model with the same global micro-batches share it)."""
    ref = reference_of(plan)
    key = json.dumps([ref.model.model_dump(mode="json"), ref.parallel.model_dump(mode="json")], sort_keys=True)
    if key not in _references:
        _references[key] = train(ref, tmp_path_factory.mktemp("reference"), 1)
    return _references[key]


# In CI: nanoGPT (fused qkv, heads read in forward) with dp and pp, GPT-2 (Conv1D) and Llama (GQA); the rest
# (SP, MoE, per-head norms, odd vocabularies, other architectures) under the `corpus` marker. Falcon: the one
# model whose row-parallel output is changed in place; Phi-3: q, k and v sliced out of qkv_proj at fixed offsets.
KEPT = {"nanogpt_tp2_dp2", "nanogpt_tp2_pp2", "gpt2_tp2_dp2", "llama_tp2_dp2", "falcon_tp2_dp2", "phi3_tp2_dp2"}


@pytest.mark.parametrize("case", ci_cases(CASES, KEPT))
def test_tensor_parallel_plan_trains_like_one_process(case, tmp_path, tmp_path_factory):
    name, pins = CASES[case]
    out = tmp_path / "plan"
    result = plan_cli(name, out, *pins)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.parallel.tp == 2 and plan.parallel.world_size == 4
    assert plan.tp.styles  # something really is sharded
    if name == "gpt2":
        assert plan.tp.transposed and plan.tp.fused  # Conv1D, and c_attn chunk by chunk
    if name in ("headcount_gpt", "nanogpt"):
        assert plan.tp.fused and plan.tp.head_attrs
    if name == "phi3":  # q, k and v taken at fixed offsets, each split over tp (grouped-query: unequal widths)
        assert plan.tp.fused["model.layers.0.self_attn.qkv_proj"] == [64, 32, 32]
    if name == "zoo_falcon":
        blocks = range(4)
        assert plan.tp.copied == [f"transformer.h.{i}.mlp.dense_4h_to_h" for i in blocks]
        assert all(plan.tp.styles[f"transformer.h.{i}.mlp.dense_h_to_4h"] == "colwise" for i in blocks)
    run(["bash", str(out / "launch.sh"), "--steps", str(STEPS)], tmp_path)
    metrics = json.loads((out / "metrics.json").read_text())
    expected = reference_metrics(plan, tmp_path_factory)
    losses = [s["loss"] for s in metrics["steps"]]
    ref_losses = [s["loss"] for s in expected["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(ref_losses, abs=LOSS_TOL, rel=LOSS_REL), (case, losses, ref_losses)
    norms = [s["grad_norm"] for s in metrics["steps"]]
    assert norms == pytest.approx([s["grad_norm"] for s in expected["steps"]], rel=NORM_TOL), (case, norms)


# every case under -m corpus (77 s each on 4 CPU ranks): CI plans all three through the check
# (tests/test_real_models.py) and compares the rewritten repeat_kv with the whole model (test_runtime_tp_graph.py)
@pytest.mark.parametrize("arch", ci_cases({a: None for a in GQA_CONFIGS}, set()))
def test_gqa_tp2_pp2_trains_like_one_process(arch, tmp_path):
    """Each rank's pipeline stage runs its 2 of the 4 kv heads, each repeated for 2 query heads, in the traced graph
    (repeat_kv's `[:, :, None]` then expand: the kv heads divided, not the group size)."""
    pins = ("--tp", "2", "--pp", "2", "--schedule", "1f1b")
    plan, metrics, expected = plan_and_train(tmp_path, gqa_plan_args(arch, tmp_path, *pins))
    assert (plan.parallel.tp, plan.parallel.pp, plan.parallel.world_size) == (2, 2, 4)
    assert plan.tp.styles["model.layers.0.self_attn.k_proj"] == "colwise"
    assert_same_training(metrics, expected)


@pytest.mark.parametrize("name", NO_TP_PAIRS)
def test_tp_without_column_row_pairs_is_refused_before_writing(name, tmp_path):
    out = tmp_path / "plan"
    result = plan_cli(name, out, "--tp", "2", "--dp", "2")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "tensor" in message.lower() and "Traceback" not in result.output, message
    assert not out.exists() or not any(out.iterdir())
