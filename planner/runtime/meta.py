"""Running on the meta device without importing torch._dynamo.

In torch 2.13 the meta kernels of elementwise ops (``a + b`` on meta tensors) are Python references wrapped
in ``torch._disable_dynamo``, whose first call imports torch._dynamo (and with it sympy and the compiler
stack: about as long as importing torch itself) only to wrap the function in ``torch._dynamo.disable``.
That wrapper turns off dynamo's frame hook for the call; while torch._dynamo has never been imported no
such hook can be installed, so calling the function directly is the same call. ``meta_without_dynamo``
gives each wrapped meta kernel that behaviour: direct while torch._dynamo is absent, and torch's own
``torch._dynamo.disable`` wrapper (built as torch builds it, then kept) from the first call after anything
imported torch._dynamo.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

_DONE = False
_KERNEL_MODULES = ("torch._refs", "torch._decomp", "torch._prims", "torch._meta_registrations")


class _DisableUnlessDynamo:
    """What ``torch._disable_dynamo`` caches on a function: call it directly while torch._dynamo is not
    imported, else through ``torch._dynamo.disable`` as torch would."""

    def __init__(self, fn: Callable[..., Any], recursive: bool) -> None:
        self.fn = fn
        self.recursive = recursive
        self.disabled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.disabled is None:
            if "torch._dynamo" not in sys.modules:
                return self.fn(*args, **kwargs)
            import torch._dynamo

            self.disabled = torch._dynamo.disable(self.fn, self.recursive, wrapping=False)
        return self.disabled(*args, **kwargs)


def _wrapped(fn: Any, depth: int = 6) -> Iterator[Any]:
    """``fn`` and the functions it wraps: functools.wraps' ``__wrapped__`` and functions held in its closure
    (torch's wrappers do not always keep ``__wrapped__``), ``depth`` levels down."""
    stack, seen = [(fn, 0)], set()
    while stack:
        f, level = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        yield f
        if level == depth:
            continue
        inner = [getattr(f, "__wrapped__", None)] + [c.cell_contents for c in getattr(f, "__closure__", None) or ()]
        stack.extend((g, level + 1) for g in inner if callable(g) and hasattr(g, "__code__"))


def meta_without_dynamo(*functions: Callable[..., Any]) -> int:
    """Give every ``torch._disable_dynamo``-wrapped decomposition (the meta kernels among them), and each of
    ``functions`` (e.g. a TorchDispatchMode subclass's ``__torch_dispatch__``, which torch wraps when the
    class is created), the cached disable that imports nothing; returns how many functions it set. The
    module scan runs once; nothing is done once torch._dynamo is imported (torch's own path is then cheap)."""
    global _DONE
    if "torch._dynamo" in sys.modules:
        return 0
    import torch._compile

    code = torch._compile._disable_dynamo(lambda: None).__code__  # the `inner` that imports torch._dynamo
    count = 0
    kernels: list[Any] = list(functions)
    if not _DONE:
        # The Python references and decompositions torch registers as meta kernels live in these modules.
        modules = [m for n, m in list(sys.modules.items()) if m is not None and n.startswith(_KERNEL_MODULES)]
        kernels += [k for m in modules for k in list(vars(m).values()) if callable(k)]
    for kernel in kernels:
        for f in _wrapped(kernel):
            if getattr(f, "__code__", None) is not code or not f.__closure__:
                continue
            cells = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__)))
            target = cells.get("fn")
            if target is not None and getattr(target, "__dynamo_disable", None) is None:
                target.__dynamo_disable = _DisableUnlessDynamo(target, bool(cells.get("recursive", True)))
                count += 1
    _DONE = True
    return count


@contextlib.contextmanager
def dtensor_on_meta() -> Iterator[None]:
    """DTensor on meta tensors without importing torch._dynamo, and without a fake mode per op, for the
    plan-time TP check.

    Two calls of DTensor import torch._dynamo on first use: its ``__init__`` (a ``torch._disable_dynamo``
    wrapper, answered as the meta kernels' are) and the sharding propagator, which derives each op's global
    output shape under a new ``FakeTensorMode`` (whose constructor reads torch._dynamo.config). Inside this
    context the propagator derives it on the meta device instead: the same meta kernels a FakeTensorMode
    runs, on empty tensors of the global shapes, strides and dtypes. It does so also where torch._dynamo is
    imported already (transformers imports it): the fake mode adds nothing on meta but its cost, and it logs
    each failing op with a traceback on stderr, where a shard the check refuses must leave one message."""
    from torch.distributed.tensor import DTensor

    meta_without_dynamo(DTensor.__init__)  # nothing to do once torch._dynamo is imported
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_non_cached = _tensor_meta_on_meta  # type: ignore[method-assign]  # undone below
    try:
        yield
    finally:
        del propagator._propagate_tensor_meta_non_cached


def _tensor_meta_on_meta(op_schema: Any) -> Any:
    """torch's ShardingPropagator._propagate_tensor_meta_non_cached (torch 2.13), run on meta tensors."""
    import torch
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.utils._pytree import tree_map_only

    if op_schema.op == torch.ops.aten.equal.default:
        return None  # data dependent: no shape to propagate (as torch)

    def empty(spec: DTensorSpec) -> torch.Tensor:
        meta = spec.tensor_meta
        if meta is None:
            raise AssertionError("DTensorSpec does not contain tensor_meta.")
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")

    def leaf(x: Any) -> bool:
        return isinstance(x, DTensorSpec)

    args = tree_map_only(DTensorSpec, empty, op_schema.args_schema, is_leaf=leaf)
    kwargs = tree_map_only(DTensorSpec, empty, op_schema.kwargs_schema, is_leaf=leaf)
    out = op_schema.op(*args, **kwargs)

    def tensor_meta(t: Any) -> TensorMeta | None:
        return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype) if isinstance(t, torch.Tensor) else None

    if isinstance(out, torch.Tensor):
        return tensor_meta(out)
    if isinstance(out, (tuple, list)):
        metas = [tensor_meta(t) for t in out]
        return tuple(metas) if isinstance(out, tuple) else metas
    return None
