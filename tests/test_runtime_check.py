"""The plan-time check (planner.runtime.check, wired into `planner plan`): plans that cannot run are refused
with the stage, module or rule named, and `planner plan` then exits 2 without writing anything."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from e2e.plans import TINY, make_plan
from torch import nn
from typer.testing import CliRunner

from planner.cli.main import app
from planner.codegen.check import check_plan_runs
from planner.errors import LayoutRefusedError, PlanError
from planner.model.graph import TPPlan

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)
        self.scale = torch.ones(64)  # a plain attribute, neither parameter nor buffer: baked into the trace

    def forward(self, x):
        h = self.proj_in(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if {broken} and i == 2:
                h = h * self.scale
        return self.head(self.norm(h))


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 16),)


def loss_fn(output, x):
    return {loss}
'''


def _plan(tmp_path, broken=False, loss="output.mean()", **pins):
    path = tmp_path / "net.py"
    path.write_text(MODEL.format(broken=broken, loss=loss))
    plan = make_plan("mlp", **pins)
    return plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(path)})})


def test_plans_that_run_pass(tmp_path):
    assert check_plan_runs(_plan(tmp_path, pp=2)) == "fx"
    assert check_plan_runs(_plan(tmp_path, dp=2)) == "module"
    assert check_plan_runs(make_plan("tiny", pp=2, model_args={**TINY["tiny"], "check_length": True})) == "export"


def test_a_failing_model_is_not_taken_for_a_refused_tp_layout(tmp_path):
    """With tp the check runs the stages sharded first. A model that fails there and as written too (its loss)
    is reported at once (PlanError: no layout fixes it), not as a refused layout (LayoutRefusedError: the next
    runner-up may run; a shard that alone fails, below)."""
    def sharded(loss: str, tp_plan: dict[str, str]):
        plan = _plan(tmp_path, loss=loss, pp=2)
        return plan.model_copy(update={
            "tp": dataclasses.replace(plan.tp, styles=tp_plan),
            "parallel": plan.parallel.model_copy(update={"tp": 2}),
            "cluster": plan.cluster.model_copy(update={"gpus_per_node": 4}),
        })

    pair = {"blocks.1": "colwise", "blocks.2": "rowwise"}
    with pytest.raises(PlanError, match="floating-point scalar") as failed:
        check_plan_runs(sharded("output", pair))
    assert not isinstance(failed.value, LayoutRefusedError)
    assert check_plan_runs(sharded("output.mean()", pair)) == "fx"


def test_a_plain_tensor_attribute_is_fetched_from_the_model(tmp_path):
    """A tensor attribute (neither parameter nor buffer) is read from the built model, so the plan runs."""
    assert check_plan_runs(_plan(tmp_path, broken=True, pp=2)) == "fx"


def test_a_loss_that_is_not_a_scalar_is_refused(tmp_path):
    with pytest.raises(PlanError, match="The loss must be a floating-point scalar tensor, got Tensor of shape"):
        check_plan_runs(_plan(tmp_path, loss="output", pp=2))
    with pytest.raises(PlanError, match="floating-point scalar"):
        check_plan_runs(_plan(tmp_path, loss="output", dp=2))


def test_tp_that_does_not_divide_is_refused():
    plan = make_plan("gpt", tp=2, model_args={**TINY["gpt"], "hidden": 66, "heads": 3})
    plan = plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"tp": 4, "dp": 1})})
    with pytest.raises(PlanError, match=r"splits blocks.0.attn.q \(colwise, size 66\) over tp=4"):
        check_plan_runs(plan)


def _plan_source(tmp_path, source: str, *pins: str):
    """`planner plan` of `source` (written as net.py) on 2 CPU ranks: the result and the output folder."""
    path = tmp_path / "net.py"
    path.write_text(source)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["plan", str(path), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "4",
         *pins, "--out", str(out), "--quiet"],
    )
    return result, out


def _refused_plan(tmp_path, source: str, *pins: str) -> str:
    """`_plan_source`, which must exit 2 and write nothing; its output on one line."""
    result, out = _plan_source(tmp_path, source, *pins)
    assert result.exit_code == 2, result.output
    assert not out.exists() or not any(out.iterdir())
    return " ".join(result.output.split())


def test_planner_plan_exits_2_and_writes_nothing(tmp_path):
    text = _refused_plan(tmp_path, MODEL.format(broken=False, loss="output"), "--dp", "2")
    assert "The plan cannot run" in text and "floating-point scalar" in text


def test_tp_on_a_conv1d_the_plan_does_not_mark_transposed_is_refused_at_plan_time():
    """The script shards GPT-2's Conv1D transposed only where the plan says its weight is [in, out]."""
    pytest.importorskip("transformers")
    from e2e.hf_plans import hf_plan

    plan = hf_plan("gpt2", tp=2, dp=2, tp_plan={"transformer.h.0.attn.c_attn": "colwise"})
    with pytest.raises(PlanError, match=r"transformer.h.0.attn.c_attn, a Conv1D, but the plan does not list it in "):
        check_plan_runs(plan)
    plan = plan.model_copy(update={"tp": dataclasses.replace(plan.tp, transposed=["transformer.h.0.attn.c_attn"])})
    plan = plan.model_copy(update={"tp": dataclasses.replace(plan.tp, fused={"transformer.h.0.attn.c_attn": 3})})
    # Marked transposed and fused, c_attn alone still cannot run: GPT-2 splits its output at split_size and
    # c_proj expects all heads. The sharded run on meta (rank 0's shard) says so, as the launch would.
    with pytest.raises(PlanError, match=r"sharded for tp 2 .* fails on one micro-batch"):
        check_plan_runs(plan)
    # The whole pair, as `planner plan` writes it, runs.
    attn = "transformer.h.0.attn"
    plan = plan.model_copy(update={"tp": dataclasses.replace(
        plan.tp,
        styles={f"{attn}.c_attn": "colwise", f"{attn}.c_proj": "rowwise"},
        transposed=[f"{attn}.c_attn", f"{attn}.c_proj"],
        head_attrs={attn: ["split_size"], f"{attn}.c_attn": ["nf"]},
    )})
    check_plan_runs(plan)


