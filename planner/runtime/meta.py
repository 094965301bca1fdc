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
