"""Models as their authors write them (issue 27): a default-config Hugging Face model in a model file, batch norm,
PyTorch's own transformer modules, a recommender without a sequence, an fp32 island under bf16 and a scalar
parameter. Each is planned for 4 CPU ranks with dp4, pp2 x dp2 and tp2 x dp2, and plans or is refused with a
physical reason (never "the tracer could not"); the fixtures live in tests/fixtures/models/authored/."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch  # noqa: F401 - see tests/test_cli.py: torch's log handlers bind to the real stderr
from typer.testing import CliRunner

from planner.cli.main import app

AUTHORED = Path(__file__).resolve().parent / "fixtures" / "models" / "authored"
CLUSTER = ["--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8"]
LAYOUTS = {"dp4": ["--dp", "4"], "pp2xdp2": ["--pp", "2", "--dp", "2"], "tp2xdp2": ["--tp", "2", "--dp", "2"]}
runner = CliRunner()


def dry_run(model: Path | str, *args: str):
    return runner.invoke(app, ["dry-run", str(model), *CLUSTER, *args, "--json"])


def planned(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def refused(result, *needles: str) -> str:
    """The one-paragraph message of an exit-2 result, which names each needle and blames no tracer."""
    assert result.exit_code == 2, f"{result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    message = result.stderr[result.stderr.rfind("Error: "):]
    for needle in needles:
        assert needle in message, message
    assert "control flow" not in message and "tracer could not" not in message, message
    return message


# --- Hugging Face models built in a model file ----------------------------------------------------------------


def test_default_config_hf_model_gets_the_training_settings():
    """LlamaForCausalLM(LlamaConfig(...)) ships use_cache=True: its DynamicCache in the output stopped every
    tracer. The planner sets no cache and a traceable attention on it, and says so, as the hf: source does."""
    plan = planned(dry_run(AUTHORED / "hf_llama_default.py", *LAYOUTS["dp4"]))
    assert plan["source_settings"] == {"use_cache": False, "attn_implementation": "sdpa"}
    assert plan["source_spec"] is None
    assert plan["structure"] == ["4 x LlamaDecoderLayer in model.layers (ModuleList)"]


def test_the_generated_script_builds_with_the_same_settings():
    """The runtime's build (train.py, the plan-time check) applies them too, to every PreTrainedModel inside the
    model (here one wrapped in a plain nn.Module), replacing an attention that does not trace (flash attention)."""
    import transformers
    from torch import nn

    from planner.runtime.model import hf_training_settings

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2)
    with torch.device("meta"):
        wrapper = nn.ModuleDict({"lm": transformers.LlamaForCausalLM(config)})
    wrapper["lm"].config._attn_implementation = "flash_attention_2"
    assert wrapper["lm"].config.use_cache
    assert hf_training_settings(wrapper) == {"use_cache": False, "attn_implementation": "sdpa"}
    assert wrapper["lm"].config.use_cache is False
    assert wrapper["lm"].config._attn_implementation == "sdpa"
    assert hf_training_settings(nn.Linear(2, 2)) == {}


MISMATCH = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(9, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 8),)
"""


def test_the_models_own_error_is_quoted(tmp_path):
    """A model that fails by itself (a Linear fed the wrong width) is reported as the model's error, with its
    line, not as data-dependent control flow the tracers could not follow."""
    model = tmp_path / "mismatch.py"
    model.write_text(textwrap.dedent(MISMATCH))
    message = refused(dry_run(model, "--dp", "4"), "raises when run as written", "[1, 8] X [9, 2]",
                      "mismatch.py, line 14")
    assert "data-dependent" not in message


# --- batch norm ------------------------------------------------------------------------------------------------


def test_batch_norm_traces_two_samples_and_never_plans_a_micro_batch_of_one():
    """BatchNorm1d on [batch, features] refuses one sample in training: the trace takes two and divides its counts
    back to one sample; the search keeps micro-batches of 2 or more, and a pin of 1 is refused with why."""
    plan = planned(dry_run(AUTHORED / "batchnorm_mlp.py", *LAYOUTS["dp4"]))
    assert plan["parallel"]["micro_batch_size"] == 2
    assert plan["total_params"] == 32 * 64 + 64 + 4 * (64 * 64 + 64 + 2 * 64) + 64 * 10 + 10
    for alternative in plan["alternatives"]:
        assert alternative["parallel"]["micro_batch_size"] >= 2
    assert any(r["region"] == "mbs=1" and "batch norm" in r["reason"] for r in plan["rejected"])
    refused(dry_run(AUTHORED / "batchnorm_mlp.py", *LAYOUTS["dp4"], "--micro-batch-size", "1"),
            "mbs=1", "one value per channel", "--micro-batch-size 2")


