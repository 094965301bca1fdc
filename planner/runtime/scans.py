"""State-space mixers (Mamba): the rule that recognises them, and the plan-time check's way of running them.

A Mamba mixer's forward runs a selective scan: reference code (mamba_ssm's ``selective_scan_ref``, mamba-minimal,
transformers' mixer without its CUDA kernels) writes it as a Python loop over the time steps, which a GPU runs as
one fused kernel. Traced, the loop is seq x layers graph nodes, so the tracers keep each mixer as one call (its own
code runs there); the analysis costs it as the fused kernels (planner.model.kernels); and the plan-time check on
meta, which runs the model's code to find what would fail at launch, runs each distinct mixer's code once
(``each_scan_once``): Mamba-2.8B's 64 mixers at seq 2048 took 120 s on meta, one takes 2.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def is_ssm_mixer(m: nn.Module) -> bool:
    """Whether ``m`` is a Mamba mixer, recognised by the parameterisation its authors publish (state-spaces/mamba's
    ``Mamba`` and ``Mamba2`` and every port of them: transformers' MambaMixer, Mamba2Mixer, Jamba's, Zamba's;
    mamba-minimal's MambaBlock): its own ``A_log`` parameter (the state matrix, A = -exp(A_log)), a depthwise
    ``conv1d`` (an nn.Conv1d with one group per channel: the causal convolution) and Linear ``in_proj`` and
    ``out_proj``. Such a mixer is traced as one call (a leaf): its forward runs a selective scan, which reference
    code writes as a Python loop over the time steps (a graph of seq x layers nodes) and a GPU runs as one fused
    kernel; the call runs the module's own code."""
    conv = m._modules.get("conv1d")
    return (
        isinstance(m._parameters.get("A_log"), torch.Tensor)
        and isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and isinstance(m._modules.get("in_proj"), nn.Linear)
        and isinstance(m._modules.get("out_proj"), nn.Linear)
    )



def _meta_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return tuple(_meta_key(v) for v in x)
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    return ("object", type(x).__name__)  # a cache object, a config: not a shape


class _Repeat(torch.autograd.Function):
    """A repeat of a mixer already run: its output's metadata, with a gradient for every tensor it read."""

    @staticmethod
    def forward(ctx: Any, like: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.metas = [(t.shape, t.dtype) for t in tensors]
        return like.new_empty_strided(like.shape, like.stride())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *(grad.new_empty(shape, dtype=dtype) for shape, dtype in ctx.metas))


def _on_meta(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def _key(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return (type(module), _meta_key(list(module.parameters())), _meta_key(args), _meta_key(sorted(kwargs.items())),
            torch.is_grad_enabled())


@contextlib.contextmanager
def each_scan_once(
    stand_in: Callable[[nn.Module], Callable[..., Any] | None] | None = None,
) -> Iterator[None]:
    """While active, a Mamba mixer called on meta (or fake) tensors runs its own code the first time it is called
    with given parameter and input shapes; a repeat (the model's other identical layers, a recomputation) returns
    a tensor of the recorded output's shape whose backward gives every input and parameter a gradient of its shape
    (the mixer that ran the first call runs its code again when so called: a checkpoint's recomputation).
    A mixer class is patched when a module holding one of its modules is first called (a global forward pre-hook:
    the model's first call, before any mixer runs; a global forward hook records the first output), for every
    instance and every path that calls it (a module call, fx's leaf call, the tracer's meta value); the patches
    are undone on exit. Off meta, always as written.

    `stand_in`: where it gives a forward for a mixer (planner.model.kernels.fused_mixer: the fused kernels' path,
    which a GPU run takes), that first call on meta runs it instead of the mixer's reference scan (a Python loop
    over the time steps, seconds at seq 2048 on meta, which only a run without the kernels takes)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    seen: dict[Any, tuple[torch.Tensor, int]] = {}  # a call's key -> its output, the id of the mixer that ran it
    mixers: dict[type, bool] = {}
    saved: dict[type, Callable[..., Any] | None] = {}

    def on_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return tensors if tensors and all(_on_meta(t) for t in tensors) else None

    def once(cls: type, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            tensors = on_meta(args, kwargs)
            like, owner = seen.get(_key(self, args, kwargs), (None, 0)) if tensors is not None else (None, 0)
            # The mixer that ran a call's code runs it again when called so again (activation checkpointing's
            # recomputation must save what its forward saved, or torch.utils.checkpoint raises)
            if like is None or owner == id(self) or type(self) is not cls:
                fused = stand_in(self) if stand_in is not None and tensors is not None else None
                if fused is not None:
                    return fused(*args, **kwargs)
                return forward(self, *args, **kwargs)  # recorded by the forward hook
            grads = [t for t in [*(tensors or []), *self.parameters()] if t.requires_grad]
            return _Repeat.apply(like, *grads)  # type: ignore[no-untyped-call]

        return run

    scanned: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def patch(module: nn.Module, args: tuple[Any, ...]) -> None:
        # The classes of the called module's mixers, before any of them is called (a call's forward is fixed
        # before its pre-hooks run): the model's first call patches every mixer class it holds.
        if module in scanned:
            return
        for m in module.modules():
            scanned.add(m)
            cls = type(m)
            if cls not in mixers:
                mixers[cls] = is_ssm_mixer(m)
                if mixers[cls]:
                    saved[cls] = cls.__dict__.get("forward")
                    cls.forward = once(cls, cls.forward)

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if mixers.get(type(module)) and isinstance(out, torch.Tensor) and on_meta(args, kwargs) is not None:
            seen.setdefault(_key(module, args, kwargs), (out.detach(), id(module)))

    handles = [register_module_forward_pre_hook(patch), register_module_forward_hook(record, with_kwargs=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for cls, forward in saved.items():
            if forward is None:
                del cls.forward  # type: ignore[attr-defined]
            else:
                cls.forward = forward  # type: ignore[attr-defined]
