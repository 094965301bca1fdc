"""Tracing the model on the meta device and cutting the graph into the plan's pipeline stages.

Every rank traces and cuts the whole model the same way, then builds only its own stages. A graph node
belongs to the stage owning the outermost planned module on its module stack (module_paths / owner_of: the
same rule the planner uses to group units); each stage keeps its modules under their original names, so the
plan's TP names apply to them.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, TypeAlias

import torch
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen

from .errors import RefusedLayout, RunError
from .layout import Layout, ModelFile, runs_traced_graph, sizes_in_code
from .memo import MetaMemo
from .model import build_model, input_count, materialise
from .tracers import BufferTracer
from .weights import Checkpoint

# The modules sequence parallelism adds to the graph (parallel.plan_sequence_parallel) are named this and a
# number: a conversion is the same wherever it sits, so the plan-time check compares pieces without the number.
SP_MODULE_PREFIX = "sequence_parallel_"


class ValueRecorder(fx.Interpreter):
    """Runs a graph on meta tensors and keeps what each node produced (shapes, and tensor or not). Repeated
    identical blocks run their meta kernels once (MetaMemo)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with MetaMemo():
            return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.values[n] = result = super().run_node(n)
        return result


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """torch.export records the Python stack of every op it traces (node.meta["stack_trace"], for debugging
    output; neither the planner nor the run reads it): symbolising those stacks takes about 0.7 s of the 5 s
    export of Llama-3-70B. torch.fx.config.do_not_emit_stack_traces turns it off; the setting is restored."""
    import torch.fx.config as config

    before = getattr(config, "do_not_emit_stack_traces", False)
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def bind_defaults(graph: fx.Graph, n_inputs: int) -> None:
    """Replace the placeholders after the first `n_inputs` (forward's optional arguments) by their defaults
    (before the graph's module is built, which compiles its code once)."""
    for node in [n for n in graph.nodes if n.op == "placeholder"][n_inputs:]:
        if not node.args:
            raise RunError(
                f"The model's forward() takes an input `{node.target}` without a default beyond the "
                f"{n_inputs} that example_inputs() provides: return it from example_inputs() too."
            )
        default = node.args[0]

        def bind(a: fx.Node, node: fx.Node = node, default: Any = default) -> Any:
            return default if a is node else a

        for user in list(node.users):
            user.args = fx.map_arg(user.args, bind)
            user.kwargs = fx.map_arg(user.kwargs, bind)
        graph.erase_node(node)