def test_batch_norm_counts_are_per_sample():
    """Traced at two samples, the figures are those of one: the Linear FLOPs of a sample are 2 x in x out."""
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    graph = analyse_model(load_model_file(AUTHORED / "batchnorm_mlp.py", dtype="fp32"))
    assert graph.min_micro_batch == 2
    assert graph.sample_input_shapes == [[1, 32]]
    block = next(u for u in graph.units if u.kind == "block")
    assert block.matmul_flops == 2 * 64 * 64
    assert block.input_bytes == 64 * 4


# --- sequence parallelism needs a sequence --------------------------------------------------------------------


def test_no_sequence_parallelism_without_a_sequence():
    """A recommender's inputs are [batch, 13] dense features and [batch, 4] table ids: tp2 x dp2 plans with sequence
    parallelism off (it used to be chosen, and the plan-time check then refused every candidate), and a pin of it is
    refused with the reason."""
    plan = planned(dry_run(AUTHORED / "recommender.py", *LAYOUTS["tp2xdp2"]))
    assert plan["parallel"]["tp"] == 2 and plan["parallel"]["sequence_parallel"] is False
    assert not any(r["region"] == "tp=2 without sp" for r in plan["rejected"])
    refused(dry_run(AUTHORED / "recommender.py", *LAYOUTS["tp2xdp2"], "--sequence-parallel"),
            "tp=2 with sp", "no sequence dimension", "(13)")


def test_a_language_model_keeps_its_sequence():
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    assert analyse_model(load_model_file(AUTHORED / "hf_llama_default.py")).has_sequence
    assert not analyse_model(load_model_file(AUTHORED / "recommender.py")).has_sequence


# --- fp32 islands under bf16 ----------------------------------------------------------------------------------


def test_an_fp32_island_traces_under_the_runs_mixed_precision():
    """A diffusion UNet's timestep embedding is computed in fp32 on purpose and fed to a Linear: under bf16 the
    analysis gives the Linear its input in bf16, as autocast and FSDP2's input cast do, instead of refusing it."""
    import torch.nn.functional as F

    from planner.model.analysis import analyse_model
    from planner.model.counting import mixed_precision_mode
    from planner.model.load import load_model_file

    x = torch.empty(2, 4, 8, 8, device="meta")
    w = torch.empty(4, 4, 3, 3, device="meta", dtype=torch.bfloat16)
    b = torch.empty(4, device="meta", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="should be the same"):
        F.conv2d(x, w, b)
    with mixed_precision_mode(torch.bfloat16):
        assert F.conv2d(x, w, b).dtype == torch.bfloat16
        assert F.linear(x.flatten(1), torch.empty(4, 256, device="meta", dtype=torch.bfloat16)).dtype == torch.bfloat16
    graph = analyse_model(load_model_file(AUTHORED / "diffusion_unet.py", dtype="bf16"))
    assert graph.structure == ["4 x ResBlock in blocks (ModuleList)"]
    assert graph.total_params == sum(u.params for u in graph.units)


# --- PyTorch's own transformer modules ------------------------------------------------------------------------


def test_transformer_encoder_is_traced_as_a_container():
    """nn.TransformerEncoder was one torch.fx leaf (every torch.nn module is): one unit, no pp, no tp pairs. Traced
    through, each layer is a unit, every parameter is counted, and linear1 / linear2 are a tensor-parallel pair, as
    are MultiheadAttention (kept as one call) and its out_proj: its packed q/k/v parameter is sharded in 3 chunks,
    each by heads (parallel.ShardedMultiheadAttention runs it)."""
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    loaded = load_model_file(AUTHORED / "transformer_encoder_lm.py")
    graph = analyse_model(loaded)
    model = loaded.build()
    assert [u.name for u in graph.units] == ["embed", *(f"encoder.layers.{i}" for i in range(4)), "head"]
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert sum(u.params for u in graph.units) == graph.total_params
    layer = graph.unit("encoder.layers.0")
    assert [(p.column, p.row) for p in layer.tp_pairs] == [
        (["encoder.layers.0.linear1"], "encoder.layers.0.linear2"),
        (["encoder.layers.0.self_attn"], "encoder.layers.0.self_attn.out_proj"),
    ]
    assert layer.tp_fused == {"encoder.layers.0.self_attn": 3} and layer.tp_granularity == 4  # 4 heads
    plan = planned(dry_run(AUTHORED / "transformer_encoder_lm.py", *LAYOUTS["pp2xdp2"], "--schedule", "1f1b"))
    stages = [s["units"] for s in plan["stages"]]  # cut between encoder layers (where is the cost model's choice)
    assert len(stages) == 2 and all(stages) and sum(stages, []) == [u.name for u in graph.units], stages


