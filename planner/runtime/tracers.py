"""The torch.fx tracers: BufferTracer (parameters and buffers read by name), and symbolic tracing with a meta
value beside every proxy (MetaTracer, meta_trace): the tracer for models whose Python reads shapes
(`if mask.ndim == 2`, `batch, seq = x.shape`), as Hugging Face transformers' models do.

Plain symbolic tracing cannot answer a question about a proxy's shape, dtype or device, so it fails on such
code; torch.export answers them with fake tensors, at about a millisecond per op (6 s for a 96-layer T5 on
meta). This tracer runs each op it records on the meta values of its arguments as well (leaf modules too), so
a proxy knows its value's metadata: `x.shape`, `x.size()`, `x.dim()`, `x.dtype`, `x.device` and Python
branches on them are answered concretely, as torch.export answers them, and the graph is specialised to the
example inputs' shapes, as torch.export's is. Values stay unknown: a branch on a tensor's contents (`.item()`,
`if mask.all()`) fails on meta, and the caller falls back to torch.export. The graph keeps torch's functions and
the model's leaf modules (nn.Linear, ...), as plain symbolic tracing does, so module names and tensor-parallel
pairs read from it as from any fx graph. Model code asking `is_tracing(x)` sees an fx proxy and takes its
tracing path (transformers skips its data-dependent shortcuts there).

Tensor factories called with concrete sizes (`torch.arange(seq_len)`) would run once, on meta, and be baked
into the graph as constants without values; they are recorded as calls instead, and any other meta tensor
that would become a constant fails the trace. Each op's meta kernel runs under MetaMemo, so identical blocks
pay for one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.fx.node import Argument, map_aggregate
from torch.utils import _pytree as pytree
from torch.utils._device import _device_constructors

from .linears import computes_linear
from .memo import MetaMemo
from .scans import is_ssm_mixer

# Tensor metadata a proxy answers from its meta value (attributes, and methods called with their arguments).
_META_ATTRS = frozenset(
    {"shape", "ndim", "dtype", "device", "is_cuda", "is_meta", "is_cpu", "layout", "is_sparse", "is_quantized",
     "is_nested"}
)
_META_METHODS = frozenset(
    {"size", "dim", "ndimension", "is_floating_point", "is_complex", "numel", "nelement", "get_device",
     "element_size", "is_contiguous", "stride"}
)
# torch functions that make a tensor from Python numbers: recorded as calls (not run and baked in as constants).
FACTORIES = (
    "arange", "zeros", "ones", "full", "empty", "empty_strided", "eye", "tensor", "as_tensor", "linspace",
    "logspace", "rand", "randn", "randint", "randperm", "zeros_like", "ones_like", "full_like", "empty_like",
    "rand_like", "randn_like", "randint_like", "scalar_tensor",
)


_FACTORY_FUNCTIONS = frozenset(getattr(torch, n) for n in FACTORIES if hasattr(torch, n))


class MetaTraceError(RuntimeError):
    """The model cannot be traced with meta values (the caller falls back to torch.export)."""


# torch.nn modules traced as containers, not as one call (the MultiheadAttention inside each layer stays one).
TRACED_THROUGH = (nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                  nn.Transformer)


# node.meta key set on an operator.add (sub, mul, truediv) node that the model's code wrote in place (`out += x`)
IN_PLACE = "planner_in_place"


class InPlaceProxy(fx.Proxy):
    """fx's proxy, remembering where the model wrote an arithmetic update in place: fx has no in-place operators,
    so Python runs `out += x` as `out = out + x`, recorded as operator.add; that node is marked (node.meta[IN_PLACE])
    and the graph is the same. Tensor parallelism reads the mark (planner.model.tp: a row-parallel output the model
    changes in place is given as a copy when the model runs as written)."""

    def _in_place(self, op: Callable[[Any, Any], Any], other: Any) -> Any:
        out = op(self, other)
        if isinstance(out, fx.Proxy):
            out.node.meta[IN_PLACE] = True
        return out

    def __iadd__(self, other: Any) -> Any:
        return self._in_place(operator.add, other)

    def __isub__(self, other: Any) -> Any:
        return self._in_place(operator.sub, other)

    def __imul__(self, other: Any) -> Any:
        return self._in_place(operator.mul, other)

    def __itruediv__(self, other: Any) -> Any:
        return self._in_place(operator.truediv, other)


class BufferTracer(fx.Tracer):
    """torch.fx's tracer, recording buffers as get_attr nodes like parameters (by default a buffer's value
    would be frozen into the graph as a constant: here, a meta tensor with no data), with a tensor-name cache.

    The stock tracer looks up every tensor attribute it meets (a rotary table read in each block) by walking
    all of the model's parameters and buffers, which is quadratic in depth: minutes for an 80-layer model.
    """

    proxy_buffer_attributes = True

    def __init__(
        self, leaves: frozenset[str] = frozenset(), repeats: bool = False, fold: frozenset[str] = frozenset()
    ) -> None:
        super().__init__()
        self.leaves = leaves  # qualified names of modules kept as one call (expert-parallel experts)
        self.repeats = repeats  # trace each kind of repeated block once and replay it (RepeatedBlocks)
        self.fold = fold  # blocks whose repeats are kept as one call each instead of replayed (_Recording.fold)
        self._blocks: RepeatedBlocks | None = None
        self._linears: frozenset[int] | None = None  # ids of the root's Linear subclasses kept as calls

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return InPlaceProxy(node, self)

    def scan_linears(self, root: nn.Module) -> None:
        """Find the root's nn.Linear subclasses whose own forward computes the linear map (`computes_linear`),
        before anything records torch's calls: the comparison runs torch ops, which a trace would record."""
        self._linears = frozenset(
            id(m) for m in root.modules()
            if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward and computes_linear(m)
        )

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves:
            return True
        # torch.fx keeps every torch.nn module as one call; PyTorch's own transformer containers hold layers
        # (units to cut between) and Linears (tensor-parallel pairs), so they are traced through.
        if isinstance(m, TRACED_THROUGH):
            return False
        if is_ssm_mixer(m):
            return True
        # an nn.Linear subclass defined outside torch.nn whose own forward computes the linear map (Falcon's
        # FalconLinear): one call, as nn.Linear is, so tensor parallelism pairs it
        if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward:
            if computes_linear(m) if self._linears is None else id(m) in self._linears:
                return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self._names: dict[int, str] = {}
        if isinstance(root, nn.Module):
            for n, b in root.named_buffers():
                self._names.setdefault(id(b), n)
            for n, p in root.named_parameters():
                self._names.setdefault(id(p), n)
        self._blocks = RepeatedBlocks(root, self.leaves) if self.repeats and isinstance(root, nn.Module) else None
        if self._linears is None and isinstance(root, nn.Module):
            self.scan_linears(root)
        return super().trace(root, concrete_args)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        blocks = self._blocks
        kind = blocks.kinds.get(id(m)) if blocks is not None else None
        if blocks is None or kind is None:
            return super().call_module(m, forward, args, kwargs)
        path = self.path_of_module(m)
        try:
            key = (kind, self._call_key(args, kwargs))
        except _Unkeyable:
            return super().call_module(m, forward, args, kwargs)
        if self.num_calls.get(path, 0) != 0:  # a block called again: its module stack keys differ
            return super().call_module(m, forward, args, kwargs)
        recorded = blocks.recorded.get(key)
        if recorded is not None:
            if path in self.fold and path not in blocks.last and recorded.access is not None:
                return recorded.fold(self, path, type(m), args, kwargs)
            return recorded.replay(self, path, args, kwargs)
        before, calls, depth = len(self.graph.nodes), dict(self.num_calls), len(self.module_stack)
        out = super().call_module(m, forward, args, kwargs)
        with contextlib.suppress(_Unkeyable):
            recording = _Recording(self, path, args, kwargs, out, len(self.graph.nodes) - before, calls, depth)
            blocks.recorded[key] = recording
        return out

    def _call_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What a block's tracing depends on in its call arguments: their structure, plain values by value,
        which arguments are the same proxy, and (MetaTracer) each proxy's meta value."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        first: dict[fx.Node, int] = {}
        key: list[Any] = [repr(spec)]
        for leaf in leaves:
            if isinstance(leaf, fx.Proxy):
                key.append(("proxy", first.setdefault(leaf.node, len(first)), self._proxy_key(leaf)))
            elif isinstance(leaf, torch.Tensor):
                key.append(("tensor", id(leaf)))  # a model's own tensor, read by name (create_arg)
            else:
                key.append(_plain_key(leaf))
        return tuple(key)

    def _proxy_key(self, proxy: fx.Proxy) -> Any:
        """A plain symbolic trace cannot depend on a proxy's value (asking for it fails the trace)."""
        return None

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            name = self._names.get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """A module's parameter or buffer read in forward (`self.weight` of a norm): found by name, not by
        walking all of the model's parameters (fx's own lookup, quadratic in depth)."""
        name = self._names.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