def _uncompiled_graph_module(root: nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """The traced model as a GraphModule that compiles its Python code only if something calls it or reads it:
    the whole graph is run by an Interpreter and cut into pieces (each compiled), never called as one (for GPT-3
    175B's 2,000 nodes the compile is 0.05 s). torch's lazy graph module; a plain one where torch lacks it."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return fx.GraphModule(root, graph, name)
    return _LazyGraphModule(root, graph, name)


class Traced:
    """A trace of `model` made ahead of the check that reads it (the check worker makes one while the search
    runs): the graph module, each node's value, the method, and what it was traced for (leaves, inputs)."""

    def __init__(
        self, model: nn.Module, inputs: Sequence[Any], leaves: frozenset[str],
        traced: tuple[fx.GraphModule, dict[fx.Node, Any], str],
    ) -> None:
        self.model, self.leaves, self.signature = model, leaves, _signature(inputs)
        self.gm, self.values, self.method = traced

    def reuse(
        self, model: nn.Module, inputs: Sequence[Any], leaves: frozenset[str]
    ) -> tuple[fx.GraphModule, dict[fx.Node, Any], str] | None:
        """What `trace(model, inputs, leaves=leaves)` returns, from this trace: as it is for the same inputs'
        shapes, and for other shapes a plain torch.fx graph (which holds no shape) run again on the inputs;
        None where it cannot stand for that trace (then trace)."""
        if model is not self.model or self.method not in ("fx", "fx-meta"):
            return None
        if _kept_as_calls(model, leaves) != _kept_as_calls(model, self.leaves):
            return None
        if _signature(inputs) == self.signature:
            return self.gm, self.values, self.method
        if self.method != "fx" or len(inputs) != len(self.signature):
            return None
        try:
            recorder = ValueRecorder(self.gm)
            recorder.run(*inputs)
        except Exception:  # noqa: BLE001 - the trace proper then decides (and falls back) as it would
            return None
        return self.gm, recorder.values, self.method


def _kept_as_calls(model: nn.Module, leaves: frozenset[str]) -> frozenset[str]:
    """The modules of `leaves` that change a trace: those the tracers would otherwise trace through (a module
    torch.fx keeps as one call anyway, an nn.Linear a TP plan names, is the same call either way)."""
    from .tracers import BufferTracer

    plain = BufferTracer()
    kept = set()
    for name in leaves:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            kept.add(name)
            continue
        if not plain.is_leaf_module(module, name):
            kept.add(name)
    return frozenset(kept)


def _signature(inputs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in inputs)


def trace(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    log: Callable[[str], None] = lambda _: None,
    leaves: frozenset[str] = frozenset(),
    ahead: Traced | None = None,
    fx_leaves: frozenset[str] = frozenset(),
    repeats: bool = False,
) -> tuple[fx.GraphModule, dict[fx.Node, Any], str]:
    """Symbolic trace of forward(*inputs) (keeps module calls, so TP plan names apply); where that fails, the
    symbolic trace with meta values (`tracers.meta_trace`: Python reading shapes, as transformers' models do), and
    torch.export where that fails too. Returns the graph, each node's value on the meta inputs, and the method
    ("fx", "fx-meta" or "export"; the last two are specialised to the inputs' shapes).

    `leaves`: modules the graph must call as they are (one call_module node, their code not inlined), so that
    the script can swap them afterwards: the experts under expert parallelism. torch.fx keeps them as leaf
    modules; torch.export inlines every module, so there each is exported as one opaque op
    (`_export_keeping`) that is then turned back into a call of the module. `ahead`: this model's trace made
    before (`Traced.reuse`), used where it stands for this one. `fx_leaves`: more modules the fx traces keep as
    calls (HF's Conv1D under TP), not torch.export. `repeats`: each kind of repeated block traced once and
    replayed for the others (tracers.RepeatedBlocks): the plan-time check's graphs, whose shapes and ops are a
    full trace's; a run traces every block (a replayed block carries the first one's constants)."""
    from .tracers import meta_trace

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    reused = ahead.reuse(model, inputs, leaves | fx_leaves) if ahead is not None else None
    if reused is not None:
        return reused
    try:
        forward_params = list(inspect.signature(model.forward).parameters.values())[len(inputs) :]
        concrete = {p.name: p.default for p in forward_params if p.default is not inspect.Parameter.empty}
        graph = BufferTracer(leaves | fx_leaves, repeats=repeats).trace(model, concrete or None)
        bind_defaults(graph, len(inputs))
        gm = _uncompiled_graph_module(model, graph, type(model).__name__)
        method = "fx"
        recorder = ValueRecorder(gm)
        recorder.run(*inputs)  # a symbolic trace can succeed yet bake in a wrong shape path
        return gm, recorder.values, method
    except Exception as e:  # noqa: BLE001 - any failure sends us to the fallback
        log(f"torch.fx symbolic tracing failed ({type(e).__name__}: {e}); tracing with meta values")
    try:
        graph = meta_trace(model, tuple(inputs), fx_leaves, repeats=repeats, shaped=leaves)
        gm = _keep_shapes(_uncompiled_graph_module(model, graph, type(model).__name__), leaves)
        method = "fx-meta"
        recorder = ValueRecorder(gm)
        recorder.run(*inputs)
        return gm, recorder.values, method
    except Exception as e:  # noqa: BLE001 - any failure sends us to the fallback
        log(f"tracing with meta values failed ({type(e).__name__}: {e}); using torch.export")
    with without_stack_traces():
        gm = _export_keeping(model, tuple(inputs), leaves) if leaves else torch.export.export(
            model, tuple(inputs), strict=False
        ).module()
    method = "export"
    recorder = ValueRecorder(gm)
    recorder.run(*inputs)
    return gm, recorder.values, method


def _module_call_op() -> Any:
    """The custom op that stands for a module call while torch.export traces (`_export_keeping`), defined on
    first use: defining a custom op reads the source of every module loaded to name the caller's module (30 ms
    once transformers is imported), and only the export of a model with kept modules needs it."""
    if not hasattr(torch.ops.planner_runtime, "module_call"):

        @torch.library.custom_op("planner_runtime::module_call", mutates_args=())
        def _module_call(args: list[torch.Tensor], name: str) -> torch.Tensor:
            """Stands for the module `name` called on tensors `args` returning the first one's shape (HF
            experts: (hidden, top_k_index, top_k_weights); torchtitan's routed_experts: (x, scores, expert_ids,
            counts)), while torch.export traces; `_export_keeping` replaces it by the module call. Never run."""
            raise RunError(f"internal error: the placeholder for {name} was left in the graph")

        @_module_call.register_fake
        def _(args: list[torch.Tensor], name: str) -> torch.Tensor:
            return torch.empty_like(args[0])

    return torch.ops.planner_runtime.module_call


# Per exported graph, the stand-ins of the modules it keeps as calls (by name).
_KEPT: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, nn.Module]] = weakref.WeakKeyDictionary()


