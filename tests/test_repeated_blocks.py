"""Each distinct block once (issue 27): the analysis traces one block of each kind and replays its nodes for the
others (planner.runtime.tracers.RepeatedBlocks), and the plan-time check runs one block of each kind on meta
(planner.runtime.check.blocks_once). The replayed graph and the analysis must equal the full ones, field by
field; a block that differs (an attribute its forward reads, another input shape) is traced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import planner.model.trace as model_trace
from planner.model.analysis import analyse_model
from planner.model.load import load_model_file
from planner.runtime.repeats import blocks_once
from planner.runtime.stages import ModelStage
from planner.runtime.tracers import BufferTracer, meta_trace

MODELS = Path(__file__).resolve().parent / "fixtures" / "models"
SAMPLES = Path(__file__).resolve().parents[1] / "sample_models"


def _nodes(graph: torch.fx.Graph) -> list[tuple]:
    """Everything the analysis and the runtime read from a node."""
    return [
        (n.name, n.op, str(n.target), str(n.args), str(n.kwargs), str(dict(n.meta.get("nn_module_stack", {}))))
        for n in graph.nodes
    ]


class Block(nn.Module):
    def __init__(self, width: int, layer_idx: int, scale: float = 1.0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # an index (transformers' KV-cache slot): not part of what the block is
        self.scale = scale  # read by forward: blocks with another scale trace differently
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(self.norm(x))) * self.scale


class Stack(nn.Module):
    def __init__(self, scales: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([Block(8, i, s) for i, s in enumerate(scales)])
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0, 1.0), (1.0, 2.0, 1.0, 2.0)])
@pytest.mark.parametrize("tracer", ["fx", "fx-meta"])
def test_replayed_graph_equals_the_full_trace(tracer: str, scales: tuple[float, ...]) -> None:
    with torch.device("meta"):
        model = Stack(scales)
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    graphs, replayed = [], []
    for repeats in (False, True):
        if tracer == "fx":
            t = BufferTracer(repeats=repeats)
            graphs.append(t.trace(model))
        else:
            graphs.append(meta_trace(model, (ids,), repeats=repeats))
    assert _nodes(graphs[0]) == _nodes(graphs[1])
    assert graphs[0].python_code("self").src == graphs[1].python_code("self").src
    # The blocks are recognised as two kinds at most, however many there are (layer_idx differs in each).
    t = BufferTracer(repeats=True)
    t.trace(model)
    assert t._blocks is not None
    replayed = sorted({kind for kind in t._blocks.kinds.values()}, key=repr)
    assert len(replayed) == len(set(scales))
    assert len(t._blocks.recorded) == len(set(scales))


def test_a_block_called_with_other_shapes_is_traced() -> None:
    """The meta trace bakes shapes into the graph: a block called on another shape is not a replay."""

    class Pyramid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(8, i) for i in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                x = block(x[:, : x.shape[1] - i])
            return x.sum()

    with torch.device("meta"):
        model = Pyramid()
    x = torch.empty(2, 6, 8, device="meta")
    assert _nodes(meta_trace(model, (x,))) == _nodes(meta_trace(model, (x,), repeats=True))


# Corpus models: fx and fx-meta traces, an encoder-decoder, MoE, leaves in a ModuleList (the
# recommender's embedding tables), a ModuleDict, a top-level Sequential, sliding-window layers (Gemma-2); each with
# a stack of at least three blocks where any, so that one is folded (neither the first of its kind nor the last).
CORPUS = [
    (MODELS / "hf_tiny.py", {"arch": "llama"}),
    (MODELS / "hf_tiny.py", {"arch": "bart", "layers": 3}),
    (MODELS / "hf_tiny.py", {"arch": "vit"}),
    (MODELS / "sequential_cnn.py", {}),
    (MODELS / "hf_zoo.py", {"arch": "gemma2"}),
    (MODELS / "moduledict_llama.py", {}),
    (MODELS / "deepseek_moe.py", {"layers": 4}),
    (MODELS / "authored" / "recommender.py", {}),
    (SAMPLES / "gpt.py", {}),
]


@pytest.mark.parametrize(("path", "args"), CORPUS, ids=lambda v: v.stem if isinstance(v, Path) else str(v))
def test_analysis_with_replayed_or_folded_blocks_equals_the_full_analysis(
    path: Path, args: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block traced (no repeats), repeats replayed node for node, and repeats of the model's blocks kept as one
    call each (the analysis' default): the same ModelGraph, field by field."""
    if "hf_" in path.stem:
        pytest.importorskip("transformers")
    import planner.model.analysis as analysis
    import planner.runtime.tracers as tracers

    seen: dict[str, list[str]] = {"replay": [], "fold": []}
    replay, fold = tracers._Recording.replay, tracers._Recording.fold
    templates: list[dict[int, int] | None] = []
    fold_templates = analysis.fold_templates

    def kept(*a):  # type: ignore[no-untyped-def]
        templates.append(fold_templates(*a))
        return templates[-1]

    def replayed(self, tracer, path, args_, kwargs):  # type: ignore[no-untyped-def]
        seen["replay"].append(path)
        return replay(self, tracer, path, args_, kwargs)

    def folded(self, tracer, path, kind, args_, kwargs):  # type: ignore[no-untyped-def]
        seen["fold"].append(path)
        return fold(self, tracer, path, kind, args_, kwargs)

    monkeypatch.setattr(tracers._Recording, "replay", replayed)
    monkeypatch.setattr(tracers._Recording, "fold", folded)
    monkeypatch.setattr(analysis, "fold_templates", kept)
    graphs = []
    for repeats, folding in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(model_trace, "REPLAY_REPEATED_BLOCKS", repeats)
        monkeypatch.setattr(model_trace, "FOLD_REPEATED_BLOCKS", folding)
        graphs.append(analyse_model(load_model_file(path, args, dtype="fp32")).model_dump())
        if repeats and not folding:
            assert seen["replay"]  # blocks were replayed (the planner's own input-check hooks do not prevent it)
            assert not seen["fold"]
    if path.stem == "recommender":  # its repeated blocks are nn.Embedding tables, one call each already
        assert not seen["fold"]
    else:  # folded, each fold a unit repeating one before it (not traced again unfolded)
        assert seen["fold"]
        assert templates[-1] and set(templates[-1].values()) <= set(range(len(graphs[-1]["units"])))
    full = graphs[0]
    for other in graphs[1:]:
        assert full.keys() == other.keys()
        for field in full:
            assert full[field] == other[field], field


