"""Running repeated identical work on the meta device once.

On meta an op computes no values: the metadata of what a functional op returns (shapes, strides, dtype) follows
from the op and its arguments' metadata alone, and meta kernels are slow Python (torch._refs / torch._prims), so
the 96 identical blocks of GPT-3 cost seconds where one block costs milliseconds. ``MetaMemo`` is a dispatch mode
that runs each distinct call of a functional ATen op on meta tensors once and answers a repeat with fresh tensors
of the recorded metadata. Under FakeTensorMode (the check's run of a model that branches on values unless it is
traced) it does the same for fake tensors on meta, building the fresh ones as the fake mode's own cache does,
with less work per op than the fake mode's dispatch.

What it leaves to the op itself: ops that write into an argument or return an alias of one (in-place, out=, views:
their results must be the argument's storage and autograd tracks them as such), ops whose output depends on values
(``item``, ``nonzero``), arguments it cannot describe exactly (another device, fake tensors holding a constant,
subclass tensors, conjugate or zero tensors, symbolic sizes, generators) and results it cannot rebuild exactly (a
storage offset, a larger storage). An op that fails is not recorded, so its repeat fails the same way. The mode
works below autograd: the fresh results get their gradient functions as the op's own would, and backward runs
once per distinct op too. One memo serves one run (one fake mode, or none).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._python_dispatch import TorchDispatchMode

from .meta import meta_without_dynamo

# Arguments and results kept as they are (immutable, compared by value; floats by repr so that -0.0 and nan key
# exactly).
_PLAIN = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_VALUE_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output})


class _Unkeyable(Exception):
    """An argument or result the memo cannot describe exactly: the op runs."""


def _functional(func: Any, known: dict[Any, bool]) -> bool:
    """Whether `func` is an ATen op that writes into no argument, returns no alias of one and whose output
    metadata does not depend on values."""
    if func not in known:
        schema = getattr(func, "_schema", None)
        known[func] = (
            isinstance(func, torch._ops.OpOverload)
            and func.namespace == "aten"
            and schema is not None
            and not schema.is_mutable
            and all(r.alias_info is None for r in schema.returns)
            and not _VALUE_TAGS.intersection(func.tags)
        )
    return known[func]


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """(shape, stride, storage offset, dtype, fake mode or None) of a meta tensor, or of a fake tensor on meta
    that holds no constant (a fake mode can compute with a constant's values, so its results are not metadata's)."""
    kind = type(t)
    if isinstance(t, FakeTensor):
        if kind is not FakeTensor or t.fake_device.type != "meta" or t.constant is not None:
            raise _Unkeyable
        if getattr(t, "real_tensor", None) is not None:
            raise _Unkeyable
        mode: FakeTensorMode | None = t.fake_mode
    elif (kind is torch.Tensor or kind is torch.nn.Parameter) and t.is_meta:
        mode = None
    else:
        raise _Unkeyable
    if t.layout is not torch.strided or t.is_conj() or t.is_neg() or t._is_zerotensor():
        raise _Unkeyable
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, mode)


def arg_key(v: Any) -> Any:
    """An exact, hashable description of an op's argument as far as a meta kernel can see it."""
    kind = type(v)
    if kind is torch.Tensor or kind is torch.nn.Parameter or kind is FakeTensor:
        return ("tensor", *_tensor_key(v))
    if kind in _PLAIN:
        return (kind, v)
    if kind is float or kind is complex:
        return (kind, repr(v))
    if kind is tuple or kind is list or kind is torch.Size:
        return (kind, tuple(arg_key(x) for x in v))
    if kind is dict:
        return (kind, tuple((k, arg_key(x)) for k, x in v.items()))
    raise _Unkeyable


def _spec(v: Any) -> Any:
    """How to rebuild a result: tensors by metadata (fresh storage, offset 0), plain values as they are."""
    kind = type(v)
    if kind is torch.Tensor or kind is FakeTensor:
        shape, stride, offset, dtype, mode = _tensor_key(v)
        if offset != 0 or any(type(s) is not int for s in shape):
            raise _Unkeyable
        return ("tensor", shape, stride, dtype, mode, v.untyped_storage().nbytes())
    if kind in _PLAIN or kind is float:
        return ("value", v)
    if kind is tuple or kind is list:
        return (kind, tuple(_spec(x) for x in v))
    raise _Unkeyable


def _build(spec: Any) -> Any:
    if spec[0] == "tensor":
        _, shape, stride, dtype, mode, _ = spec
        if mode is None:
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        # As FakeTensorMode builds its cached results (_get_output_tensor_from_cache_entry).
        with in_kernel_invocation_manager(mode):
            empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return FakeTensor(mode, empty, torch.device("meta"))
    if spec[0] == "value":
        return spec[1]
    return spec[0](_build(x) for x in spec[1])


class MetaMemo(TorchDispatchMode):
    """Within its context, each distinct (functional ATen op, arguments' metadata) on meta (or fake meta) tensors
    runs once; a repeat returns fresh tensors with the recorded shapes, strides and dtypes. `hits` counts the
    repeats."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        meta_without_dynamo(type(self).__torch_dispatch__)  # torch wraps a mode's dispatch to import torch._dynamo
        self.results: dict[Any, Any] = {}
        self.functional: dict[Any, bool] = {}
        self.hits = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _functional(func, self.functional):
            return func(*args, **kwargs)
        try:
            # A factory op given no dtype takes the default dtype, the one global its result depends on.
            key = (func, arg_key(args), arg_key(kwargs), torch.get_default_dtype())
        except _Unkeyable:
            return func(*args, **kwargs)
        spec = self.results.get(key)
        if spec is not None:
            self.hits += 1
            return _build(spec)
        out = func(*args, **kwargs)
        try:
            spec = _spec(out)
        except _Unkeyable:
            return out
        # Only what rebuilds exactly (same storage size too: a later as_strided view may reach into it).
        if _spec(_build(spec)) == spec:
            self.results[key] = spec
        return out