class MetaProxy(InPlaceProxy):
    """A proxy holding the meta value of what it stands for (``value``). Truth, length, iteration and keys are
    the value's (fx's Proxy would ask the tracer, which refuses)."""

    value: Any = None

    def __getattr__(self, k: str) -> Any:
        value = self.__dict__.get("value")
        if isinstance(value, torch.Tensor):
            if k in _META_ATTRS or k in _META_METHODS:
                return getattr(value, k)
            if not k.startswith("_") and not callable(getattr(type(value), k, None)) and hasattr(value, k):
                # A data attribute (`w.T`, `x.mT`, `z.real`, `x.requires_grad`): recorded as getattr now, with its
                # meta value. fx's lazy Attribute would hold none (it is made a node only when used), and a
                # method (`x.view`) stays one, to become a call_method node when it is called.
                return self.tracer.create_proxy("call_function", getattr, (self, k), {})
        return super().__getattr__(k)

    def __len__(self) -> int:
        return len(self.value)

    def __iter__(self) -> Iterator[Any]:
        return iter([operator.getitem(self, i) for i in range(len(self.value))])

    def __bool__(self) -> bool:
        return bool(self.value)

    def __contains__(self, k: Any) -> bool:
        return k in self.value

    def __setitem__(self, key: Any, value: Any) -> None:
        # An item assignment (transformers' experts: `inv_perm[perm] = arange(...)`) is recorded as a call, and
        # made on the meta value too.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def keys(self) -> Any:
        return self.value.keys()