# --- every authored model in every layout ---------------------------------------------------------------------

# (model, layout) -> what the refusal names; every other pair plans.
REFUSED = {
    ("batchnorm_mlp", "tp2xdp2"): "no Linear pairs",  # each Linear feeds a batch norm, not a partner Linear
    ("clip_two_tower", "tp2xdp2"): "no Linear pairs",  # residual MLP blocks of one Linear each
    # Mamba-1's x_proj reduces over the inner channels in_proj would shard: no column/row pair in a block
    ("hf_mamba", "tp2xdp2"): "no Linear pairs",
    ("mamba_minimal", "tp2xdp2"): "no Linear pairs",
    # Mamba-2's in_proj and out_proj are inside its mixer, one call in the trace (its scan); sharding it by heads
    # takes a mixer of its own (Megatron's MambaMixer), which the planner does not write
    ("hf_mamba2", "tp2xdp2"): "no Linear pairs",
    ("lstm_lm", "tp2xdp2"): "no Linear pairs",  # the recurrence is one nn.LSTM; the decoder has no partner
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(p.stem for p in AUTHORED.glob("*.py")))
def test_each_authored_model_plans_or_is_refused_with_a_physical_reason(name, layout):
    result = dry_run(AUTHORED / f"{name}.py", *LAYOUTS[layout])
    if (name, layout) in REFUSED:
        refused(result, REFUSED[(name, layout)])
        return
    plan = planned(result)
    wanted = {"dp4": (4, 1, 1), "pp2xdp2": (2, 1, 2), "tp2xdp2": (2, 2, 1)}[layout]
    assert (plan["parallel"]["dp"], plan["parallel"]["tp"], plan["parallel"]["pp"]) == wanted


# --- state-space models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mamba_minimal", "hf_mamba"])
def test_mamba_is_costed_as_its_fused_kernels(name):
    """Mamba's reference scan loops over time steps in Python: each mixer is one call in the trace (the rule of
    planner.runtime.scans) and is counted as mamba_ssm's fused path: the projections' matmuls plus the selective
    scan's 9 B L D N + 2 B L D FLOPs, not the loop's ops. At seq 2048 this takes about as long as at 16."""
    import time

    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    start = time.perf_counter()
    graph = analyse_model(load_model_file(AUTHORED / f"{name}.py", dtype="bf16", model_args={"seq": 2048}))
    took = time.perf_counter() - start
    block = next(u for u in graph.units if u.kind == "block")
    d_model, d_inner, n, rank, width, seq = 32, 64, 8 if name == "hf_mamba" else 16, 2, 4, 2048
    matmul = 2 * (d_model * 2 * d_inner + d_inner * (rank + 2 * n) + rank * d_inner + d_inner * d_model)
    scan = 9 * d_inner * n + 2 * d_inner
    conv = 2 * d_inner * width
    assert block.matmul_flops == pytest.approx(matmul * seq, rel=1e-6)
    assert block.fwd_flops == pytest.approx((matmul + scan + conv) * seq, rel=0.01)
    embed, layer = 96 * 32, 32 + 32 * 128 + 64 * 5 + 64 * (rank + 2 * n) + 3 * 64 + 64 * n + 64 + 64 * 32
    assert graph.total_params == embed + 4 * layer + 32  # every parameter once (A_log and D too), the head tied
    assert took < 20, took