class _ShapeOf(nn.Module):
    """The meta graph's stand-in for an experts module kept as a call: the output's shape and dtype."""

    def forward(self, hidden: torch.Tensor, *routing: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(hidden)


def _export_keeping(model: nn.Module, inputs: tuple[torch.Tensor, ...], leaves: frozenset[str]) -> fx.GraphModule:
    """torch.export of `model` with each module of `leaves` left as one call_module node: while exporting,
    each is replaced by an opaque custom op (its shape from a fake kernel), which is then swapped for a call
    of the module. The traced graph holds a stand-in of the right output shape there (running the model's
    experts on meta can take a GPU-only kernel); each stage fetches the real module by name
    (`build_local_stages`), and expert parallelism swaps it for this rank's slice."""
    owned = dict(model.named_modules())
    missing = sorted(leaves - owned.keys())
    if missing:
        raise RunError(f"EXPERTS names modules the model lacks: {missing[:5]}. Re-plan the model.")
    module_call = _module_call_op()
    saved = {}
    for name in leaves:
        mod = owned[name]
        saved[name] = mod.__dict__.get("forward")

        def call(*args: torch.Tensor, _name: str = name) -> torch.Tensor:
            out: torch.Tensor = module_call(list(args), _name)
            return out

        mod.forward = call
    try:
        gm = torch.export.export(model, inputs, strict=False).module()
    finally:
        for name, forward in saved.items():
            if forward is None:
                del owned[name].forward
            else:
                owned[name].forward = forward
    op = module_call.default
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is op:
            args, name = node.args
            with gm.graph.inserting_before(node):
                call_node = gm.graph.call_module(name, tuple(args))
            call_node.meta = dict(node.meta)
            node.replace_all_uses_with(call_node)
            gm.graph.erase_node(node)
    # The kept modules' weights are read inside them now, not by the graph.
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users and any(node.target.startswith(f"{n}.") for n in leaves):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return _keep_shapes(gm, leaves)


def _keep_shapes(gm: fx.GraphModule, leaves: frozenset[str]) -> fx.GraphModule:
    """`gm` with each module of `leaves` (called by the graph) a shape stand-in (`_ShapeOf`), in the graph
    module's own tree (over export's plain holder of its weights, or torch.fx's reference to the model's
    module: the model keeps its own). The values are recorded, and the plan-time check runs, with the stand-in;
    each stage fetches the real module by name (`fetch`)."""
    kept = _KEPT[gm] = {}
    for name in sorted(leaves):
        gm.add_submodule(name, _ShapeOf())
        kept[name] = gm.get_submodule(name)
    return gm


def module_paths(node: fx.Node) -> list[str]:
    """Qualified names of the modules a node runs inside, outer to inner."""
    paths = []
    for key, val in (node.meta.get("nn_module_stack") or {}).items():
        path = val[0] if isinstance(val, tuple) else key
        if isinstance(path, str):
            paths.append(path.replace("L['self'].", "").replace("L__self__.", ""))
    if node.op == "call_module" and node.target not in paths:
        paths.append(str(node.target))
    return paths


def owner_of(path: str, stage_of_module: Container[str]) -> str | None:
    """The outermost module of the plan's stages that `path` is or lies under."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in stage_of_module:
            return name
    return None


def contains_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(contains_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(contains_tensor(v) for v in value.values())
    return False


class Piece:
    """A run of consecutive graph nodes owned by one module of one stage, cut out as its own graph."""

    def __init__(self, stage: int, owner: str | None, graph: fx.Graph, out_spec: Any = None) -> None:
        self.stage = stage
        self.owner = owner  # None: code outside any module (e.g. torch.arange for positions)
        self.graph = graph
        self.out_spec = out_spec  # the last piece of an exported graph: the structure of the model's output


def cut_into_pieces(gm: fx.GraphModule, values: dict[fx.Node, Any], layout: Layout) -> list[Piece]:
    """Assign every node to a stage and cut the graph into pieces that each take what the previous returns.

    A node belongs to the stage owning the outermost module on its module stack; nodes outside any module
    go with the nearest preceding module's node (before any module: stage 0). get_attr nodes (weights,
    buffers) and nodes producing no tensor (shapes, devices) are not sent between pieces: they are
    recomputed in each piece that uses them. A value needed later is returned by every piece in between,
    since a pipeline stage only receives what the stage before it sends.

    (torch.fx.passes.split_module is not used: it passes tensor attributes into submodules as inputs and
    renames modules, while each stage must own its weights under their original names so that the TP plan's
    names apply, and must forward values that later stages need.)
    """
    stage_of_module = layout.stage_of_module
    # Nodes that are computed where they are used instead of being passed along.
    recomputed = {
        n
        for n in gm.graph.nodes
        if n.op == "get_attr"
        or (n.op in ("call_function", "call_method") and not contains_tensor(values.get(n)))
    }
    key_of: dict[fx.Node, tuple[int, str | None]] = {}
    current: tuple[int, str | None] = (0, None)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node in recomputed:
            continue
        if node.op == "call_module" and not node.users and not has_module(gm, node.target):
            continue  # torch.export's input guards (_guards_fn): checks, no computation
        owner = next(
            (o for o in (owner_of(p, stage_of_module) for p in module_paths(node)) if o is not None), None
        )
        if owner is not None:
            current = (stage_of_module[owner], owner)
        inputs = [key_of[a][0] for a in node.all_input_nodes if a in key_of]
        if inputs and max(inputs) > current[0]:
            raise RunError(
                f"Graph node {node.name} ({owner or 'outside any module'}) is in stage {current[0]} but uses "
                f"a value computed in stage {max(inputs)}: the plan's stages must follow the model's execution order. "
                "Re-plan the model."
            )
        key_of[node] = current

    # Pieces: maximal runs of nodes with the same (stage, owner).
    keys: list[tuple[int, str | None]] = []
    piece_of: dict[fx.Node, int] = {}
    for node, key in key_of.items():
        if not keys or keys[-1] != key:
            if keys and key[0] < keys[-1][0]:
                raise RunError(
                    f"{key[1]} (stage {key[0]}) runs after {keys[-1][1]} (stage {keys[-1][0]}): the plan's stages must "
                    "follow the model's execution order. Re-plan the model."
                )
            keys.append(key)
        piece_of[node] = len(keys) - 1
    last = len(keys) - 1
    missing = set(range(layout.num_stages)) - {k[0] for k in keys}
    if missing:
        raise RefusedLayout(f"Stages {sorted(missing)} run no part of the model; re-plan with fewer stages.")

    needed_memo: dict[fx.Node, set[int]] = {}

    def needed(node: fx.Node) -> set[int]:
        """The pieces that use `node`'s value (directly, or through a node recomputed there)."""
        if node not in needed_memo:
            where: set[int] = set()
            for user in node.users:
                if user.op == "output":
                    where.add(last)
                elif user in piece_of:
                    where.add(piece_of[user])
                elif user in recomputed:
                    where |= needed(user)
            needed_memo[node] = where
        return needed_memo[node]

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    produced = {n: -1 for n in placeholders} | piece_of
    # Values piece k receives: made before it and still needed by it or a later piece, in graph order (one
    # pass over each value's span, not over every value for every piece: 100 pieces of a 2,000-node graph).
    received: list[list[fx.Node]] = [[] for _ in keys]
    for v in (n for n in gm.graph.nodes if n in produced):
        for k in range(produced[v] + 1, max(needed(v), default=-1) + 1):
            received[k].append(v)

    def live_into(k: int) -> list[fx.Node]:
        return placeholders if k == 0 else received[k]

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    model_output = output_node.args[0]
    # torch.export flattens the output (a dict, dataclass, ModelOutput, tuple) into a tuple of leaves: the
    # last stage returns the leaves and StageModule rebuilds the structure for the loss.
    # (read from the graph: a lazy graph module sets its _out_spec only once it compiles)
    codegen = gm.graph._codegen
    spec = codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) else None
    if spec is not None and spec.is_leaf():
        (model_output,) = model_output
        spec = None
    nodes_of: list[list[fx.Node]] = [[] for _ in keys]  # each piece's own nodes, in graph order
    for node, p in piece_of.items():
        nodes_of[p].append(node)
    pieces = []
    for k, (stage, owner) in enumerate(keys):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for v in live_into(k):
            if k > 0 and keys[k - 1][0] != stage and not isinstance(values.get(v), torch.Tensor):
                raise RunError(
                    f"{v.name} ({type(values.get(v)).__name__}) would cross from stage {keys[k - 1][0]} to "
                    f"stage {stage}, but a pipeline can only send tensors. Move the stage boundary."
                )
            env[v] = graph.placeholder(v.name)

        def value(n: fx.Node, graph: fx.Graph = graph, env: dict[fx.Node, fx.Node] = env) -> fx.Node:
            if n not in env:
                if n not in recomputed:
                    raise RuntimeError(f"internal error: {n.name} is not forwarded to this piece")
                env[n] = graph.node_copy(n, value)
            return env[n]

        for node in nodes_of[k]:
            env[node] = graph.node_copy(node, value)
        if k < last:
            graph.output(tuple(value(v) for v in live_into(k + 1)))
        else:
            graph.output(fx.map_arg(model_output, value))
        pieces.append(Piece(stage, owner, graph, spec if k == last else None))
    return pieces