def _value(a: Any) -> Any:
    return a.value if isinstance(a, fx.Proxy) else a


class MetaTracer(BufferTracer):
    """Symbolic tracing of ``root.forward(*inputs)`` (meta tensors) that keeps each proxy's meta value; as
    BufferTracer, parameters and buffers are read by name and ``leaves`` are kept as calls."""

    def __init__(
        self, inputs: tuple[torch.Tensor, ...], leaves: frozenset[str] = frozenset(),
        shaped: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(leaves | shaped)
        self.inputs = inputs
        self.shaped = shaped  # leaves whose meta value is their first input's shape, not their code's
        self.running = False  # computing a meta value: module calls and attributes are plain Python again
        self.names: list[str] = []  # the placeholders'
        self.out_spec: pytree.TreeSpec = pytree.tree_structure(None)

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        """One placeholder per example input, named as forward's parameters: forward is called with them and
        its other parameters take their defaults (transformers' decorated forwards take **kwargs, which plain
        tracing cannot patch)."""
        params = list(inspect.signature(inspect.unwrap(root_fn)).parameters)[1:]
        self.names = params[: len(self.inputs)] + [f"input_{i}" for i in range(len(params), len(self.inputs))]

        def flat(*args: Any) -> Any:
            # The output's leaves, as torch.export returns them (a pipeline's last stage sends tensors; the
            # structure, a ModelOutput for transformers, is the graph module's out_spec).
            leaves, self.out_spec = pytree.tree_flatten(root_fn(*args))
            return leaves[0] if self.out_spec.is_leaf() else tuple(leaves)

        return flat, [self.root, *(self.create_proxy("placeholder", n, (), {}) for n in self.names)]

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return MetaProxy(node, self)

    def _proxy_key(self, proxy: fx.Proxy) -> Any:
        """The meta value a block's Python may read (shapes, dtypes, devices): tensors by metadata."""
        value = getattr(proxy, "value", None)
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and type(value) is not nn.Parameter:
                raise _Unkeyable
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type, value.requires_grad)
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(_plain_key(v) for v in value))
        return _plain_key(value)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.running:
            return forward(*args, **kwargs)
        try:
            self.path_of_module(m)
        except NameError:  # a module made on the fly (not one of the model's): traced through
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self.running:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_arg(self, a: Any) -> Argument:
        if isinstance(a, torch.Tensor) and id(a) not in self._names:
            if a.is_meta:
                raise MetaTraceError(
                    f"a tensor of shape {tuple(a.shape)} made without a traced input would be baked into the graph "
                    "as a constant"
                )
        arg: Argument = super().create_arg(a)
        return arg

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
        proxy_factory_fn: Callable[[fx.Node], fx.Proxy] | None = None,
    ) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind == "placeholder":
            index = sum(1 for n in self.graph.nodes if n.op == "placeholder") - 1
            value = self.inputs[index]
        else:
            self.running = True
            try:
                value = self._run(kind, target, map_aggregate(args, _value), map_aggregate(kwargs, _value))
            finally:
                self.running = False
        proxy.value = value  # type: ignore[attr-defined]
        return proxy

    def _run(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        if kind == "get_attr":
            value = self.root
            for part in target.split("."):
                value = getattr(value, part)
            return value
        if kind == "call_function":
            if target in _FACTORY_FUNCTIONS:
                # A factory's meta value on meta where no device is given: no memory, no value to branch on.
                with torch.device("meta"):
                    return target(*args, **kwargs)
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            if target in self.shaped:
                first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                return torch.empty_like(first)
            return self.root.get_submodule(target)(*args, **kwargs)
        return None


@contextlib.contextmanager
def _recorded_factories(tracer: MetaTracer) -> Iterator[None]:
    """torch's tensor factories recorded as graph calls while tracing (run as they are for meta values)."""
    saved = {n: getattr(torch, n) for n in FACTORIES if hasattr(torch, n)}
    # torch.device("meta") as a context (how `_run` makes a factory's meta value) recognises factories by
    # identity, from a set it builds on first use: built while these are replaced, it would hold the stand-ins,
    # and torch.tensor(3) in that context would make a CPU tensor (a value a branch could read) in any process
    # that had not used a device context before.
    _device_constructors()

    def recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if tracer.running:  # inside an op run for its meta value: its meta value too
                return tracer._run("call_function", fn, args, kwargs)
            return tracer.create_proxy("call_function", fn, args, kwargs)

        return factory

    for n, fn in saved.items():
        setattr(torch, n, recorded(fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)


def meta_trace(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], leaves: frozenset[str] = frozenset(), repeats: bool = False,
    shaped: frozenset[str] = frozenset(), fold: frozenset[str] = frozenset(),
) -> fx.Graph:
    """The graph of ``model(*inputs)`` (meta tensors), traced with meta values; raises (MetaTraceError, or the
    error of the op whose meta value cannot be computed) where it cannot follow the model. `repeats`: each kind
    of repeated block traced once and replayed for the others (RepeatedBlocks); `fold`: of those, the blocks
    whose repeats are kept as one call each instead (the analysis': `_Recording.fold`). `shaped`: modules kept as
    calls whose meta value is a tensor like their first tensor input, without running their code (the runtime's
    experts, whose code takes the GPU's path on meta: transformers' grouped_mm wants bf16 there)."""
    tracer = MetaTracer(tuple(inputs), leaves, shaped)
    tracer.repeats = repeats
    tracer.fold = fold
    tracer.scan_linears(model)
    with MetaMemo(), _recorded_factories(tracer):
        graph = tracer.trace(model)
    # A weight read only for its metadata (`self.wo.weight.dtype`, answered from its meta value) left a
    # get_attr that nothing uses.
    for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
        graph.erase_node(node)
    if not tracer.out_spec.is_leaf():
        in_spec = pytree.tree_structure(tuple(range(len(tracer.names))))
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(list(tracer.names), in_spec, tracer.out_spec))
    return graph