def test_mamba2_is_costed_as_the_ssd_kernels():
    """transformers' Mamba-2 without mamba_ssm runs the SSD scan as torch einsums over (chunk x chunk) blocks in
    fp32: counted op by op, 10x the activations and 8x the bytes the fused kernels move. Each mixer is counted
    as mamba_ssm's mamba_split_conv1d_scan_combined: in_proj and out_proj as matmuls (exactly), the chunked scan's
    products on the tensor cores as ssd_flops (exactly: Dao & Gu 2024, sec. 6, here with 2048 / 8 chunks of 8
    and two groups), and the whole forward within 10% of matmuls + SSD + convolution (the rest: the gated norm,
    D's skip, the decays, the block's RMS norm). It keeps what the kernel saves for backward: in_proj's output,
    the scan's output and 1/rms (plus the block's norm and in_proj's input), not the blocks."""
    from planner.model.analysis import analyse_model
    from planner.model.kernels import ssd_flops
    from planner.model.load import load_model_file

    seq = 2048
    graph = analyse_model(load_model_file(AUTHORED / "hf_mamba2.py", dtype="bf16", model_args={"seq": seq}))
    blocks = [u for u in graph.units if u.kind == "block"]
    assert [u.name for u in blocks] == [f"backbone.layers.{i}" for i in range(4)]
    block = blocks[0]
    d_model, d_inner, heads, headdim, groups, state, chunk, width = 32, 64, 8, 8, 2, 8, 8, 4
    conv_dim = d_inner + 2 * groups * state
    in_proj = d_inner + conv_dim + heads  # [z, x, B, C, dt]
    matmul = 2 * seq * (d_model * in_proj + d_inner * d_model)
    ssd = 2 * seq * chunk * (groups * state + heads * headdim) + 4 * seq * heads * headdim * state
    assert ssd_flops(1, seq, heads, headdim, groups, state, chunk) == ssd
    assert ssd_flops(1, 20, heads, headdim, groups, state, chunk) == (  # chunks of 8, 8 and 4
        2 * (8 * 8 + 8 * 8 + 4 * 4) * (groups * state + heads * headdim) + 4 * 20 * heads * headdim * state
    )
    assert block.matmul_flops == pytest.approx(matmul, rel=1e-9)
    assert block.attention_flops == pytest.approx(ssd, rel=1e-9)
    assert block.fwd_flops == pytest.approx(matmul + ssd + 2 * width * conv_dim * seq, rel=0.10)
    assert block.bwd_attention_flops > 2 * block.attention_flops  # and the recomputed C B^T and chunk states
    kernel_saved = seq * (in_proj * 2 + d_inner * 2 + groups * 4)  # zxbcdt, the scan's output (bf16), 1/rms
    assert kernel_saved < block.activation_bytes < 2.5 * kernel_saved
    assert block.memory_bound_bytes < 10e6  # the einsum path: 62 MB


# Hybrids whose mixer is transformers' Mamba-2 mixer under another name, at test size (their class, model, config)
HYBRID_MAMBA2 = {
    "Bamba": ("BambaConfig", "BambaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, attn_layer_indices=[1])),
    "Zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        layers_block_type=["mamba", "hybrid"], num_attention_heads=4, mamba_headdim=16, n_mamba_heads=8,
        mamba_d_state=8, mamba_ngroups=1, chunk_size=16)),
    "NemotronH": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=8, n_groups=1, chunk_size=16)),
    "FalconH1": ("FalconH1Config", "FalconH1ForCausalLM", dict(  # no gated norm (mamba_rms_norm=False)
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_ssm=128, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)),
    "GraniteMoeHybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)),
}


@pytest.mark.parametrize("name", sorted(HYBRID_MAMBA2))
def test_hybrids_mamba2_mixers_run_as_the_ssd_kernels(name):
    """The hybrids' Mamba-2 mixers (transformers' copies of Mamba2Mixer) are recognised and run as the fused
    path: the stand-in's output has the mixer's own output's shape and every weight it reads gets a gradient."""
    import transformers

    from planner.model.kernels import fused_mixer
    from planner.runtime.scans import is_ssm_mixer

    config_cls, model_cls, sizes = HYBRID_MAMBA2[name]
    config = getattr(transformers, config_cls)(vocab_size=96, hidden_size=64, num_hidden_layers=2, **sizes)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    mixer = next(m for m in model.modules() if is_ssm_mixer(m))
    forward = fused_mixer(mixer)
    assert forward is not None, type(mixer).__name__
    x = torch.zeros(2, 40, 64, device="meta", requires_grad=True)
    y = forward(x)
    assert y.shape == mixer(x).shape
    y.float().sum().backward()
    for weight in (mixer.in_proj.weight, mixer.out_proj.weight, mixer.conv1d.weight, mixer.A_log, mixer.D):
        assert weight.grad is not None and weight.grad.shape == weight.shape


