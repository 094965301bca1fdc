"""Fused GPU kernels the analysis runs in place of a model's reference code: Mamba's selective scan and causal
convolution (Gu & Dao 2023; github.com/state-spaces/mamba, github.com/Dao-AILab/causal-conv1d).

Reference Mamba code (mamba_ssm's ``selective_scan_ref``, mamba-minimal, transformers' mixer without its CUDA
kernels) scans in a Python loop over the time steps: traced, that is seq x layers graph nodes (Mamba-2.8B at seq
2048 did not finish in 300 s), and counted op by op it is the O(B L D N) memory traffic the fused kernel exists to
avoid (0.4% MFU). While the analysis runs (``fused_kernels``), each Mamba mixer (``is_ssm_mixer``: the rule the
tracers use to keep it one call) runs as the fused training path, mamba_ssm's ``mamba_inner_fn``: in_proj, the
causal convolution with its SiLU, x_proj, dt_proj, the selective scan with D, the SiLU gate and the dt bias fused,
out_proj. The projections are plain Linears (counted as matmuls); the convolution and the scan are custom ops on
meta whose FLOPs and HBM bytes are the kernels' (``KERNEL_COSTS``, read by planner.model.counting) and which save
for backward what the kernels save. The model's own code is what the generated script runs; this is analysis only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.runtime.scans import is_ssm_mixer

# The scan kernel keeps its fp32 state in SRAM and writes it to HBM once per chunk of this many time steps (the
# checkpoints its backward restarts from: selective_scan_fwd_kernel.cuh, kChunkSize = kNThreads * kNItems).
SCAN_CHUNK = 2048


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.library.custom_op("planner::selective_scan", mutates_args=())
def selective_scan(
    u: torch.Tensor, delta: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
    z: torch.Tensor, delta_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out = (scan(u, softplus(delta + delta_bias), -exp(a_log), b, c) + d u) silu(z), and the chunk states.
    u, delta, z: (batch, d_inner, seq); b, c: (batch, d_state, seq). Analysis only: no CPU kernel."""
    raise NotImplementedError("planner::selective_scan is the analysis' stand-in for a GPU kernel (meta only)")


