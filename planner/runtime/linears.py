"""nn.Linear subclasses that compute nn.Linear's map with a forward of their own (Falcon's FalconLinear:
``input @ self.weight.T``, then ``+ self.bias``): recognised by running that forward once on a small stand-in, so
the tracers keep them as one call, as torch.fx keeps nn.Linear, and tensor parallelism pairs them.

torch.fx keeps a module as one call only where its class lives in torch.nn; a subclass defined elsewhere is traced
through, its matmul left as a bare ``matmul`` on the weight that no tensor-parallel style can shard. A subclass is
a Linear here only where its own forward gives F.linear's result on a random input in float64 with the module's
own attributes and nothing else: one that reads another parameter or submodule (LoRA adapters, quantised weights),
scales, or changes its result by any other means fails the comparison and is traced through as before.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

_SIMPLE = (int, float, bool, str, type(None))
_known: dict[tuple[Any, ...], bool] = {}


def _key(m: nn.Linear) -> tuple[Any, ...] | None:
    """What the comparison depends on: the class and the instance's plain attributes (a flag its forward reads);
    None where an attribute is not plain data (the comparison then runs for this instance)."""
    items = []
    for k, v in sorted(m.__dict__.items()):
        if k.startswith("_") or k in ("training", "in_features", "out_features"):
            continue
        if not isinstance(v, _SIMPLE):
            return None
        items.append((k, v))
    return (type(m), m.bias is None, tuple(items))


def computes_linear(m: nn.Module) -> bool:
    """Whether ``m`` is an nn.Linear whose forward computes F.linear(input, weight, bias): True for nn.Linear's own
    forward; for a subclass with a forward of its own, its result on a stand-in (4 inputs of 5 features, 3 outputs,
    float64, no gradient) compared with F.linear's, once per class and attributes."""
    if not isinstance(m, nn.Linear):
        return False
    if type(m).forward is nn.Linear.forward:
        return True
    key = _key(m)
    if key is not None and key in _known:
        return _known[key]
    result = _compare(m)
    if key is not None:
        _known[key] = result
    return result


def _compare(m: nn.Linear) -> bool:
    # on the CPU whatever device the caller's context makes the default (the analysis builds models on meta)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 5, generator=gen, dtype=torch.float64, device="cpu")
    bias = None if m.bias is None else torch.randn(3, generator=gen, dtype=torch.float64, device="cpu")
    x = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64, device="cpu")
    stub = type(m).__new__(type(m))
    nn.Module.__init__(stub)
    for k, v in m.__dict__.items():  # the instance's plain attributes; no parameter, buffer or submodule of its own
        if not k.startswith("_") and isinstance(v, _SIMPLE):
            object.__setattr__(stub, k, v)
    stub.in_features, stub.out_features = 5, 3
    stub._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
    stub._parameters["bias"] = None if bias is None else nn.Parameter(bias, requires_grad=False)
    with contextlib.suppress(Exception), torch.no_grad():
        out = type(m).forward(stub, x)
        want = torch.nn.functional.linear(x, weight, bias)
        return (
            isinstance(out, torch.Tensor)
            and out.shape == want.shape
            and out.dtype == want.dtype
            and bool(torch.allclose(out, want, rtol=1e-12, atol=1e-12))
        )
    return False