SLICED_QKV = Path(__file__).parent / "fixtures" / "models" / "attention_variants.py"  # variant sliced_qkv


@pytest.mark.parametrize("variant", ["sliced_qkv", "split_qkv"])
def test_tp_of_a_projection_sliced_at_fixed_offsets_is_planned_chunk_by_chunk(tmp_path, variant):
    """q (4 heads), k and v (2 each) taken out of one fused projection at fixed offsets, as Phi-3 does, or by a
    split of unequal sizes, as ChatGLM does: each chunk split over tp on its own (TP_FUSED gives their widths),
    run as a traced graph whose offsets or sizes are made the rank's, which the plan-time check runs. tp 4 would
    leave k and v half a head: refused, with the reason."""
    path = SLICED_QKV
    out = tmp_path / "out"
    args = ["plan", str(path), "--model-arg", f"variant={variant!r}", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "2", "--global-batch-size", "4", "--tp", "2", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp_fused"] == {"blocks.0.qkv": [32, 16, 16], "blocks.1.qkv": [32, 16, 16]}
    assert plan["tp_plan"]["blocks.1.qkv"] == "colwise" and plan["tp_plan"]["blocks.1.o"] == "rowwise"
    assert 'TP_FUSED = {"blocks.0.qkv": [32, 16, 16], "blocks.1.qkv": [32, 16, 16]}' in (out / "train.py").read_text()
    args[args.index("--gpus-per-node") + 1] = args[args.index("--tp") + 1] = "4"
    args[args.index("--out") + 1] = str(tmp_path / "tp4")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "heads/hidden sizes split only into divisors of 2" in " ".join(result.output.split())


HEAD_SCALED = """
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(32, 96)
        self.scale = nn.Parameter(torch.ones(8))
        self.o = nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.how == "weight":
            q = q * self.scale
        elif self.how == "derived":
            q = q * self.scale.exp().view(1, 1, 1, -1)
        else:  # a gate from the residual stream, broadcast over the heads
            q = q * torch.sigmoid(x.mean(-1)).view(b, 1, s, 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, -1))


def build_model(how="weight"):
    return nn.Sequential(nn.Linear(16, 32), Attention(how), Attention(how), nn.Linear(32, 16))


def example_inputs(batch_size=2, **_):
    return (torch.randn(batch_size, 8, 16),)


def loss_fn(output, x):
    return output.pow(2).mean()
"""


@pytest.mark.parametrize("how", ["weight", "derived", "stream"])
def test_a_weight_applied_alike_to_every_head_has_its_gradient_summed_over_tp(tmp_path, how):
    """A weight every rank holds whole, applied to the sharded heads and broadcast over them (a learned scale over
    head_dim, used as it is or through ops of its own: `scale.exp()`): each rank's backward computes its own heads'
    share of its gradient, which the run sums over tp (plan.json tp_summed, TP_SUMMED). A factor computed from the
    residual stream would send each rank's heads' share of its gradient into the stream, which no sum of
    weights' gradients mends: that projection pair stays replicated, with the reason."""
    model = tmp_path / "head_scaled.py"
    model.write_text(HEAD_SCALED)
    out = tmp_path / "out"
    args = ["plan", str(model), "--model-arg", f"how={how!r}", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2",
            "--global-batch-size", "4", "--tp", "2", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    if how == "stream":
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert "1.qkv is not sharded: mul combines it with" in text, text
        assert "computed from the block's input (the stream its projections read), whose gradient" in text, text
        return
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp_summed"] == ["1.scale", "2.scale"] and plan["schema_minor"] == 7
    assert plan["tp_plan"]["1.qkv"] == "colwise" and plan["tp_plan"]["2.o"] == "rowwise"
    assert 'TP_SUMMED = ["1.scale", "2.scale"]' in (out / "train.py").read_text()


def test_a_plan_summing_a_weight_the_model_lacks_or_tp_shards_is_refused_naming_it(tmp_path):
    """A hand-edited TP_SUMMED: a name that is no parameter of the model, or a weight of a module TP_PLAN shards
    (its gradient would be summed twice, or the wrong one), is refused at plan time (and by the run's apply_tp)."""
    from planner.plan import load_plan

    out = tmp_path / "out"
    args = ["plan", str(SLICED_QKV), "--model-arg", "variant='head_scale'", "--gpu", "cpu", "--nodes", "1",
            "--gpus-per-node", "2", "--global-batch-size", "4", "--tp", "2", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert check_plan_runs(plan)
    for name, why in (("blocks.0.gain", "not a parameter of the model"), ("blocks.0.qkv.weight", "TP_PLAN shards")):
        bad = plan.model_copy(update={"tp": dataclasses.replace(plan.tp, summed=[*plan.tp.summed, name])})
        with pytest.raises(PlanError, match=why):
            check_plan_runs(bad)


FALCON = """
import torch
from transformers import FalconConfig, FalconForCausalLM


def build_model():
    return FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256))


def example_inputs(batch_size=2):
    return (torch.randint(0, 256, (batch_size, 16)),)
"""


def test_falcon_plans_under_tp_with_its_linear_subclass_paired_and_its_in_place_output_copied(tmp_path):
    """Falcon's projections are FalconLinear (nn.Linear with a forward of its own, `x @ weight.T`): kept as Linear
    calls (runtime.linears), its MLP is a pair; `mlp_output += attention_output` changes the row-parallel output
    in place, which the plan gives as a copy (TP_COPIED), and the plan-time check runs it so. Its multi-query
    fused query_key_value (one k/v head) stays replicated, with the reason."""
    pytest.importorskip("transformers")
    path = tmp_path / "falcon.py"
    path.write_text(FALCON)
    out = tmp_path / "out"
    args = ["plan", str(path), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "4",
            "--tp", "2", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp_plan"]["transformer.h.1.mlp.dense_h_to_4h"] == "colwise"
    assert plan["tp_copied"] == ["transformer.h.0.mlp.dense_4h_to_h", "transformer.h.1.mlp.dense_4h_to_h"]
    qkv = "transformer.h.0.self_attention.query_key_value is not sharded: split takes groups of [4, 1, 1] heads"
    assert any(r.startswith(qkv) and "a single key/value head (multi-query attention)" in r for r in plan["tp_refused"])


REFUSED_SHARD_QUIETLY = """
import dataclasses
import sys
import torch._dynamo  # as transformers imports it: DTensor would then propagate shapes under a FakeTensorMode
from e2e.plans import make_plan
from planner.codegen.check import check_plan_runs
from planner.errors import PlanError
plan = make_plan("mlp", pp=1)
plan = plan.model_copy(update={
    "model": plan.model.model_copy(update={"path": sys.argv[1], "loss_fn": "loss_fn"}),
    "parallel": plan.parallel.model_copy(update={"tp": 2}),
    "tp": dataclasses.replace(plan.tp, styles={
        f"blocks.{i}.{m}": s for i in range(2) for m, s in (("qkv", "colwise"), ("o", "rowwise"))
    }),
    "cluster": plan.cluster.model_copy(update={"gpus_per_node": 2}),
    "stages": [s.model_copy(update={"modules": ["blocks.0", "blocks.1"], "units": ["blocks.0", "blocks.1"]})
               for s in plan.stages],
})
try:
    check_plan_runs(plan)
except PlanError as e:
    print("refused:", e)
"""


def test_a_refused_shard_leaves_one_message_even_where_dynamo_is_imported():
    """With torch._dynamo imported (any Hugging Face model imports it), DTensor's shape propagation ran under a
    FakeTensorMode, which logs each failing op with a traceback on stderr: a refused TP shard (and `planner
    plan` moving on to a runner-up) printed torch's traceback around the planner's message."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", REFUSED_SHARD_QUIETLY, str(SLICED_QKV)], env=env, cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: The plan cannot run: The model sharded for tp 2" in done.stdout
    assert "Traceback" not in done.stderr and "fake_tensor" not in done.stderr, done.stderr[-2000:]


# (pp, sequence parallelism): the model as written, and a traced graph (sequence parallelism, a pipeline).
SHARD_LAYOUTS = {"module": (1, False), "sp": (1, True), "pp2": (2, False), "pp2_sp": (2, True)}


@pytest.mark.parametrize("layout", list(SHARD_LAYOUTS))
def test_a_tp_plan_whose_shard_cannot_run_is_refused_and_leaves_no_process_group(tmp_path, layout):
    """A plan that shards a projection sliced at fixed offsets without its chunks' widths (TP_FUSED; an older
    planner, an edited plan.json), so that each rank's slices take the wrong columns, is refused by tp rank 0's
    sharded run on meta, with the shape error the launch would hit, with or without a pipeline and sequence
    parallelism; the fake process group is gone afterwards, pass or fail."""
    import torch.distributed as dist

    path = SLICED_QKV
    pp, sp = SHARD_LAYOUTS[layout]
    plan = make_plan("mlp", pp=pp)
    plan = plan.model_copy(update={
        "model": plan.model.model_copy(update={"path": str(path), "loss_fn": "loss_fn"}),
        "parallel": plan.parallel.model_copy(update={"tp": 2, "sequence_parallel": sp}),
        "tp": dataclasses.replace(plan.tp, styles={
            f"blocks.{i}.{m}": style for i in range(2) for m, style in (("qkv", "colwise"), ("o", "rowwise"))
        }),
        "cluster": plan.cluster.model_copy(update={"gpus_per_node": 2 * pp}),
    })
    split = [["blocks.0", "blocks.1"]] if pp == 1 else [["blocks.0"], ["blocks.1"]]
    plan = plan.model_copy(update={"stages": [
        s.model_copy(update={"modules": m, "units": m}) for s, m in zip(plan.stages, split, strict=True)
    ]})
    with pytest.raises(LayoutRefusedError, match=r"sharded for tp 2 \(rank 0's shard, TP_PLAN applied\)"):
        check_plan_runs(plan)
    assert not dist.is_initialized()
    o_only = plan.model_copy(update={"tp": TPPlan(styles={f"blocks.{i}.o": "rowwise" for i in range(2)})})
    # o alone row-parallel: its input is whole, not split (the sharded run fails); with sequence parallelism
    # qkv, no TP Linear now, runs on sequence slices, gathered where the heads' reshape cannot follow them, and
    # the sharded run fails the same way
    with pytest.raises(PlanError, match="sharded for tp 2"):
        check_plan_runs(o_only)
    assert not dist.is_initialized()
    whole = plan.model_copy(update={"tp": TPPlan(), "parallel": plan.parallel.model_copy(update={"tp": 1})})
    check_plan_runs(whole)


@pytest.mark.parametrize("sp", [False, True])
def test_a_sharded_pipeline_of_the_sample_gpt_passes(sp):
    import torch.distributed as dist

    assert check_plan_runs(make_plan("gpt", tp=2, pp=2, sequence_parallel=sp)) == "fx"
    assert not dist.is_initialized()


def test_a_sharded_zero_bubble_pipeline_checks_its_stages_as_written_on_a_copy_of_the_graph(monkeypatch):
    """Zero-bubble's split backward runs on the stages as written, after the TP stages changed the model and
    rewrote the graph: the check takes a copy of the graph made before (stages.GraphCopy), not a second trace."""
    import planner.runtime.check as runtime_check

    traced: list[int] = []
    trace_for_plan = runtime_check.trace_for_plan
    monkeypatch.setattr(
        runtime_check, "trace_for_plan", lambda *a, **k: (traced.append(1), trace_for_plan(*a, **k))[1]
    )
    split: list[int] = []
    split_backward = runtime_check._split_backward
    monkeypatch.setattr(runtime_check, "_split_backward", lambda *a: (split.append(1), split_backward(*a))[1])
    plan = make_plan("gpt", tp=2, pp=2, virtual_stages=2, schedule="zero-bubble", num_micro_batches=4)
    assert check_plan_runs(plan) == "fx"
    assert traced == [1] and split == [1]


def _runs(monkeypatch) -> list[int]:
    """Record the owner of each piece the check runs."""
    from torch import fx

    runs: list[str] = []
    call = fx.GraphModule.__call__

    def counted(self, *values):
        runs.append(next(n.target for n in self.graph.nodes if n.op == "call_module"))
        return call(self, *values)

    monkeypatch.setattr(fx.GraphModule, "__call__", counted)
    return runs


@pytest.mark.parametrize("pp", [2, 3, 6])
def test_identical_blocks_run_once(tmp_path, monkeypatch, pp):
    """Pieces of identical blocks given inputs of the same shapes run once, within a stage and across
    stages: proj_in, blocks.0 (blocks.1-3 reuse its outputs), norm, head; the backward runs through them."""
    runs = _runs(monkeypatch)
    assert check_plan_runs(_plan(tmp_path, pp=pp)) == "fx"
    assert runs == ["proj_in", "blocks.0", "norm", "head"]


def test_a_stage_differing_only_in_its_module_still_runs(tmp_path, monkeypatch):
    """blocks.2 has the graph and input shapes of blocks.1 but a narrower Linear (64 -> 32): it runs, and so
    does blocks.3, fed 32 features; only blocks.1 reuses blocks.0's outputs."""
    runs = _runs(monkeypatch)
    path = tmp_path / "net.py"
    text = MODEL.replace(
        "nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])",
        "nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 64)])",
    )
    path.write_text(text.format(broken=False, loss="output.mean()"))
    plan = make_plan("mlp", pp=6)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(path)})})
    assert check_plan_runs(plan) == "fx"
    assert runs == ["proj_in", "blocks.0", "blocks.2", "blocks.3", "norm", "head"]