class _Unkeyable(Exception):
    """A call argument or output a block's replay cannot describe or rebuild: the block is traced."""


_PLAIN = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _plain_key(v: Any) -> Any:
    if type(v) in _PLAIN:
        return (type(v), v)
    if type(v) is float:
        return (float, repr(v))
    raise _Unkeyable


# Set (True) on a forward hook that does nothing when called on fx proxies (the planner's one-shot input checks):
# a block holding it can still be replayed. Any other hook makes its block traced.
TRACE_NEUTRAL = "planner_trace_neutral"

# On a folded block's call_module node (`_Recording.fold`): (its path, the path of the block it repeats, the meta
# values it returns or None).
FOLDED = "planner_folded"

FOLD_MADE = "planner_fold_made"  # on every node a fold made (its call, outputs and stand-in arguments)

# Integer attributes that hold a block's own index (transformers' `layer_idx`, used to index a KV cache that
# training does not keep): left out of a block's description where they equal its position in its container.
_INDEX_NAMES = ("idx", "index", "layer_id")


class RepeatedBlocks:
    """The analysis' tracing of repeated blocks (the 80 decoder layers of Llama-3-70B): each block of a container
    (ModuleList, Sequential, ModuleDict) whose siblings include one described alike is a candidate. The first
    call of each kind with given arguments is traced, and its nodes recorded; a later block of the same kind
    called with arguments of the same structure, plain values, proxy identities and meta values replays them:
    the same nodes, its own parameters and modules as targets, its own module stack, in the order a trace would
    create them (so the node names are a trace's too). Tracing a block depends on the block's code, its
    attributes and its arguments' metadata, which is what the description and the key hold, with one assumption:
    an integer attribute named like an index that equals the block's position (transformers' `layer_idx`) is
    not read by forward (it indexes a KV cache, off in training). Where it is (GPT-2 with
    scale_attn_by_inverse_layer_idx scales by it), the replayed graph carries the first block's constant, which
    changes no count. Used for the planner's analysis only: the runtime traces every block."""

    def __init__(self, root: nn.Module, leaves: frozenset[str]) -> None:
        self.kinds: dict[int, Any] = {}  # id(block) -> its description
        self.recorded: dict[Any, _Recording] = {}
        # The last block of each container: never folded (the model's own ops after a stack of blocks, CLIP's
        # pooling slice of the last hidden state, join its unit, which then differs from the block it repeats)
        self.last: set[str] = set()
        containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
        for name, mod in root.named_modules():
            if not isinstance(mod, containers):
                continue
            described: dict[int, Any] = {}
            for position, (child_name, child) in enumerate(mod.named_children()):
                prefix = f"{name}.{child_name}" if name else child_name
                if position == len(mod) - 1:
                    self.last.add(prefix)
                with contextlib.suppress(Exception):  # a module whose repr or attributes fail: traced
                    described[id(child)] = describe_block(child, position, prefix, leaves)
            counts: dict[Any, int] = {}
            for d in described.values():
                counts[d] = counts.get(d, 0) + 1
            self.kinds.update((i, d) for i, d in described.items() if counts[d] > 1)