def test_a_folded_repeat_is_one_call_of_the_block() -> None:
    """A repeat of a block named in `fold` is one call_module node on the block's own module stack; the first block
    of its kind keeps its nodes; a block not named is replayed."""
    with torch.device("meta"):
        model = Stack((1.0, 1.0, 1.0, 1.0))
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    graph = meta_trace(model, (ids,), repeats=True, fold=frozenset({"blocks.1", "blocks.2"}))
    calls = [n for n in graph.nodes if n.op == "call_module"]
    assert [str(n.target) for n in calls if n.target.startswith("blocks.") and n.target.count(".") == 1] == [
        "blocks.1", "blocks.2"
    ]
    for n in calls:
        if n.target in ("blocks.1", "blocks.2"):
            assert list(n.meta["nn_module_stack"])[-1] == n.target
    inner = {str(n.target) for n in calls}
    assert "blocks.0.fc" in inner and "blocks.3.fc" in inner  # traced, and replayed
    assert "blocks.1.fc" not in inner and "blocks.2.fc" not in inner
    gm = torch.fx.GraphModule(model, graph)
    assert gm(ids).shape == (2, 5, 32)


_BETWEEN_BLOCKS = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, store=None):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.store = store

    def forward(self, x):
        y = torch.relu(self.fc(x))
        if self.store is not None:  # a value the model computed before the blocks, read from a shared dict
            y = y * self.store["gate"]
        return x + y


class Model(nn.Module):
    def __init__(self, scale_between, stash):
        super().__init__()
        store = {} if stash else None
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(store) for _ in range(4)])
        self.head = nn.Linear(8, 16)
        self.scale_between = scale_between

    def forward(self, ids):
        x = self.emb(ids)
        if self.blocks[0].store is not None:
            self.blocks[0].store["gate"] = torch.sigmoid(x.mean(-1, keepdim=True))
        for block in self.blocks:
            x = block(x)
            if self.scale_between:  # the model's own op between blocks: it joins the block's unit
                x = x * 2.0
        return self.head(x)


def build_model(scale_between=False, stash=False, **_):
    return Model(scale_between, stash)


def example_inputs(batch_size, **_):
    return (torch.randint(0, 16, (batch_size, 4)),)
"""


@pytest.mark.parametrize("case", ["scale_between", "stash"])
def test_blocks_that_cannot_be_folded_are_analysed_as_traced(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op of the model's own after each block (it joins the block's unit: the analysis traces again, unfolded)
    and blocks reading a value the model left on a shared object (not an argument: such a block is never folded)
    give the analysis of the full trace."""
    import planner.model.analysis as analysis

    path = tmp_path / "between.py"
    path.write_text(_BETWEEN_BLOCKS)
    templates: list[dict[int, int] | None] = []
    fold_templates = analysis.fold_templates

    def kept(*a):  # type: ignore[no-untyped-def]
        templates.append(fold_templates(*a))
        return templates[-1]

    monkeypatch.setattr(analysis, "fold_templates", kept)
    graphs = []
    for repeats, folding in ((False, False), (True, True)):
        monkeypatch.setattr(model_trace, "REPLAY_REPEATED_BLOCKS", repeats)
        monkeypatch.setattr(model_trace, "FOLD_REPEATED_BLOCKS", folding)
        templates.clear()
        graphs.append(analyse_model(load_model_file(path, {case: True}, dtype="fp32")).model_dump())
    assert graphs[0] == graphs[1]
    if case == "scale_between":
        assert templates == [None, {}]  # folded, refused, traced again without folding
    else:
        assert templates == [{}]  # nothing folded