BIG = '''
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


class Net(nn.Module):
    """268M parameters (checked on meta, too large for the CPU rerun); forward branches on values."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, 8192)
        self.blocks = nn.ModuleList([nn.Linear(8192, 8192) for _ in range(4)])
        self.norm = nn.LayerNorm(8192)
        self.head = nn.Linear(8192, 1)

    def forward(self, x):
        h = self.proj_in(x)
        if {guard}bool((x[:, -1] == 0).all()):  # a data-dependent branch, as HF's packed-sequence check
            h = h * 2
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 16),)
'''


@pytest.mark.parametrize("guarded", [True, False])
def test_a_large_model_branching_on_values_only_outside_tracing_passes(tmp_path, guarded):
    """Hugging Face models call .item() in forward unless they are being traced (`is_tracing`): on plain meta
    tensors that fails, yet the model runs on the cluster; the check reruns it on fake tensors (what
    torch.export traces with). A model that branches on values even while traced is still refused."""
    path = tmp_path / "big.py"
    path.write_text(BIG.format(guard="not isinstance(x, FakeTensor) and " if guarded else ""))
    plan = make_plan("mlp", dp=1)
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(path), "loss_fn": None})})
    if guarded:
        assert check_plan_runs(plan) == "module"
    else:
        with pytest.raises(PlanError, match="fails on the meta device"):
            check_plan_runs(plan)


