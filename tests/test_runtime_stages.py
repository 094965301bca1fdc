"""planner.runtime.stages, called in-process: ownership of graph nodes, cutting a traced graph into the
plan's stages, and the pieces computing exactly the model's forward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e.plans import TINY, make_plan
from torch import fx, nn

from planner.codegen.render import runtime_objects
from planner.runtime import Layout, RunError
from planner.runtime.layout import ModelFile
from planner.runtime.model import build_model, load_model_file, make_batch, materialise
from planner.runtime.stages import (
    ModelStage,
    StageModule,
    build_local_stages,
    called_units,
    cut_into_pieces,
    fetch,
    module_paths,
    owner_of,
    shared_weights,
    trace,
    used_modules,
    with_structure,
)
from planner.runtime.tied import TiedWeights, own_copies

CPU = torch.device("cpu")


class Tiny(nn.Module):
    """embed -> two blocks -> head, with module-less code between (a residual add, a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h * 0.5)


def _layout(stages):
    pp = len(stages)
    return Layout(pp=pp, dp=1, tp=1, micro_batch_size=2, num_micro_batches=1,
                  stages=[(i, mods, "none") for i, mods in enumerate(stages)])


def test_a_node_belongs_to_the_outermost_planned_module():
    stage_of = {"blocks.0": 0, "blocks": 1, "head": 1}
    assert owner_of("blocks.1.attn.q", stage_of) == "blocks"
    assert owner_of("blocks.0", {"blocks.0": 0}) == "blocks.0"
    assert owner_of("embed", stage_of) is None
    gm = fx.symbolic_trace(Tiny())
    calls = {n.target: module_paths(n) for n in gm.graph.nodes if n.op == "call_module"}
    assert calls["blocks.1"] == ["blocks.1"] and calls["head"] == ["head"]