@selective_scan.register_fake
def _(
    u: torch.Tensor, delta: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
    z: torch.Tensor, delta_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = math.ceil(u.shape[-1] / SCAN_CHUNK)
    states = u.new_empty((u.shape[0], u.shape[1], chunks, 2 * a_log.shape[-1]), dtype=torch.float32)
    return torch.empty_like(u), states


@torch.library.custom_op("planner::selective_scan_backward", mutates_args=())
def selective_scan_backward(
    grad: torch.Tensor, u: torch.Tensor, delta: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    d: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor, states: torch.Tensor, out: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of every input of selective_scan (the backward kernel recomputes each chunk from its state)."""
    raise NotImplementedError("planner::selective_scan_backward is an analysis stand-in (meta only)")


@selective_scan_backward.register_fake
def _(grad: torch.Tensor, u: torch.Tensor, *rest: torch.Tensor) -> list[torch.Tensor]:
    delta, a_log, b, c, d, z, delta_bias = rest[:7]
    return [torch.empty_like(t) for t in (u, delta, a_log, b, c, d, z, delta_bias)]


def _scan_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    # What selective_scan_fn saves (mamba_ssm/ops/selective_scan_interface.py): its inputs, the chunk states and,
    # with z, the output before the gate
    ctx.save_for_backward(*inputs, output[1], output[0])


def _scan_backward(ctx: Any, grad: torch.Tensor, _states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(selective_scan_backward(grad, *ctx.saved_tensors))


selective_scan.register_autograd(_scan_backward, setup_context=_scan_setup)


@torch.library.custom_op("planner::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv1d(x)): x (batch, channels, seq), weight (channels, 1, width). Analysis only."""
    raise NotImplementedError("planner::causal_conv1d is an analysis stand-in (meta only)")


@causal_conv1d.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("planner::causal_conv1d_backward", mutates_args=())
def causal_conv1d_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of x, weight and bias (the kernel recomputes the activation)."""
    raise NotImplementedError("planner::causal_conv1d_backward is an analysis stand-in (meta only)")


@causal_conv1d_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)]


def _conv_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _conv_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(causal_conv1d_backward(grad, *ctx.saved_tensors))


causal_conv1d.register_autograd(_conv_backward, setup_context=_conv_setup)


def _scan_cost(args: tuple[Any, ...], out: Any) -> tuple[float, float]:
    """FLOPs and HBM bytes of the selective scan kernel's forward. FLOPs: 9 B L D N for the discretisation, the
    recurrence and the contraction with C, plus B L D each for the D skip and the gate (VMamba's
    ``flops_selective_scan_fn``, the count of mamba_ssm's reference). Bytes: the kernel reads u, delta, z, B and C
    once and writes the output, with the state in SRAM (Mamba section 3.3.2), plus the fp32 chunk states."""
    u, _, a_log, b, c, _, z, _ = args
    batch, dim, seq = u.shape
    n = a_log.shape[-1]
    flops = 9.0 * batch * seq * dim * n + 2.0 * batch * dim * seq
    return flops, float(_bytes(u, args[1], z, b, c, out[0], out[1]))


def _scan_backward_cost(args: tuple[Any, ...], out: Any) -> tuple[float, float]:
    """Twice the forward's FLOPs (the chunk recomputed, then the gradients of each term); bytes: reads u, delta,
    z, B, C, the chunk states and the incoming gradient, writes the gradients of u, delta, z, B and C."""
    grad, u, delta, _, b, c, _, z, _, states, _ = args
    flops, _ = _scan_cost((u, delta, args[3], b, c, args[6], z, args[8]), (grad, states))
    return 2 * flops, float(2 * _bytes(u, delta, z, b, c) + _bytes(grad, states))


def _conv_cost(args: tuple[Any, ...], out: Any) -> tuple[float, float]:
    """2 x width multiply-adds per output (Dao-AILab/causal-conv1d), reading x and writing the output."""
    x, weight = args[0], args[1]
    return 2.0 * x.numel() * weight.shape[-1], float(_bytes(x, out))


def _conv_backward_cost(args: tuple[Any, ...], out: Any) -> tuple[float, float]:
    grad, x, weight = args[0], args[1], args[2]
    return 4.0 * x.numel() * weight.shape[-1], float(_bytes(grad, x) + _bytes(x))


# Cost of each kernel op by its name: (FLOPs, memory-bound bytes) from its arguments and output. The FLOPs count
# as the model's work (MFU) and the time is the bytes': the scan and the convolution are bandwidth-bound.
KERNEL_COSTS: dict[str, Callable[[tuple[Any, ...], Any], tuple[float, float]]] = {
    "selective_scan": _scan_cost,
    "selective_scan_backward": _scan_backward_cost,
    "causal_conv1d": _conv_cost,
    "causal_conv1d_backward": _conv_backward_cost,
}


def _mamba_inner(m: Any, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    """A Mamba-1 mixer as mamba_ssm's fused training path (``mamba_inner_fn``) computes it."""
    xz = F.linear(hidden_states, m.in_proj.weight, m.in_proj.bias).transpose(1, 2)  # (batch, 2 d_inner, seq)
    d_inner = m.conv1d.in_channels
    x, z = xz[:, :d_inner], xz[:, d_inner:]
    bias = m.conv1d.bias if m.conv1d.bias is not None else x.new_zeros(d_inner)
    x = causal_conv1d(x, m.conv1d.weight, bias)
    rank, n = m.dt_proj.in_features, m.A_log.shape[-1]
    x_dbl = F.linear(x.transpose(1, 2), m.x_proj.weight, m.x_proj.bias)  # (batch, seq, rank + 2 n)
    dt, b, c = x_dbl.split([rank, n, n], dim=-1)
    delta = F.linear(dt, m.dt_proj.weight).transpose(1, 2)  # the bias is added in the scan
    delta_bias = m.dt_proj.bias if m.dt_proj.bias is not None else x.new_zeros(d_inner)
    d = m._parameters.get("D")
    d = d if d is not None else x.new_zeros(d_inner)
    y, _ = selective_scan(x, delta, m.A_log, b.transpose(1, 2), c.transpose(1, 2), d, z, delta_bias)
    return F.linear(y.transpose(1, 2), m.out_proj.weight, m.out_proj.bias)


def fused_mixer(m: Any) -> Callable[..., torch.Tensor] | None:
    """The fused stand-in for ``m``'s forward, or None where ``m`` is no Mamba-1 mixer whose layout the fused
    path knows (in_proj to x and z, x_proj to dt, B and C, dt_proj; A_log of (d_inner, d_state))."""
    if not is_ssm_mixer(m) or m.A_log.dim() != 2:
        return None
    x_proj, dt_proj = m._modules.get("x_proj"), m._modules.get("dt_proj")
    if not isinstance(x_proj, nn.Linear) or not isinstance(dt_proj, nn.Linear):
        return None
    d_inner, n = m.A_log.shape
    fits = (
        m.conv1d.in_channels == d_inner
        and m.in_proj.out_features == 2 * d_inner
        and x_proj.in_features == d_inner
        and x_proj.out_features == dt_proj.in_features + 2 * n
        and dt_proj.out_features == d_inner
        and m.out_proj.in_features == d_inner
    )
    if not fits:
        return None

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _mamba_inner(m, *args, **kwargs)

    return forward


@contextlib.contextmanager
def fused_kernels(model: nn.Module) -> Iterator[int]:
    """While active, each Mamba-1 mixer of ``model`` runs as the fused kernels (its forward replaced on the
    instance, restored on exit). Yields how many mixers run so."""
    replaced = []
    for m in model.modules():
        forward = fused_mixer(m)
        if forward is not None:
            m.forward = forward
            replaced.append(m)
    try:
        yield len(replaced)
    finally:
        for m in replaced:
            del m.forward