RECOMPUTED = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        if {once} and self.calls > 1:
            raise RuntimeError("this block cannot run twice")
        return self.lin(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, 64)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        # Reads a child module's attribute, as HF ViT does (embeddings.patch_embeddings.projection.weight).
        h = self.proj_in(x).to(self.blocks[0].lin.weight.dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 16),)


def loss_fn(output, x):
    return output.mean()
'''


def _recomputed_plan(tmp_path, once: bool, recompute: str):
    path = tmp_path / "recomputed.py"
    path.write_text(RECOMPUTED.format(once=once))
    plan = make_plan("mlp", dp=2, recompute=recompute)
    return plan.model_copy(update={"model": plan.model.model_copy(update={"path": str(path)})})


@pytest.mark.parametrize("recompute", ["full", "selective", "op"])
def test_checkpointed_units_stay_the_models_own_modules(tmp_path, recompute):
    """Activation checkpointing runs each unit's own forward under checkpoint, in place: the model's own
    attribute reads of a checkpointed child keep working, and the unit keeps its type."""
    from planner.runtime.recompute import apply_ac
    from planner.runtime.stages import ModelStage

    assert check_plan_runs(_recomputed_plan(tmp_path, once=False, recompute=recompute)) == "module"
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    apply_ac(ModelStage(model, ["0", "2"]), recompute, "1f1b")
    assert type(model[0]) is nn.Linear and [n for n, _ in model.named_parameters()][0] == "0.weight"
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert model[0].weight.grad is not None


def test_the_check_recomputes_as_the_run_does(tmp_path):
    """A block that cannot run twice passes without recomputation and is refused with it: the check applies
    the run's checkpointing, whose backward runs the block again."""
    assert check_plan_runs(_recomputed_plan(tmp_path, once=True, recompute="none")) == "module"
    with pytest.raises(PlanError, match="cannot run twice"):
        check_plan_runs(_recomputed_plan(tmp_path, once=True, recompute="full"))


def test_a_graph_with_integer_histc_is_refused_for_cpu_runs_only():
    """transformers' MoE experts pick histc's dtype from the device: traced on meta, the graph holds the
    GPU's int32 histc, which the CPU lacks; a pipeline on CPU ranks is refused with that reason."""
    from planner.runtime.stages import trace, unsupported_on

    class Counts(nn.Module):
        def forward(self, x):
            ids = x.argmax(-1)
            counts = torch.histc(ids.int() if ids.device.type != "cpu" else ids.float(), bins=4, min=0, max=3)
            return x * counts.sum()

    gm, values, _ = trace(Counts(), (torch.randn(2, 4, device="meta"),))
    why = unsupported_on(gm, values, "cpu")
    assert why is not None and "torch.histc on torch.int32" in why
    assert unsupported_on(gm, values, "cuda") is None
    gm, values, _ = trace(Counts(), (torch.randn(2, 4),))
    assert unsupported_on(gm, values, "cpu") is None


GROUPED = '''
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