def test_the_check_recomputes_the_mixer_that_ran_a_scan():
    """A plan with activation checkpointing: the check's first mixer runs its code and the repeats return the
    recorded shape; its recomputation in backward used to find its own call recorded and return the repeat,
    saving fewer tensors than its forward did (CheckpointError), which failed Mamba's and Mamba-2's plans on meta
    whenever recomputation was chosen. The mixer that ran a call runs it again."""
    import transformers
    from torch.utils.checkpoint import checkpoint

    from planner.codegen.check import mixer_stand_in
    from planner.runtime.scans import each_scan_once

    config = transformers.Mamba2Config(vocab_size=96, hidden_size=32, num_heads=8, head_dim=8, state_size=8,
                                       n_groups=2, chunk_size=8, num_hidden_layers=3)
    with torch.device("meta"):
        model = transformers.Mamba2ForCausalLM(config)
    ids = torch.zeros(2, 20, dtype=torch.long, device="meta")
    for device in ("cuda", "cpu"):
        with each_scan_once(mixer_stand_in(device)):
            h = model.backbone.embeddings(ids)
            for layer in model.backbone.layers:
                h = checkpoint(layer, h, use_reentrant=False)
            model.lm_head(model.backbone.norm_f(h)).float().sum().backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
        model.zero_grad(set_to_none=True)


def test_the_scan_rule_and_the_check_run_each_distinct_mixer_once():
    from planner.runtime.scans import each_scan_once, is_ssm_mixer
    from planner.runtime.tracers import BufferTracer

    spec = __import__("importlib.util").util.spec_from_file_location("mm", AUTHORED / "mamba_minimal.py")
    mod = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.device("meta"):
        model = mod.build_model()
    mixers = [n for n, m in model.named_modules() if is_ssm_mixer(m)]
    assert mixers == [f"layers.{i}.mixer" for i in range(4)]
    graph = BufferTracer().trace(model)
    assert [n.target for n in graph.nodes if n.op == "call_module" and n.target.endswith("mixer")] == mixers
    calls = []
    original = type(model.layers[0].mixer).selective_scan
    type(model.layers[0].mixer).selective_scan = lambda self, *a: calls.append(1) or original(self, *a)
    try:
        ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
        with each_scan_once():
            model(ids).float().sum().backward()
    finally:
        type(model.layers[0].mixer).selective_scan = original
    assert len(calls) == 1  # four identical mixers, one run of the scan
    assert all(p.grad is not None for p in model.parameters())


def test_the_check_of_a_gpu_plan_runs_the_first_mixer_as_the_fused_kernels():
    """The plan-time check of a GPU plan runs a Mamba mixer as the fused kernels compute it (the path a GPU run
    takes), from the model's first call on: the first mixer call used to run as written (the class was patched
    by that call's own pre-hook, too late for it), and Mamba-2.8B's reference scan at seq 2048 took 6 of the
    check's 6 s on meta. A CPU plan's check runs the mixer as written (the CPU run takes the reference scan)."""
    import transformers

    from planner.codegen.check import mixer_stand_in
    from planner.runtime.scans import each_scan_once

    mixer_cls = transformers.models.mamba.modeling_mamba.MambaMixer
    with torch.device("meta"):
        model = transformers.MambaForCausalLM(
            transformers.MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=3)
        )
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    runs = {}
    for device in ("cuda", "cpu"):
        calls = []
        original = mixer_cls.forward
        mixer_cls.forward = lambda self, *a, _f=original, _c=calls, **k: _c.append(1) or _f(self, *a, **k)
        try:
            with each_scan_once(mixer_stand_in(device)):
                out = model(ids).logits
                out.float().sum().backward()
        finally:
            mixer_cls.forward = original
        assert out.shape == (2, 16, 96)
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
        model.zero_grad(set_to_none=True)
        runs[device] = len(calls)
    assert runs == {"cuda": 0, "cpu": 1}  # three identical mixers: as the kernels, or one run as written


# --- a hybrid SSM / attention / MoE stack ---------------------------------------------------------------------


def test_hybrid_moe_is_recognised_without_pins_and_its_experts_fall_as_one_over_ep():
    """Jamba's stack (Mamba and attention layers, a mixture of experts in every other layer): the experts are
    found without --ep in their layers (units at the layers' boundaries: no two layers alike), and the weights a
    rank holds lose exactly (1 - 1/ep) of the experts' bytes (without ZeRO and with ZeRO-1, where the weights are
    whole on each replica)."""
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    graph = analyse_model(load_model_file(AUTHORED / "hf_jamba.py"))
    experts = sum(u.expert_params for u in graph.units)
    assert experts == 2 * 4 * 3 * 32 * 64  # two MoE layers of 4 experts (gate, up, down)
    assert [u.name for u in graph.units if u.experts] == ["model.layers.1", "model.layers.3"]
    assert {u.ep_granularity for u in graph.units if u.experts} == {4}
    for zero in ("0", "1"):
        weights = {}
        for ep in (1, 2, 4):
            p = planned(dry_run(AUTHORED / "hf_jamba.py", "--dp", "4", "--ep", str(ep), "--zero-stage", zero))
            weights[ep] = sum(s["memory"]["weights"] for s in p["stages"])
        per_param = weights[1] / graph.total_params
        for ep in (2, 4):
            assert weights[1] - weights[ep] == pytest.approx(experts * per_param * (1 - 1 / ep))