def shared_weights(gm: fx.GraphModule, pieces: list[Piece]) -> dict[str, list[int]]:
    """Weights used by more than one stage (tied embeddings: GPT-2's wte and lm_head), by name -> the stages
    using them. Each of those stages keeps a copy with the same initial values, and the copies' gradients
    are summed over the stages' ranks before the optimizer step (Megatron-LM's embedding group)."""
    stages_of: dict[int, set[int]] = {}
    name_of: dict[int, str] = {}
    for piece in pieces:
        for node in piece.graph.nodes:
            if node.op == "call_module":
                found = list(gm.get_submodule(node.target).named_parameters(prefix=node.target))
            elif node.op == "get_attr":
                obj = gm
                for part in node.target.split("."):
                    obj = getattr(obj, part)
                found = [(node.target, obj)] if isinstance(obj, nn.Parameter) else []
            else:
                continue
            for name, param in found:
                stages_of.setdefault(id(param), set()).add(piece.stage)
                name_of.setdefault(id(param), name)
    return {name_of[k]: sorted(v) for k, v in stages_of.items() if len(v) > 1}


def has_module(root: nn.Module, name: str) -> bool:
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def fetch(model: nn.Module, gm: fx.GraphModule, target: str, device: torch.device) -> Any:
    """What a piece's `target` refers to: the model's (materialised) module, parameter or buffer, else a
    constant the tracer made (moved to `device`). On meta (the plan-time check) an experts module kept as a
    call is the graph's shape stand-in (`_ShapeOf`): the experts' own meta run can take a GPU-only kernel."""
    stand_in = _KEPT.get(gm, {}).get(target)
    if device.type == "meta" and stand_in is not None:
        return stand_in
    for root in (model, gm):
        obj: Any = root
        for part in target.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        else:
            if root is model or not isinstance(obj, torch.Tensor):
                return obj
            if obj.device.type == "meta":
                raise RunError(
                    f"The traced graph holds {target}, a tensor computed while tracing on the meta device, "
                    "so it has no value. Compute it inside forward() from a buffer instead."
                )
            return obj.to(device)
    raise RunError(f"internal error: {target} not found in the model")


