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
import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.fx.node import Argument, map_aggregate
from torch.utils import _pytree as pytree
from torch.utils._device import _device_constructors

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


class BufferTracer(fx.Tracer):
    """torch.fx's tracer, recording buffers as get_attr nodes like parameters (by default a buffer's value
    would be frozen into the graph as a constant: here, a meta tensor with no data), with a tensor-name cache.

    The stock tracer looks up every tensor attribute it meets (a rotary table read in each block) by walking
    all of the model's parameters and buffers, which is quadratic in depth: minutes for an 80-layer model.
    """

    proxy_buffer_attributes = True

    def __init__(self, leaves: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.leaves = leaves  # qualified names of modules kept as one call (expert-parallel experts)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves:
            return True
        # torch.fx keeps every torch.nn module as one call; PyTorch's own transformer containers hold layers
        # (units to cut between) and Linears (tensor-parallel pairs), so they are traced through.
        if isinstance(m, TRACED_THROUGH):
            return False
        if is_ssm_mixer(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self._names: dict[int, str] = {}
        if isinstance(root, nn.Module):
            for n, b in root.named_buffers():
                self._names.setdefault(id(b), n)
            for n, p in root.named_parameters():
                self._names.setdefault(id(p), n)
        return super().trace(root, concrete_args)

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


class MetaProxy(fx.Proxy):
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

    def __init__(self, inputs: tuple[torch.Tensor, ...], leaves: frozenset[str] = frozenset()) -> None:
        super().__init__(leaves)
        self.inputs = inputs
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


def meta_trace(model: nn.Module, inputs: tuple[torch.Tensor, ...], leaves: frozenset[str] = frozenset()) -> fx.Graph:
    """The graph of ``model(*inputs)`` (meta tensors), traced with meta values; raises (MetaTraceError, or the
    error of the op whose meta value cannot be computed) where it cannot follow the model."""
    tracer = MetaTracer(tuple(inputs), leaves)
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