class Net(nn.Module):
    """67M parameters (checked on meta); HF's packed-sequence branch outside tracing, and experts run by
    torch._grouped_mm, whose meta kernel (the GPU's path, as transformers' MoE takes off the CPU) takes bf16."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, 8192)
        self.big = nn.Linear(8192, 8192)
        self.down = nn.Linear(8192, 64)
        self.experts = nn.Parameter(torch.randn(4, 64, 64))
        self.register_buffer("scale", torch.ones(64))  # buffers stay fp32 under mixed precision
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.down(self.big(self.proj_in(x.to(self.proj_in.weight.dtype))))
        if not isinstance(x, FakeTensor) and bool((x[:, -1] == 0).all()):
            h = h * 2
        assert self.scale.dtype == torch.float32
        offs = torch.full((4,), h.shape[0], dtype=torch.int32, device=h.device)
        h = torch._grouped_mm(h, self.experts, offs=offs)
        return self.head(h)


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 16),)
'''


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_large_model_is_checked_in_the_dtype_the_gpus_compute_in(tmp_path, dtype):
    """Mixtral-8x7B's experts call torch._grouped_mm on GPUs, which takes bf16 only: the run's mixed precision
    casts the weights to bf16, so the check on fake tensors casts them as well (buffers stay fp32). An fp32 run
    would fail there, and is refused."""
    path = tmp_path / "grouped.py"
    path.write_text(GROUPED)
    plan = make_plan("mlp", dp=1, gpu="h100-sxm-80gb")
    plan = plan.model_copy(
        update={
            "model": plan.model.model_copy(update={"path": str(path), "loss_fn": None, "dtype": dtype}),
            "training": plan.training.model_copy(update={"dtype": dtype}),
        }
    )
    if dtype == "bf16":
        assert check_plan_runs(plan) == "module"
    else:
        with pytest.raises(PlanError, match="fails on the meta device"):
            check_plan_runs(plan)


def test_fake_run_casts_the_models_float_inputs_as_fsdp_mixed_precision_does() -> None:
    """bf16 weights and an fp32 input into a convolution (Whisper's mel features): FSDP2 casts the forward's
    inputs to bf16, so the check's fake run does too (it failed: input float, bias bf16)."""
    from typing import Any, cast

    from planner.runtime.check import CheckCase, _runs_on_fake_tensors
    from planner.runtime.layout import Training
    from planner.runtime.stages import ModelStage

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.GELU())
    example = (torch.randn(2, 4, 16), torch.randn(2, 8, 16))

    def loss(out: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out.float() - target).pow(2).mean()

    stage = ModelStage(model, ["0", "1"])
    none = cast(Any, None)  # what the fake run does not read
    case = CheckCase(none, none, Training(dtype="bf16"), None, example, 1, loss)
    assert _runs_on_fake_tensors(case, stage) is not None  # None: it did not run