def describe_block(
    block: nn.Module,
    position: int | None,
    prefix: str = "",
    leaves: frozenset[str] = frozenset(),
    neutral: Callable[[Any], bool] | None = None,
) -> Any:
    """What tracing a block depends on besides its arguments: every submodule's type, attributes (plain values by
    value, other objects by identity: a config shared by all blocks is one object), parameters and buffers
    (shapes, dtypes, whether trained), hooks, and which are kept as calls. An integer attribute named like an
    index is left out where it equals `position` (the block's index in its container; None: any value).
    `neutral`: hooks the caller knows record nothing (besides those marked TRACE_NEUTRAL)."""
    items: list[Any] = [repr(block)]
    for name, sub in block.named_modules():
        hooks = (*sub._forward_hooks.values(), *sub._forward_pre_hooks.values())
        if not all(getattr(h, TRACE_NEUTRAL, False) or (neutral is not None and neutral(h)) for h in hooks):
            raise _Unkeyable  # a hook may record each call (the replay would not run it)
        attrs: list[tuple[Any, ...]] = []
        for k, v in vars(sub).items():
            if k.startswith("_") or k == "forward":  # an instance forward: activation checkpointing's wrapper
                continue
            if type(v) is int and position in (None, v) and any(w in k.lower() for w in _INDEX_NAMES):
                continue
            attrs.append((k, _attribute_key(v)))
        tensors: list[tuple[Any, ...]] = [
            (n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in sub.named_parameters(recurse=False)
        ]
        tensors += [(n, tuple(t.shape), t.dtype) for n, t in sub.named_buffers(recurse=False)]
        kept = (f"{prefix}.{name}" if name else prefix) in leaves  # kept as one call
        items.append((name, type(sub), tuple(attrs), tuple(tensors), kept))
    return tuple(items)


def _attribute_key(v: Any) -> Any:
    """A block's attribute: plain values by value, containers by their items, a partial function (transformers'
    GELUTanh makes its own `partial(gelu, approximate="tanh")`) by its function and arguments, a method of one
    of the block's modules by its function, anything else by identity."""
    try:
        return _plain_key(v)
    except _Unkeyable:
        pass
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_attribute_key(x) for x in v))
    if isinstance(v, functools.partial):
        keywords = tuple(sorted((k, _attribute_key(x)) for k, x in v.keywords.items()))
        return ("partial", _attribute_key(v.func), tuple(_attribute_key(x) for x in v.args), keywords)
    if isinstance(v, types.MethodType) and isinstance(v.__self__, nn.Module):
        return ("method", type(v.__self__), v.__func__)
    return ("object", type(v), id(v))


