"""The fx tracers (planner.runtime.tracers): symbolic tracing with meta values follows Python that reads shapes,
records tensor factories as calls, refuses to bake a valueless meta tensor into the graph, returns a structured
output's leaves with its out_spec, and computes what the model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx, nn
from torch.utils._pytree import register_dataclass, tree_leaves

from planner.runtime.stages import cut_into_pieces, retarget_devices, trace
from planner.runtime.tracers import BufferTracer, MetaTraceError, meta_trace

META = torch.device("meta")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


register_dataclass(Output)


class ReadsShapes(nn.Module):
    """Python on shapes, dtypes and devices, a mask built with arange from a shape, a norm reading its own
    weight, and a dataclass output: plain symbolic tracing fails at the first `if`."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Output:
        batch, seq = x.shape[:2]
        if mask.ndim == 2:  # as transformers' mask preparation asks
            mask = mask[:, None, :].expand(batch, seq, seq)
        causal = torch.arange(seq, device=x.device)[None, :] <= torch.arange(seq, device=x.device)[:, None]
        h = self.inp(x) * self.scale.to(x.dtype)
        h = torch.softmax(h @ h.transpose(1, 2) + torch.where(causal & mask.bool(), 0.0, -1e9), -1) @ h
        return Output(logits=self.out(h), hidden=h)


def _inputs(batch: int = 2, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, 8, generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor([seq, seq - 2])[:, None]).long()
    return x, mask


def test_meta_trace_follows_shape_reading_python_and_computes_what_the_model_computes():
    with pytest.raises(fx.proxy.TraceError):  # plain torch.fx cannot branch on mask.ndim
        BufferTracer().trace(ReadsShapes())
    torch.manual_seed(0)
    with META:
        meta_model = ReadsShapes()
    x, mask = _inputs()
    graph = meta_trace(meta_model, (x.to(META), mask.to(META)))
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.arange in targets  # a factory from a shape is recorded, not baked in as a meta constant
    assert torch.arange.__module__ == "torch" and not hasattr(torch.arange, "__wrapped__")  # restored
    assert "scale" in [n.target for n in graph.nodes if n.op == "get_attr"]  # a weight read by name

    torch.manual_seed(0)
    model = ReadsShapes()
    retarget_devices(graph, torch.device("cpu"))
    gm = fx.GraphModule(model, graph)
    out, ref = gm(x, mask), model(x, mask)
    assert isinstance(out, Output) and gm._out_spec is not None  # the structure comes back from the leaves
    for a, b in zip(tree_leaves(out), tree_leaves(ref)):
        assert torch.equal(a, b)
    out.logits.sum().backward()
    assert model.inp.weight.grad is not None and model.scale.grad is not None


def test_runtime_trace_takes_meta_values_after_plain_fx_and_a_pipeline_returns_leaves():
    """trace() tries plain fx, then meta values, then torch.export; the last piece of a cut graph returns the
    output's leaves (a pipeline sends tensors) with the out_spec the loss rebuilds the dataclass from."""
    from planner.runtime.layout import Layout

    with META:
        model = ReadsShapes()
    x, mask = _inputs()
    gm, values, method = trace(model, (x.to(META), mask.to(META)))
    assert method == "fx-meta"
    layout = Layout(
        pp=2, dp=1, tp=1, virtual_stages=1, mesh_dims=("pp", "dp", "tp"), micro_batch_size=2, num_micro_batches=2,
        global_batch_size=4, schedule="1f1b", zero_stage=1, sequence_parallel=False,
        stages=[(0, ["inp"], "none"), (1, ["out"], "none")],
    )
    pieces = cut_into_pieces(gm, values, layout)
    assert pieces[-1].out_spec is not None and pieces[-1].out_spec.type is Output


class MetaConstant(nn.Module):
    """A tensor attribute that is neither parameter nor buffer: on meta it has no values to bake in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            return self.fc(x) + self.table
        return x


def test_a_valueless_meta_constant_fails_the_meta_trace_and_a_value_branch_falls_back_to_export():
    with META:
        model = MetaConstant()
    model.table = torch.ones(4, device=META)
    with pytest.raises(MetaTraceError, match="baked into the graph"):
        meta_trace(model, (torch.ones(2, 4, device=META),))

    class OnAValue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # A tensor made from a shape has a value under torch.export's fake tensors, none on meta.
            return self.fc(x) if torch.tensor(x.shape[0]) > 1 else x

    with META:
        on_meta = OnAValue()
    with pytest.raises(RuntimeError, match="meta tensors"):
        meta_trace(on_meta, (torch.ones(2, 4, device=META),))
    _, _, method = trace(OnAValue(), (torch.ones(2, 4),))
    assert method == "export"


class Unpermutes(nn.Module):
    """transformers' grouped-mm experts restore the token order by item assignment: inv[perm] = arange(n)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        perm = torch.argsort(x[:, 0])
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=x.device)
        return self.fc(x[perm])[inv]


def test_an_item_assignment_is_recorded_and_runs_as_the_model_does():
    with META:
        meta_model = Unpermutes()
    graph = meta_trace(meta_model, (torch.ones(5, 4, device=META),))
    import operator

    assert operator.setitem in [n.target for n in graph.nodes if n.op == "call_function"]
    torch.manual_seed(0)
    model = Unpermutes()
    x = torch.randn(5, 4)
    retarget_devices(graph, torch.device("cpu"))
    assert torch.equal(fx.GraphModule(model, graph)(x), model(x))


class DataAttributes(nn.Module):
    """Tensor data attributes (`.T`, `.mT`) read in Python that reads shapes: a tied output projection as
    written with `weight.T`, and a batched transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(10, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 3:  # plain torch.fx cannot branch on this
            x = self.proj(x).transpose(1, 2).transpose(1, 2)
        scores = x @ x.mT
        return torch.softmax(scores, -1) @ x @ self.emb.T


def test_tensor_data_attributes_have_meta_values_and_run_as_the_model_does():
    """`w.T` on a proxy was fx's lazy Attribute without a meta value: the next op's meta run failed and the
    model went to torch.export."""
    with META:
        meta_model = DataAttributes()
    x = torch.randn(2, 5, 8)
    gm, values, method = trace(meta_model, (x.to(META),))
    assert method == "fx-meta"
    reads = [n.args[1] for n in gm.graph.nodes if n.op == "call_function" and n.target is getattr]
    assert sorted(reads) == ["T", "mT"]
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["transpose", "transpose"]  # as before
    torch.manual_seed(0)
    model = DataAttributes()
    graph = meta_trace(meta_model, (x.to(META),))
    retarget_devices(graph, torch.device("cpu"))
    assert torch.equal(fx.GraphModule(model, graph)(x), model(x))