def test_the_check_runs_each_kind_of_block_once() -> None:
    """Forward, recomputation and backward through one block of each kind, with the shapes of the full run."""
    with torch.device("meta"):
        model = Stack((1.0, 1.0, 2.0, 1.0))
    calls: list[int] = []
    for block in model.blocks:
        inner = block.forward
        block.forward = lambda x, _inner=inner, _i=block.layer_idx: (calls.append(_i), _inner(x))[1]
    stage = ModelStage(model, ["emb", *(f"blocks.{i}" for i in range(4)), "head"])
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    with blocks_once(stage):
        out = model(ids)
        out.float().sum().backward()
    assert calls == [0, 2]  # blocks 1 and 3 repeat block 0 (same kind, same input); block 2 has its own scale
    assert out.shape == (2, 5, 32)
    assert model.emb.weight.grad is not None and model.emb.weight.grad.shape == (32, 8)
    # Afterwards every block runs again.
    calls.clear()
    model(ids)
    assert calls == [0, 1, 2, 3]


def test_the_check_runs_a_block_whose_input_it_cannot_describe() -> None:
    class Opaque:
        pass

    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, extra: object = None) -> torch.Tensor:
            return self.fc(x)

    with torch.device("meta"):
        model = nn.Sequential(Takes(), Takes())
    calls: list[int] = []
    for i, block in enumerate(model):
        inner = block.forward
        block.forward = lambda x, extra=None, _inner=inner, _i=i: (calls.append(_i), _inner(x, extra))[1]
    stage = ModelStage(model, ["0", "1"])
    x = torch.empty(2, 4, device="meta")
    with blocks_once(stage):
        model[0](x, Opaque())
        model[1](x, Opaque())
    assert calls == [0, 1]


def test_the_check_runs_tp_sharded_blocks_once_but_not_blocks_with_other_hooks() -> None:
    """parallelize_module's hooks (torch's distribute_module: input and output transforms) record nothing, so the
    check of a TP plan still runs one block of each kind (Llama-3-70B at tp2: 83 units run one by one took 5 s);
    any other forward hook inside a block makes every block run."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from planner.runtime.check import _fake_tp_mesh

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    def run(user_hook: bool) -> list[int]:
        with torch.device("meta"):
            model = nn.Sequential(Block(), Block(), Block())
        calls: list[int] = []
        with _fake_tp_mesh(2) as mesh:
            assert mesh is not None
            for i, block in enumerate(model):
                parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
                if user_hook:
                    block.up.register_forward_hook(lambda *_: None)
                inner = block.forward
                block.forward = lambda x, _inner=inner, _i=i: (calls.append(_i), _inner(x))[1]
            stage = ModelStage(model, ["0", "1", "2"])
            x = torch.empty(2, 8, device="meta", requires_grad=True)
            with blocks_once(stage):
                out = model(x)
                out.sum().backward()
            assert out.shape == (2, 8) and x.grad is not None
        return calls

    assert run(user_hook=False) == [0]
    assert run(user_hook=True) == [0, 1, 2]


def test_the_checks_pipeline_trace_replays_blocks_and_equals_the_runs() -> None:
    """The plan-time check traces a pipeline's graph with each kind of block replayed (stages.trace, repeats):
    node for node the graph the run traces block by block, with the same values (shapes) at every node."""
    transformers = pytest.importorskip("transformers")
    from planner.runtime.stages import trace

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    calls: list[int] = []
    for layer in model.model.layers:
        inner = layer.forward
        layer.forward = lambda *a, _inner=inner, **k: (calls.append(1), _inner(*a, **k))[1]
    full = trace(model, (ids,))
    traced_calls = len(calls)
    replayed = trace(model, (ids,), repeats=True)
    assert traced_calls >= 4 and len(calls) - traced_calls < traced_calls  # the later layers are replayed
    assert full[2] == replayed[2]
    assert _nodes(full[0].graph) == _nodes(replayed[0].graph)

    def shapes(traced: tuple) -> list:
        return [getattr(traced[1][n], "shape", None) for n in traced[0].graph.nodes if n in traced[1]]

    assert shapes(full) == shapes(replayed)