IN_PLACE_MODEL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        out = self.down(torch.relu(self.up(x)))
        out += x  # the residual added in place into the row-parallel output
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x)


def build_model(**_):
    return Net()


def example_inputs(batch_size, **_):
    return (torch.randn(batch_size, 16),)


def loss_fn(output, x):
    return output.float().pow(2).mean()
"""


def test_a_residual_added_in_place_into_a_row_parallel_output_is_copied_and_without_the_copy_refused(tmp_path):
    # torch's RowwiseParallel hands its output over as DTensor.to_local's view; `out += x` on it is an autograd
    # error deep in torch. The analysis finds the write (TP_COPIED: the output given as a copy); where a write
    # escaped it, the check names the model's line and the fix.
    from planner.codegen.check import check_plan_runs
    from planner.errors import PlanError
    from planner.plan import load_plan

    result, out = _plan_source(tmp_path, IN_PLACE_MODEL, "--tp", "2")
    assert result.exit_code == 0, result.output
    path = tmp_path / "net.py"
    plan = load_plan(out)
    assert plan.tp.copied == ["blocks.0.down", "blocks.1.down"]
    uncopied = plan.model_copy(update={"tp": dataclasses.replace(plan.tp, copied=[])})
    with pytest.raises(PlanError) as e:
        check_plan_runs(uncopied)
    text = " ".join(str(e.value).split())
    assert "changes a tensor-parallel Linear's output in place at" in text, text
    line = next(i for i, row in enumerate(IN_PLACE_MODEL.splitlines(), 1) if "out += x" in row)
    assert f"{path}:{line} " in text
    assert "out = out + residual" in text


def test_the_tp_check_shards_the_first_block_of_each_kind_and_runs_it_for_the_repeats():
    """On fake tensors each kind of block runs once (repeats.blocks_once), so the check shards only the first of
    each kind (parallelize_module of Llama-3-70B's 560 projections took 0.3 s of a 0.8 s check); the TP rules
    still read every module, and the first block's sharded run stands for its repeats."""
    from torch.distributed.tensor import DTensor

    from planner.codegen.check import CheckInputs
    from planner.runtime.check import _fake_tp_mesh
    from planner.runtime.model import build_model, load_model_file
    from planner.runtime.parallel import apply_tp
    from planner.runtime.repeats import repeated_units, unit_kinds
    from planner.runtime.stages import ModelStage

    plan = make_plan("gpt", tp=2)
    assert plan.tp.styles
    inputs = CheckInputs.of(plan)
    model = build_model(load_model_file(inputs.spec.path), inputs.spec, 0, everything_on_meta=True)
    stage = ModelStage(model, list(inputs.layout.stages[0].modules))
    kinds = unit_kinds(stage)
    skip = repeated_units(stage, kinds)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    assert skip == frozenset(blocks[1:]) and len(blocks) > 1
    with _fake_tp_mesh(2) as mesh:
        apply_tp(stage, mesh, inputs.layout, {}, skip=skip)
        sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    assert any(n.startswith("blocks.0.") for n in sharded)
    assert not any(n.startswith(tuple(f"{b}." for b in blocks[1:])) for n in sharded)
    check_plan_runs(plan)  # and the check passes with it


def test_a_repeated_unit_holding_a_tied_weight_is_sharded_with_its_partner(tmp_path):
    """BART's encoder and decoder embeddings are alike units, both tied to model.shared: the TP check shards the
    first block of each kind only, but a unit holding a tied weight is sharded whatever it repeats, since its
    split must follow its partner's (mBART tp2 x dp2 was refused for it)."""
    pytest.importorskip("transformers")
    models = Path(__file__).parent / "fixtures" / "models"
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "plan", str(models / "hf_tiny.py"), "--model-arg", "arch='bart'", "--gpu", "cpu", "--nodes", "1",
        "--gpus-per-node", "2", "--global-batch-size", "4", "--tp", "2", "--out", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp_plan"].get("model.shared") == "rowwise"


LARGE_TP = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4096, 8192)
        self.down = nn.Linear(8192, 4096)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        if {once} and self.calls > 1:
            raise RuntimeError("this block cannot run twice")
        u = self.up(h)
        if {fixed}:
            u = u.view(u.shape[0], 8192)  # the unsharded width, fixed: tp rank 0's half cannot take it
        return h + self.down(torch.relu(u))