def piece_module(piece: Piece, model: nn.Module, gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """The piece's GraphModule, its buffers as persistent as the model's: fx registers every tensor a get_attr
    reads as a persistent buffer, so a buffer the model keeps out of its state dict (transformers' rotary
    `inv_freq`, persistent=False) would be in a traced stage's checkpoint and not in the model's as written, and
    a resume under another layout was refused for it."""
    module = fx.GraphModule(piece_attrs(piece, model, gm, device), piece.graph)
    for node in piece.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, field = str(node.target).rpartition(".")
        if not has_module(model, owner) or not has_module(module, owner):
            continue
        theirs, ours = model.get_submodule(owner), module.get_submodule(owner)
        if field in theirs._non_persistent_buffers_set and field in ours._buffers:
            ours._non_persistent_buffers_set.add(field)
    return module


def piece_attrs(piece: Piece, model: nn.Module, gm: fx.GraphModule, device: torch.device) -> dict[str, Any]:
    """What each get_attr and call_module node of a piece's graph refers to (`fetch`), by target: the root of
    the piece's GraphModule."""
    targets = [n.target for n in piece.graph.nodes if n.op in ("get_attr", "call_module")]
    return {t: fetch(model, gm, t, device) for t in targets}


def used_modules(model: nn.Module, graphs: list[fx.Graph]) -> set[str]:
    """Modules whose own parameters or buffers the graphs use (called modules with their children)."""
    names: set[str] = set()
    for graph in graphs:
        for node in graph.nodes:
            if node.op == "call_module" and has_module(model, node.target):
                module = model.get_submodule(node.target)
                names.update(n for n, _ in module.named_modules(prefix=node.target))
            elif node.op == "get_attr":
                owner = node.target.rpartition(".")[0]
                if has_module(model, owner):
                    names.add(owner)
    return names


class ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward passes the gradient on contiguous (point-to-point needs it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _sendable(v: torch.Tensor) -> torch.Tensor:
    """`v` contiguous and not a view of another tensor (itself where it is both)."""
    if v._is_view():
        return v.clone(memory_format=torch.contiguous_format)
    return v.contiguous()


class StageModule(nn.Module):
    """One pipeline stage: its pieces run in order, each taking exactly what the one before returns. (The
    last stage of an exported graph returns the output's leaves, since torch's pipeline stages return
    tensors; with_structure() rebuilds the structure for the loss.)"""

    def __init__(
        self,
        pieces: Sequence[nn.Module],
        owners: list[str | None],
        sends: bool = False,
        receives: bool = False,
        copy_views: bool = False,
    ) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.owners = owners
        self.sends = sends  # not the last stage: its outputs go to the next stage over the network
        self.receives = receives  # not the first stage: its inputs' gradients go back over the network
        self.copy_views = copy_views  # zero-bubble: an output that is a view is sent as a copy (forward)

    def forward(self, *values: Any) -> Any:
        if self.receives:
            # The gradients of the inputs go back to the previous stage, which receives them into buffers of
            # the strides torch's pipelining infers from this stage's backward on meta: a permuted one
            # (ConvNeXt's blocks permute to channels-last and back) made gloo refuse the receive.
            values = tuple(
                ContiguousGrad.apply(v) if isinstance(v, torch.Tensor) and v.requires_grad else v  # type: ignore[no-untyped-call]
                for v in values
            )
        for piece in self.pieces:
            values = piece(*values)
        if self.sends:
            # Point-to-point sends and receives need contiguous tensors, and a stage's output can be a view
            # (T5's encoder output after a transpose, a slice): send a contiguous copy (a no-op otherwise).
            # Under zero-bubble a view that is contiguous already is copied too: its split backward detaches
            # each stage output in place once the input gradients are computed, which a view refuses (BART,
            # mBART and OPT pp2 x dp2 stopped at their first backward).
            send = _sendable if self.copy_views else torch.Tensor.contiguous
            values = tuple(send(v) if isinstance(v, torch.Tensor) else v for v in values)
        return values

    def units(self) -> list[nn.Module]:
        """What activation checkpointing and FSDP wrap one by one: the pieces."""
        return list(self.pieces)

    def owned_units(self) -> list[tuple[str | None, nn.Module]]:
        """The units with the planned module each belongs to (None: glue between them)."""
        return list(zip(self.owners, self.pieces, strict=True))

    def sharded_units(self) -> list[nn.Module]:
        """The units FSDP may wrap one by one: every piece (a piece's graph reads its own weights)."""
        return self.units()

    def tp_roots(self) -> list[nn.Module]:
        """Modules under which the TP plan's (original) module names resolve."""
        return list(self.pieces)


class ModelStage(nn.Module):
    """Without a pipeline, the stage is the user's model itself, run as written (no graph: any output type,
    any inputs, buffers updated in forward, tied weights), its planned modules the checkpoint/FSDP units."""

    def __init__(self, model: nn.Module, modules: list[str]) -> None:
        super().__init__()
        self.model = model
        held = [m for m in modules if has_module(model, m)]
        self.names = [m for m in held if any(True for _ in model.get_submodule(m).parameters())]
        self.owners = list(self.names)
        # Units whose weights the model also reads outside their forward (unit_reads.units_read_outside): FSDP
        # leaves them to the stage's unit.
        self.read_outside: list[str] = []

    def forward(self, *inputs: Any) -> Any:
        return self.model(*inputs)

    def units(self) -> list[nn.Module]:
        return called_units([self.model.get_submodule(n) for n in self.names])

    def owned_units(self) -> list[tuple[str | None, nn.Module]]:
        """The units with the planned module each belongs to."""
        return [(n, u) for n in self.names for u in called_units([self.model.get_submodule(n)])]

    def sharded_units(self) -> list[nn.Module]:
        """The units FSDP may wrap one by one: all but those read outside their forward."""
        whole = {id(self.model.get_submodule(n)) for n in self.read_outside}
        return [u for u in self.units() if id(u) not in whole]

    def tp_roots(self) -> list[nn.Module]:
        return [self.model]


def called_units(modules: list[nn.Module]) -> list[nn.Module]:
    """What FSDP and activation checkpointing wrap one by one: each module, or, for a container the model
    never calls (a ModuleList or ModuleDict has no forward; ConvNeXt's `downsampling_layer` is one, run by a
    loop over it), its children, recursively. fully_shard refuses such a container, and a checkpointed one
    would never run its checkpoint."""
    out: list[nn.Module] = []
    for m in modules:
        if type(m).forward is nn.Module.forward:
            out += called_units(list(m.children()))
        else:
            out.append(m)
    return out


# What parallelize() takes: a stage cut from a traced graph, or the model as written.
LocalStage: TypeAlias = StageModule | ModelStage


def unsupported_on(gm: fx.GraphModule, values: dict[fx.Node, Any], device_type: str) -> str | None:
    """Why the traced graph cannot run on `device_type`, if it cannot: tracing on the meta device records the
    branches a model takes for a non-CPU device, and some of them call kernels the CPU lacks (transformers'
    grouped-mm MoE experts count tokens per expert with torch.histc on int32 unless the device is the CPU)."""
    if device_type != "cpu":
        return None
    for node in gm.graph.nodes:
        if node.op == "call_function" and "histc" in str(node.target):
            source = node.args[0] if node.args else None
            value = values.get(source) if isinstance(source, fx.Node) else None
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                return (
                    f"the traced graph computes torch.histc on {value.dtype} (node {node.name}), the path the model "
                    "takes for GPUs when traced on the meta device, and the CPU has no integer histc"
                )
    return None


def retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Point factory calls that tracing on the meta device recorded (torch.export keeps `device=meta` in
    arange, zeros, full ...) at the device the stage runs on."""
    meta = torch.device("meta")

    def fix(a: Any) -> Any:
        if isinstance(a, torch.device) and a == meta:
            return device
        if isinstance(a, (tuple, list)):
            return type(a)(fix(x) for x in a)
        if isinstance(a, dict):
            return {k: fix(v) for k, v in a.items()}
        return a

    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            node.args, node.kwargs = fix(node.args), fix(node.kwargs)


def with_structure(loss_fn: Callable[..., torch.Tensor], out_spec: Any) -> Callable[..., torch.Tensor]:
    """`loss_fn` taking the model's output as the model returns it (dict, dataclass, ModelOutput, tuple),
    when the last stage returns the leaves of an exported graph (`out_spec`: their structure)."""
    if out_spec is None:
        return loss_fn

    def structured(output: Any, *inputs: Any) -> torch.Tensor:
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        return loss_fn(torch.utils._pytree.tree_unflatten(leaves, out_spec), *inputs)

    return structured


def build_local_stages(
    user: Any,
    spec: ModelFile,
    seed: int,
    gm: fx.GraphModule,
    pieces: list[Piece],
    local: list[int],
    device: torch.device,
    copy_views: bool = False,
    weights: Checkpoint | None = None,
) -> tuple[list[StageModule], nn.Module]:
    """This rank's stages (indices `local`), with only their parameters allocated (on `device`), and the
    model they take their modules and weights from (`copy_views`: zero-bubble's, see StageModule.forward;
    `weights`: the checkpoint their values come from)."""
    model = build_model(user, spec, seed, everything_on_meta=False)
    materialise(model, used_modules(model, [p.graph for p in pieces if p.stage in local]), device, seed, weights)
    stages = []
    last = max(p.stage for p in pieces)
    for i in local:
        mine = [p for p in pieces if p.stage == i]
        modules = []
        for p in mine:
            retarget_devices(p.graph, device)
            modules.append(piece_module(p, model, gm, device))
        stages.append(
            StageModule(modules, [p.owner for p in mine], sends=i < last, receives=i > 0, copy_views=copy_views)
        )
    return stages, model


class AsWritten(RefusedLayout):
    """The graph was traced only for tensor parallelism over head counts read in forward (pp = 1, no sequence
    parallelism), and only torch.export traced it: the run takes the model as written instead, its head
    attributes divided by tp (parallel.apply_head_attrs), as the plan-time check does."""


class GraphCopy:
    """A copy of a torch.fx trace ("fx" or "fx-meta") made before something changes it (the TP rewrite): its
    graph node for node (meta included) and each node's value as recorded. `over(model)` is what tracing
    `model`, built again as the traced model was, returns, without the trace."""

    def __init__(self, traced: tuple[fx.GraphModule, dict[fx.Node, Any], str]) -> None:
        import copy

        gm, values, self.method = traced
        if self.method not in ("fx", "fx-meta"):
            raise ValueError(f"GraphCopy copies torch.fx traces, not {self.method!r}")
        # As Graph.__deepcopy__, but the code generator (the output's pytree structure, never changed) shared:
        # deep-copying it warns that a pytree class is deprecated.
        self.graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
        copied: dict[fx.Node, fx.Node] = {}
        out: Any = self.graph.graph_copy(gm.graph, copied, return_output_node=True)
        self.graph._codegen = gm.graph._codegen
        if out is not None:
            value, old = out
            node = self.graph.output(value, type_expr=getattr(old, "type", None))
            node.meta = copy.copy(old.meta)
            copied[old] = node
        self.values = {copied[n]: v for n, v in values.items() if n in copied}

    def over(self, model: nn.Module, leaves: frozenset[str]) -> tuple[fx.GraphModule, dict[fx.Node, Any], str]:
        """The copy as `trace(model, leaves=leaves)` returns it (`leaves`: the experts, shape stand-ins in a
        graph traced with meta values). Once: the graph is the returned module's."""
        gm = _uncompiled_graph_module(model, self.graph, type(model).__name__)
        if self.method == "fx-meta" and leaves:
            gm = _keep_shapes(gm, leaves)
        return gm, self.values, self.method


def uses_graph(layout: Layout) -> bool:
    """Whether the run cuts a traced graph: for pipeline stages, or to rewrite it for sequence parallelism.
    Otherwise the one stage is the user's model itself (ModelStage), as written."""
    tp = layout.tp_plan
    return runs_traced_graph(layout.pp, layout.tp, layout.sequence_parallel, sizes_in_code(tp.head_attrs, tp.fused))


def trace_for_plan(
    user: Any,
    spec: ModelFile,
    layout: Layout,
    seed: int,
    example: tuple[torch.Tensor, ...],
    log: Callable[[str], None] = lambda _: None,
    device_type: str = "cuda",
    meta_model: nn.Module | None = None,
    ahead: Traced | None = None,
    repeats: bool = False,
) -> tuple[fx.GraphModule, dict[fx.Node, Any], str]:
    """Trace the model on the meta device for a run of the plan on `device_type`, and check that the graph is
    one the plan's stages, TP and experts can be cut from (loop.trace_and_cut cuts it; so does the plan-time
    check). `meta_model`: the model already built on meta (the plan-time check's), else it is built here;
    `ahead`: its trace made before, where one was (`trace`); `repeats`: see `trace` (the check's)."""
    if meta_model is None:
        meta_model = build_model(user, spec, seed, everything_on_meta=True)
    inputs = tuple(t.to("meta") for t in example[: input_count(meta_model, len(example))])
    # The experts modules stay calls in the graph: expert parallelism swaps each for this rank's slice after
    # the cut, and without it they still run their own code on this rank's device (traced on meta, their
    # code takes the GPU's path: transformers' grouped-mm experts count tokens with an int32 histc).
    leaves = frozenset(layout.experts)
    # The TP plan's modules stay calls too, as in the model as written: fx would inline HF's Conv1D (an addmm on
    # its weight, which the script swaps for parallel.ShardedConv1D) and an nn.Embedding subclass (Gemma's and
    # BART's scaled embeddings), which torch's parallel styles then could not shard. torch.export keeps only the
    # experts (one shape each).
    tp = layout.tp_plan
    convs = frozenset(tp.styles) | frozenset(tp.transposed) if layout.tp_enabled else frozenset()
    gm, values, method = trace(meta_model, inputs, log, leaves, ahead, fx_leaves=convs, repeats=repeats)
    why = unsupported_on(gm, values, device_type)
    if why is not None:
        raise RefusedLayout(
            f"A pipeline cannot run this model on the {device_type.upper()}: {why}. Re-plan with pp=1 (the model "
            "as written runs the CPU's own path), or run on GPUs."
        )
    called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    missing = sorted(leaves - called)
    if missing:
        raise RunError(
            f"EXPERTS names modules the traced graph does not call as modules: {missing[:5]}; a traced stage "
            "calls each experts module as a module (expert parallelism swaps it for its slice). Re-plan the model."
        )
    # Head counts and split widths baked into the graph (by either fx trace) are made this rank's after the
    # trace (tp_graph.localise_tp_sizes); torch.export's graph has every op lowered and every shape fixed.
    if layout.tp_enabled and method == "export" and layout.pp == 1 and not layout.sp_enabled:
        raise AsWritten(
            "only torch.export could trace the model: tensor parallelism runs the model as written, its head "
            "attributes divided by tp"
        )
    if layout.tp_enabled and method == "export":
        raise RefusedLayout(
            "Tensor parallelism in a traced stage needs a graph whose shapes follow each rank's shard, but only "
            "torch.export could trace the model, which fixes every shape in the graph (its Python reads "
            "values). Make forward() traceable by torch.fx or re-plan with tp=1 (or pp=1 without sequence "
            "parallelism: the model as written is sharded)."
        )
    if method == "fx":  # (a graph specialised to its inputs may name a tied module under another holder's name)
        known = {n for n, _ in gm.named_modules()} | {n for n, _ in gm.named_parameters()}
        unknown = [m for s in layout.stages for m in s.modules if m not in known]
        unknown += [n for n in layout.tp_plan.styles if n not in known]
        if unknown:
            raise RunError(f"The plan names modules the model lacks: {unknown[:5]}. Re-plan the model.")
    return gm, values, method