def test_an_embedding_read_outside_its_lookup_is_left_replicated_by_tp():
    """Whisper's logits multiply the token embedding's weight whole (x @ token_embedding.weight.T): a vocab-parallel
    shard would meet that read, so tp leaves the embedding replicated and says why; the blocks are still split.
    (tests/e2e/test_authored_e2e.py trains this plan under -m corpus.)"""
    plan = planned(dry_run(AUTHORED / "whisper_style.py", *LAYOUTS["tp2xdp2"]))
    assert plan["parallel"]["tp"] == 2
    assert not [name for name in plan["tp_plan"] if "token_embedding" in name]
    assert len(plan["tp_plan"]) > 0
    assert any(r.startswith("decoder.token_embedding is not sharded") and "outside the lookup" in r
               for r in plan["tp_refused"]), plan["tp_refused"]


# --- batch norm against one process ---------------------------------------------------------------------------


def test_batch_norm_is_compared_with_one_process_over_micro_batches_of_four():
    """bench/corpus_train.py compares each layout with one process summing the same micro-batches' gradients; a
    layout sums them in another order (an all-reduce, a pipeline's accumulation), the same maths. Batch norm over
    2 samples turns that last-bit difference into 1e-4-1e-3 of loss by step 3 in one process alone (dp4 was 1.3e-4
    and pp2 x dp2 5e-5 off, both exact at steps 1 and 2), so the bench compares batchnorm_mlp over micro-batches
    of 4 (tests/e2e/hf_plans.py BATCHES), where reordering moves it well inside the tolerance. How far micro-batches
    of 2 drift depends on the machine's kernels (2e-4 here, 3e-6 on CI's), so only the bench's choice is asserted."""
    import copy
    import importlib.util
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e.hf_plans import BATCHES, LOSS_TOL

    spec = importlib.util.spec_from_file_location("batchnorm_mlp", AUTHORED / "batchnorm_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    built = module.build_model()

    def losses(micro: int, tree: bool) -> list[float]:
        """3 steps of train.py's AdamW and clipping over 4 micro-batches of `micro`, their gradients summed one
        after the other or as (0 + 1) + (2 + 3)."""
        model = copy.deepcopy(built)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(3):
            grads, total = [], 0.0
            for _ in range(4):
                x = torch.randn(micro, 32, generator=g)
                model.zero_grad()
                loss = module.loss_fn(model(x), x) / 4
                loss.backward()
                total += loss.item()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, (a, b, c, d) in zip(model.parameters(), zip(*grads, strict=True), strict=True):
                p.grad = (a + b) + (c + d) if tree else ((a + b) + c) + d
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            out.append(total)
        return out

    def reordered(micro: int) -> float:
        return max(abs(a - b) for a, b in zip(losses(micro, False), losses(micro, True), strict=True))

    assert BATCHES["batchnorm_mlp"][1] == 4 and reordered(4) < LOSS_TOL / 10


OUT_ARGUMENT = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            y = b(x)
            x = torch.add(y, x, out=y)
        return x


def build_model(**_):
    return Net()


def example_inputs(batch_size, **_):
    return (torch.randn(batch_size, 16),)
"""


def test_a_model_that_cannot_run_backward_is_refused_quoting_its_line(tmp_path):
    """An op autograd refuses (out= on a tensor that requires grad) traces, then fails where the planner counts the
    unit forward and backward: the message quotes the model's line and error, exit 2, not an internal error."""
    path = tmp_path / "net.py"
    path.write_text(OUT_ARGUMENT)
    message = refused(dry_run(path, *LAYOUTS["dp4"]), "The model cannot train", "out=")
    line = next(i for i, row in enumerate(OUT_ARGUMENT.splitlines(), 1) if "out=y" in row)
    assert f"net.py, line {line}" in " ".join(message.split()) and "Internal error" not in message