class _Recording:
    """The nodes one block's traced call created, what they read from its arguments, and what it returned."""

    def __init__(
        self,
        tracer: BufferTracer,
        path: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        count: int,
        calls_before: dict[str, int],
        depth: int,
    ) -> None:
        self.path, self.depth = path, depth
        flat = pytree.tree_flatten((args, kwargs))[0]
        self.arguments = [leaf.node if isinstance(leaf, fx.Proxy) else None for leaf in flat]
        nodes: list[fx.Node] = []
        for node in reversed(tracer.graph.nodes):
            if len(nodes) == count:
                break
            nodes.append(node)
        self.nodes = nodes[::-1]
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out: list[tuple[str, Any, Any]] = []  # ("node", node, meta value) or ("value", value, None)
        for leaf in leaves:
            if isinstance(leaf, fx.Proxy):
                self.out.append(("node", leaf.node, getattr(leaf, "value", None)))
            else:
                _plain_key(leaf)  # only plain values besides proxies
                self.out.append(("value", leaf, None))
        called = {k: n - calls_before.get(k, 0) for k, n in tracer.num_calls.items() if n != calls_before.get(k, 0)}
        if any(not (k == path or k.startswith(path + ".")) for k in called):
            raise _Unkeyable  # it called a module of the model's outside itself: a replay would not count that call
        self.calls = {k[len(path) :]: n for k, n in called.items()}
        self.inside = set(self.nodes)
        self.positions = {node: j for j, node in enumerate(self.arguments) if node is not None}
        foldable = _foldable(self.nodes, self.inside, self.arguments, self.out_spec, isinstance(tracer, MetaTracer))
        self.access: list[tuple[tuple[Any, Any], ...]] | None = foldable[0] if foldable is not None else None
        self.used: frozenset[int] | None = foldable[1] if foldable is not None else None

    def replay(self, tracer: BufferTracer, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The recorded nodes again for the block at `path` called with `args` and `kwargs` (same key)."""
        old = self.path

        def rename(name: str) -> str:
            inside = name == old or name.startswith((old + ".", old + "@"))
            return path + name[len(old) :] if inside else name

        outer = list(tracer.module_stack.items())  # the modules this call is made in (the recording's may differ)

        env: dict[fx.Node, fx.Node] = {}
        for node, leaf in zip(self.arguments, pytree.tree_flatten((args, kwargs))[0], strict=True):
            if node is not None:
                env[node] = leaf.node
        graph = tracer.graph
        for node in self.nodes:
            target = node.target
            if isinstance(target, str) and node.op in ("get_attr", "call_module"):
                target = rename(target)
            new = graph.create_node(
                node.op,
                target,
                fx.node.map_arg(node.args, lambda a: env.get(a, a)),
                fx.node.map_arg(node.kwargs, lambda a: env.get(a, a)),
                None,
                node.type,
            )
            if node.meta.get(IN_PLACE):
                new.meta[IN_PLACE] = True
            if FOLD_MADE in node.meta:  # a block folded inside the recorded one: folded here too, renamed
                new.meta[FOLD_MADE] = True
            if FOLDED in node.meta:
                own, template, values = node.meta[FOLDED]
                new.meta[FOLDED] = (rename(own), rename(template), values)
            stack = node.meta.get("nn_module_stack")
            if stack is not None:
                new.meta["nn_module_stack"] = type(stack)(
                    outer + [(rename(k), (rename(q), t)) for k, (q, t) in list(stack.items())[self.depth :]]
                )
            scope = tracer.node_name_to_scope.get(node.name)
            if scope is not None:
                tracer.node_name_to_scope[new.name] = (rename(scope[0]), scope[1])
            env[node] = new
        for rel, n in self.calls.items():
            tracer.num_calls[path + rel] = tracer.num_calls.get(path + rel, 0) + n
        leaves = []
        for kind, v, value in self.out:
            if kind == "value":
                leaves.append(v)
                continue
            proxy = tracer.proxy(env.get(v, v))
            if value is not None:
                proxy.value = value  # type: ignore[attr-defined]
            leaves.append(proxy)
        return pytree.tree_unflatten(leaves, self.out_spec)

    def fold(self, tracer: BufferTracer, path: str, kind: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The block at `path` (same key) as one call_module node, and a getitem/getattr node per tensor it
        returns, on the block's module stack with the recorded meta values: what a leaf module's call records.
        For the analysis only (`BufferTracer.fold`): it counts and shards the first block of each kind (traced)
        and reads only a repeat's inputs and outputs from the graph, so a repeat's hundreds of nodes need not
        exist (DeepSeek-V3's 58 MoE layers: 20,000 nodes, ~0.5 s to make and split). The call takes what the
        traced block's nodes read: an argument they do not read (transformers' position_ids, passed to every
        decoder layer for a KV cache) is made inside the unit as an empty meta tensor like it (a unit's inputs
        are what its nodes read), and a value the block returns unchanged is the caller's own."""
        assert self.access is not None and self.used is not None
        flat, spec = pytree.tree_flatten((args, kwargs))
        tracer.module_stack[path] = (path, kind)  # as fx's call_module (the first call: the path is the key)
        made: list[fx.Node] = []
        try:
            passed = []
            for j, leaf in enumerate(flat):
                if j in self.used or not isinstance(leaf, fx.Proxy):
                    passed.append(leaf)
                    continue
                value = leaf.value  # (a MetaProxy: `used` has every proxy without a value)
                if not isinstance(value, torch.Tensor):
                    passed.append(value)
                    continue
                layout = (tuple(value.shape), tuple(value.stride()))
                made.append(tracer.create_node(
                    "call_function", _EMPTY_STRIDED, layout, {"dtype": value.dtype, "device": torch.device("meta")}
                ))
                passed.append(tracer.proxy(made[-1]))
            call_args, call_kwargs = pytree.tree_unflatten(passed, spec)
            call = tracer.create_node("call_module", path, tracer.create_arg(call_args), tracer.create_arg(call_kwargs))
            made.append(call)
            # what the analysis reads back (grouping.run_units_once): the block it repeats, and the meta values
            # the call returns (None without them: a plain symbolic trace runs the block)
            outs = [value if what == "node" else v for what, v, value in self.out]
            known = isinstance(tracer, MetaTracer) and all(
                value is not None for what, _, value in self.out if what == "node"
            )
            call.meta[FOLDED] = (path, self.path, pytree.tree_unflatten(outs, self.out_spec) if known else None)
            routes: dict[tuple[tuple[Any, Any], ...], fx.Node] = {(): call}
            leaves = []
            for (what, v, value), route in zip(self.out, self.access, strict=True):
                if what == "value":
                    leaves.append(v)
                    continue
                if v in self.positions:  # an argument returned as it came: the caller's value
                    leaves.append(flat[self.positions[v]])
                    continue
                if v.op == "get_attr" and v not in self.inside:  # a weight read before the block: the same node
                    leaves.append(tracer.proxy(v))
                    continue
                node = call
                for i in range(len(route)):
                    if route[: i + 1] not in routes:
                        fn, key = route[i]
                        routes[route[: i + 1]] = tracer.create_node("call_function", fn, (node, key), {})
                        made.append(routes[route[: i + 1]])
                    node = routes[route[: i + 1]]
                proxy = tracer.proxy(node)
                if value is not None:
                    proxy.value = value  # type: ignore[attr-defined]
                leaves.append(proxy)
        finally:
            tracer.module_stack.popitem(last=True)
        for node in made:
            tracer.node_name_to_scope[node.name] = (path, kind)
            node.meta[FOLD_MADE] = True
        for rel, n in self.calls.items():
            tracer.num_calls[path + rel] = tracer.num_calls.get(path + rel, 0) + n
        return pytree.tree_unflatten(leaves, self.out_spec)


_EMPTY_STRIDED = torch.empty_strided  # (the function itself: a trace records torch's factories by replacing them)


def _foldable(
    nodes: list[fx.Node], inside: set[fx.Node], arguments: list[fx.Node | None], out_spec: pytree.TreeSpec,
    values: bool,
) -> tuple[list[tuple[tuple[Any, Any], ...]], frozenset[int]] | None:
    """Where a recorded block's repeats can be kept as one call (`_Recording.fold`): how to reach each leaf it
    returns from the call's output (a route of getitem/getattr steps), and the positions of the arguments its
    nodes read. None where not (or where the block is one call already): a node of the block reads a value
    computed outside it that is not an argument
    (a tensor one block leaves on a shared module for the next: the call would hide that edge); the output's
    structure has no such routes; or, without meta values (`values`: a plain symbolic trace), an argument its
    nodes do not read (the call could not be given one like it)."""
    if len(nodes) == 1 and nodes[0].op == "call_module":
        return None  # a block kept as one call already (an nn.Embedding of a recommender's tables)
    given = {a for a in arguments if a is not None}
    read: set[fx.Node] = set()
    for node in nodes:
        for a in node.all_input_nodes:
            if a in given:
                read.add(a)
            elif a not in inside and a.op != "get_attr":
                return None
    used = frozenset(j for j, a in enumerate(arguments) if a is not None and a in read)
    if not values and read != given:
        return None
    try:
        count = out_spec.num_leaves
        routes = []
        for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(count)), out_spec))[0]:
            route: list[tuple[Any, Any]] = []
            for step in path:
                if isinstance(step, (pytree.SequenceKey, pytree.MappingKey)):
                    route.append((operator.getitem, step.idx if isinstance(step, pytree.SequenceKey) else step.key))
                elif isinstance(step, pytree.GetAttrKey):
                    route.append((getattr, step.name))
                else:
                    return None
            routes.append(tuple(route))
    except Exception:  # noqa: BLE001 - a structure without key paths: replayed
        return None
    return routes, used