class Net(nn.Module):
    """268M parameters: checked on meta, above the check's SMALL."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(16, 4096)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(4096, 1)

    def forward(self, x):
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 16),)


def loss_fn(output, x):
    return {loss}
'''


def _large_tp_plan(tmp_path, once=False, fixed=False, loss="output.mean()", recompute="none"):
    path = tmp_path / f"large_tp_{once}_{fixed}_{loss.replace('.', '_').replace('()', '')}_{recompute}.py"
    path.write_text(LARGE_TP.format(once=once, fixed=fixed, loss=loss))
    plan = make_plan("mlp", recompute=recompute)
    modules = ["proj_in", *(f"blocks.{i}" for i in range(4)), "head"]
    return plan.model_copy(update={
        "model": plan.model.model_copy(update={"path": str(path), "loss_fn": "loss_fn"}),
        "parallel": plan.parallel.model_copy(update={"tp": 2}),
        "tp": dataclasses.replace(plan.tp, styles={
            f"blocks.{i}.{m}": style for i in range(4) for m, style in (("up", "colwise"), ("down", "rowwise"))
        }),
        "cluster": plan.cluster.model_copy(update={"gpus_per_node": 2}),
        "stages": [plan.stages[0].model_copy(update={"modules": modules, "units": modules})],
    })


def test_a_large_model_under_tp_is_checked_by_its_shard_alone_and_a_failure_still_told_apart(tmp_path, monkeypatch):
    """A large model (above SMALL) under TP without a pipeline: the run runs tp rank 0's shard, and nothing else
    of the check's looks at that size, so the shard's run (checkpointed as the run checkpoints it) is the whole
    check; the model as written runs only where the shard fails, to tell a model that fails as written (the plan
    cannot run: PlanError) from a layout it cannot take (LayoutRefusedError: a runner-up may run)."""
    import planner.runtime.check as runtime_check

    as_written: list[object] = []
    run_model = runtime_check._run_model
    monkeypatch.setattr(runtime_check, "_run_model", lambda *a: as_written.append(a) or run_model(*a))
    assert check_plan_runs(_large_tp_plan(tmp_path)) == "module"
    assert check_plan_runs(_large_tp_plan(tmp_path, once=True)) == "module"
    assert as_written == []
    with pytest.raises(LayoutRefusedError, match=r"sharded for tp 2 \(rank 0's shard, TP_PLAN applied\)"):
        check_plan_runs(_large_tp_plan(tmp_path, fixed=True))
    assert len(as_written) == 1
    # failing as written: under the run's recomputation (a block that cannot run twice), or its loss
    for plan, error in [
        (_large_tp_plan(tmp_path, once=True, recompute="full"), "cannot run twice"),
        (_large_tp_plan(tmp_path, loss="output"), "floating-point scalar"),
    ]:
        with pytest.raises(PlanError, match=error) as failed:
            check_plan_runs(plan)
        assert not isinstance(failed.value, LayoutRefusedError)
    assert len(as_written) == 3