def test_a_tiny_graph_is_cut_into_stages_that_compute_the_forward():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 4)
    gm, values, method = trace(model, x)
    assert method == "fx" and any(isinstance(v, torch.Tensor) for v in values.values())
    layout = _layout([["embed", "blocks.0"], ["blocks.1", "head"]])
    pieces = cut_into_pieces(gm, values, layout)
    assert [(p.stage, p.owner) for p in pieces] == [(0, "embed"), (0, "blocks.0"), (1, "blocks.1"), (1, "head")]
    # Stage 1's first piece receives only the residual stream, stage 0's last piece sends only it.
    first_of_1 = [n for n in pieces[2].graph.nodes if n.op == "placeholder"]
    assert len(first_of_1) == 1
    assert used_modules(model, [p.graph for p in pieces if p.stage == 1]) == {"blocks.1", "head"}
    out = (x,)
    for stage in (0, 1):
        mine = [p for p in pieces if p.stage == stage]
        graphs = [
            fx.GraphModule({n.target: fetch(model, gm, n.target, CPU) for n in p.graph.nodes
                            if n.op in ("get_attr", "call_module")}, p.graph)
            for p in mine
        ]
        out = StageModule(graphs, [p.owner for p in mine])(*out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_stages_out_of_execution_order_are_refused():
    gm, values, _ = trace(Tiny(), torch.randn(2, 4))
    with pytest.raises(RunError, match="must follow the model's execution order"):
        cut_into_pieces(gm, values, _layout([["head", "blocks.0"], ["embed", "blocks.1"]]))


def test_a_stage_without_work_is_refused():
    gm, values, _ = trace(Tiny(), torch.randn(2, 4))
    with pytest.raises(RunError, match=r"Stages \[1\] run no part of the model"):
        cut_into_pieces(gm, values, _layout([["embed", "blocks", "head"], ["nothing"]]))


CUTS = {
    "gpt_pp2": lambda: make_plan("gpt", pp=2),
    "llama_4_stages": lambda: make_plan("llama", pp=2, virtual_stages=2, schedule="interleaved-1f1b"),
    "mlp_zbv": lambda: make_plan("mlp", pp=2, virtual_stages=2, schedule="zero-bubble"),
    "tiny_pp3": lambda: make_plan("tiny", pp=3),
    "tiny_export": lambda: make_plan("tiny", pp=2, model_args={**TINY["tiny"], "check_length": True}),
    "tiny_tied": lambda: make_plan("tiny", model_args={**TINY["tiny"], "tie": True}),
}


@pytest.mark.parametrize("name", sorted(CUTS))
def test_pieces_compute_the_models_forward(name):
    plan = CUTS[name]()
    layout, spec, training = runtime_objects(plan)
    user = load_model_file(spec.path)
    example = make_batch(user, spec, layout, training.seed, 0, 0)
    meta_model = build_model(user, spec, training.seed, everything_on_meta=True)
    gm, values, method = trace(meta_model, example[0].to("meta"))
    assert method == ("export" if name == "tiny_export" else "fx")
    pieces = cut_into_pieces(gm, values, layout)
    assert sorted({p.stage for p in pieces}) == list(range(len(plan.stages)))

    model = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(model, {n for n, _ in model.named_modules()}, CPU, training.seed)
    assert not any(p.is_meta for p in model.parameters())
    if name == "tiny_tied":
        assert model.head.weight is model.tok_emb.weight
    values_in = (example[0],)
    for i in range(len(plan.stages)):
        mine = [p for p in pieces if p.stage == i]
        modules = []
        for p in mine:
            targets = [n.target for n in p.graph.nodes if n.op in ("get_attr", "call_module")]
            modules.append(fx.GraphModule({t: fetch(model, gm, t, CPU) for t in targets}, p.graph))
        out = StageModule(modules, [p.owner for p in mine])(*values_in)
        if i < len(plan.stages) - 1:
            assert isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
            values_in = out
    with torch.no_grad():
        expected = model(example[0])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_tied_weights_are_found_and_each_copy_starts_equal():
    layout, spec, training = runtime_objects(make_plan("tiny", pp=2, model_args={**TINY["tiny"], "tie": True}))
    user = load_model_file(spec.path)
    example = make_batch(user, spec, layout, training.seed, 0, 0)
    gm, values, _ = trace(build_model(user, spec, training.seed, everything_on_meta=True), example[0].to("meta"))
    pieces = cut_into_pieces(gm, values, layout)
    assert shared_weights(gm, pieces) == {"tok_emb.weight": [0, 1]}
    # The last stage's rank materialises only head (and, for the tied weight, its first holder tok_emb):
    # the copy equals the whole model's, whatever head.reset_parameters() would draw.
    whole = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(whole, {n for n, _ in whole.named_modules()}, CPU, training.seed)
    last = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(last, used_modules(last, [p.graph for p in pieces if p.stage == 1]), CPU, training.seed)
    torch.testing.assert_close(last.head.weight, whole.tok_emb.weight, rtol=0, atol=0)
    fresh = build_model(user, spec, training.seed, everything_on_meta=False)
    materialise(fresh, {"tok_emb"}, CPU, training.seed)
    torch.testing.assert_close(fresh.tok_emb.weight, whole.tok_emb.weight, rtol=0, atol=0)
    # Every holder of the tied weight holds the one allocated tensor, whichever module was asked for: the
    # gradient sum finds this rank's copy under any of its names (T5's holders outside the stage stayed on meta
    # and pp2 x dp2 deadlocked in that sum).
    assert last.tok_emb.weight is last.head.weight and not last.head.weight.is_meta
    assert fresh.head.weight is fresh.tok_emb.weight


def test_two_stages_of_one_rank_get_a_copy_each_of_a_tied_weight_and_its_gradient_sum():
    """ZBV puts the first and last stage (the tied embedding and head) on pp rank 0: the later stage gets its
    own copy (the pipeline schedule divides each stage's gradients, FSDP shards each stage), equal in value;
    the model and the first stage keep the one weight; the sum gives each copy the gradient of both uses."""
    plan = make_plan("tiny", pp=2, virtual_stages=2, schedule="zero-bubble", model_args={**TINY["tiny"], "tie": True})
    layout, spec, training = runtime_objects(plan)
    user = load_model_file(spec.path)
    example = make_batch(user, spec, layout, training.seed, 0, 0)
    gm, values, _ = trace(build_model(user, spec, training.seed, everything_on_meta=True), example[0].to("meta"))
    pieces = cut_into_pieces(gm, values, layout)
    shared = shared_weights(gm, pieces)
    assert shared == {"tok_emb.weight": [0, 3]} and layout.stages_on(0) == [0, 3]
    local = layout.stages_on(0)
    stages, model = build_local_stages(user, spec, training.seed, gm, pieces, local, CPU)
    weight = model.tok_emb.weight
    copies = own_copies(shared, model, stages, local)
    twin = copies[3][id(weight)]
    assert list(copies) == [3] and twin is not weight
    torch.testing.assert_close(twin, weight, rtol=0, atol=0)
    held = {s: [p for p in stage.parameters() if p is weight or p is twin] for s, stage in zip(local, stages)}
    assert [p is weight for p in held[0]] == [True] and [p is twin for p in held[3]] == [True]
    assert model.head.weight is weight and model.tok_emb.weight is weight  # the model itself is left as it was
    tied = TiedWeights(shared, layout, None, model, stages, local, copies)  # one rank: no group, no mesh
    assert tied.later_copies() == {id(twin)}
    weight.grad, twin.grad = torch.full_like(weight, 1.0), torch.full_like(twin, 2.0)
    tied.sum_gradients()
    assert torch.equal(weight.grad, torch.full_like(weight, 3.0)) and torch.equal(twin.grad, weight.grad)


class TwoInputs(nn.Module):
    """forward(x, mask) returning a dict: a second (integer) input used after the stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"logits": self.b(h) * mask.unsqueeze(-1), "hidden": h}


@pytest.mark.parametrize("exported", [False, True])
def test_extra_inputs_reach_later_stages_and_structured_outputs_come_back(exported):
    torch.manual_seed(0)
    model = TwoInputs()
    x, mask = torch.randn(3, 4), torch.tensor([1, 0, 1])
    if exported:
        gm = torch.export.export(model, (x, mask), strict=False).module()
        values = {}
        from planner.runtime.stages import ValueRecorder

        recorder = ValueRecorder(gm)
        recorder.run(x, mask)
        values = recorder.values
    else:
        gm, values, method = trace(model, (x, mask))
        assert method == "fx"
    pieces = cut_into_pieces(gm, values, _layout([["a"], ["b"]]))
    # The mask is sent along with the hidden state to stage 1, which uses it.
    assert len([n for n in pieces[1].graph.nodes if n.op == "placeholder"]) == 2
    out = (x, mask)
    for stage in (0, 1):
        mine = [p for p in pieces if p.stage == stage]
        graphs = [
            fx.GraphModule({n.target: fetch(model, gm, n.target, CPU) for n in p.graph.nodes
                            if n.op in ("get_attr", "call_module")}, p.graph)
            for p in mine
        ]
        out = StageModule(graphs, [p.owner for p in mine])(*out)
    seen = []
    with_structure(lambda output, *inputs: seen.append(output) or torch.zeros(()), pieces[-1].out_spec)(out, x, mask)
    want = model(x, mask)
    assert isinstance(seen[0], dict) and set(seen[0]) == {"logits", "hidden"}
    torch.testing.assert_close(seen[0]["logits"], want["logits"], rtol=0, atol=0)


MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
# Batch-norm models of the corpus: (model file, model args, stage 0's modules, stage 1's): fx-traced (a
# top-level Sequential) and torch.export-traced (HF ResNet: batch norm mutates its buffers in the graph).
BATCH_NORM = {
    "sequential_cnn": (MODELS / "sequential_cnn.py", {}, ["0", "1", "2"], ["3", "4", "5"]),
    "hf_resnet": (
        MODELS / "hf_tiny.py", {"arch": "resnet"},
        ["resnet.embedder", "resnet.encoder.stages.0", "resnet.encoder.stages.1"],
        ["resnet.encoder.stages.2", "resnet.encoder.stages.3", "resnet.pooler", "classifier"],
    ),
}


@pytest.mark.parametrize("name", sorted(BATCH_NORM))
def test_batch_norm_running_stats_of_pipeline_stages_equal_one_process(name):
    """Each stage updates the running statistics of the modules it owns, once per micro-batch in micro-batch
    order (every schedule runs a stage's forwards in that order): with dp 1 a pipeline's buffers after
    training equal one process's over the same micro-batches, and no stage touches another stage's buffers."""
    if name == "hf_resnet":
        pytest.importorskip("transformers")
    path, args, first, second = BATCH_NORM[name]
    user = load_model_file(str(path))
    spec = ModelFile(path=str(path), model_args=args)
    layout = _layout([first, second])
    batches = [user.example_inputs(2, seed=s, **args) for s in range(3)]
    meta = build_model(user, spec, 0, everything_on_meta=True)
    gm, values, method = trace(meta, tuple(t.to("meta") for t in batches[0][:1]))
    assert method == ("fx" if name == "sequential_cnn" else "fx-meta")
    pieces = cut_into_pieces(gm, values, layout)
    # One model per stage, as on two pp ranks: each materialises only the modules its stage uses.
    built = [build_local_stages(user, spec, 0, gm, pieces, [i], CPU) for i in (0, 1)]
    whole = build_model(user, spec, 0, everything_on_meta=False)
    materialise(whole, {n for n, _ in whole.named_modules()}, CPU, 0)
    for batch in batches:
        built[1][0][0](*built[0][0][0](batch[0]))
        whole(batch[0])
    expected = dict(whole.named_buffers())
    assert all(int(v) == len(batches) for n, v in expected.items() if n.endswith("num_batches_tracked"))
    for stage, (_, model) in enumerate(built):
        checked = 0
        for bname, value in model.named_buffers():
            owner = owner_of(bname, layout.stage_of_module)
            if owner is not None and layout.stage_of_module[owner] == stage:
                torch.testing.assert_close(value, expected[bname], rtol=1e-5, atol=1e-6, msg=bname)
                checked += 1
            elif bname.endswith("num_batches_tracked"):
                assert int(value) == 0, f"stage {stage} updated {bname}, which another stage owns"
        assert checked > 0


def test_a_sending_stage_sends_contiguous_tensors():
    """Point-to-point sends need contiguous tensors; T5's encoder output reached its stage boundary as a view
    (found training T5 pp2 x dp2: `input tensor has to be contiguous` at launch)."""

    class Transposes(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.transpose(0, 1), x

    x = torch.randn(3, 4)
    assert not Transposes()(x)[0].is_contiguous()
    sent = StageModule([Transposes()], [None], sends=True)(x)
    assert all(t.is_contiguous() for t in sent)
    torch.testing.assert_close(sent[0], x.t(), rtol=0, atol=0)
    kept = StageModule([Transposes()], [None])(x)  # the last stage hands its output to the loss as it is
    assert not kept[0].is_contiguous()


class BranchesOnShape(nn.Module):
    """torch.fx cannot follow `if` on a shape, nor the trace with meta values `if` on a tensor made from a
    shape (meta tensors hold no values); torch.export (the last fallback) can: fake tensors keep constants."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if torch.tensor(x.shape[0]) > 2 else x


def test_a_fresh_process_traces_the_branch_as_any_other():
    """The trace with meta values makes factories' values on meta through a device context, which recognises
    factories from a set built on first use; in a process that had not used one before (a fresh test worker ran
    this model first) the set held the tracer's stand-ins, torch.tensor(3) came out on the CPU and the branch
    on it was read and baked in: "fx-meta" here, "export" after any other test."""
    code = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_runtime_stages import BranchesOnShape\n"
        "from planner.runtime.stages import trace\n"
        "print(trace(BranchesOnShape(), (torch.randn(3, 4),))[2])\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["export"]


def test_the_export_fallback_records_no_stack_traces_and_restores_the_setting():
    import torch.fx.config

    gm, values, method = trace(BranchesOnShape(), (torch.randn(3, 4),))
    assert method == "export"
    assert any(n.op == "call_function" for n in gm.graph.nodes)
    assert not any(n.meta.get("stack_trace") for n in gm.graph.nodes)
    assert torch.fx.config.do_not_emit_stack_traces is False


class LoopedDownsample(nn.Module):
    """ConvNeXt's stage: a downsampling ModuleList run by a loop (never called itself), then a block."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([nn.LayerNorm(4), nn.Linear(4, 8)])
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.down:
            x = layer(x)
        return self.block(x)


def test_a_planned_container_the_model_never_calls_is_wrapped_child_by_child():
    """ConvNeXt tp2 x dp2 failed at launch: FSDP's fully_shard refuses a ModuleList unit (no forward), and a
    checkpointed one would never run its checkpoint. Its children are the units instead."""
    from planner.runtime.recompute import apply_ac

    model = LoopedDownsample()
    stage = ModelStage(model, ["down", "block"])
    assert stage.units() == [model.down[0], model.down[1], model.block]
    assert called_units([model.down, model.block]) == stage.units()
    x = torch.randn(3, 4, requires_grad=True)
    want = model(x)
    apply_ac(stage, "full", "1f1b")
    assert "forward" in vars(model.down[1]) and "forward" not in vars(model.down)  # the children checkpointed
    got = model(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    assert x.grad is not None and model.down[1].weight.grad is not None


def test_a_receiving_stage_returns_its_input_gradients_contiguous():
    """torch's pipelining receives a stage's input gradients into buffers of the strides it infers from the
    stage's backward on meta; ConvNeXt's blocks permute to channels-last and back, so those strides were
    permuted and gloo refused the receive (pp2 x dp2 failed at launch)."""

    class Permuting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    for receives, contiguous in ((False, False), (True, True)):
        stage = StageModule([Permuting()], ["p"], receives=receives)
        x = torch.randn(2, 4, 3, 3, requires_grad=True)
        out = stage(x)
        (grad,) = torch.autograd.grad(out.sum(), x)  # as the pipeline's backward computes input gradients
        assert grad.is_contiguous() == contiguous


def test_a_trace_made_ahead_stands_for_one_whose_extra_leaves_fx_keeps_as_calls_anyway():
    """The check worker's trace (no leaves) is reused by a TP plan's check, which names the TP plan's modules as
    leaves: an nn.Linear is one call either way, so the graph is the same; a module fx would trace through is not."""
    from planner.runtime.stages import Traced, trace

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    model = Net().to("meta")
    inputs = (torch.empty(2, 4, device="meta"),)
    ahead = Traced(model, inputs, frozenset(), trace(model, inputs))
    reused = ahead.reuse(model, inputs, frozenset({"head", "block.fc"}))
    assert reused is not None and reused[0] is ahead.gm
    assert ahead.reuse(model, inputs, frozenset({"block"})) is None  # Block kept as a call: another graph
    kept = trace(model, inputs, leaves=frozenset({"block"}))[0]
    assert [n.target for n in kept.graph.nodes if n.op == "call_module"] == ["block", "head"]


class WithRotaryTable(nn.Module):
    """A block reading a buffer the model keeps out of its state dict (transformers' rotary inv_freq) and one it
    keeps (a running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.register_buffer("table", torch.ones(4), persistent=False)
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x * self.table + self.stat)
        return x


def test_a_pieces_buffers_are_as_persistent_as_the_models():
    """fx registers every tensor a get_attr reads as a persistent buffer: a traced stage's checkpoint then held a
    buffer the model as written leaves out (a Hugging Face rotary table), and a resume under another layout was
    refused for it. The piece keeps the model's persistence."""
    from planner.runtime.stages import piece_module

    model = WithRotaryTable()
    x = torch.randn(2, 4)
    gm, values, _ = trace(model, x)
    pieces = cut_into_pieces(gm, values, _layout([["blocks.0"], ["blocks.1"]]))
    held = set()
    for p in pieces:
        held |= set(piece_module(p, model, gm, CPU).state_dict())
    assert "stat" in held and "table" not in held
    assert set(model.state_dict()) >= held
