"""Fused GPU kernels the analysis runs in place of a model's reference code: Mamba's selective scan and causal
convolution (Gu & Dao 2023; github.com/state-spaces/mamba, github.com/Dao-AILab/causal-conv1d), and Mamba-2's
chunked SSD scan (Dao & Gu 2024, "Transformers are SSMs"; mamba_ssm's ``mamba_split_conv1d_scan_combined``).

Reference Mamba code (mamba_ssm's ``selective_scan_ref``, mamba-minimal, transformers' mixer without its CUDA
kernels) scans in a Python loop over the time steps: traced, that is seq x layers graph nodes (Mamba-2.8B at seq
2048 did not finish in 300 s), and counted op by op it is the O(B L D N) memory traffic the fused kernel exists to
avoid (0.4% MFU). While the analysis runs (``fused_kernels``), each Mamba mixer (``is_ssm_mixer``: the rule the
tracers use to keep it one call) runs as the fused training path, mamba_ssm's ``mamba_inner_fn``: in_proj, the
causal convolution with its SiLU, x_proj, dt_proj, the selective scan with D, the SiLU gate and the dt bias fused,
out_proj. The projections are plain Linears (counted as matmuls); the convolution and the scan are custom ops on
meta whose FLOPs and HBM bytes are the kernels' (``KERNEL_COSTS``, read by planner.model.counting) and which save
for backward what the kernels save. The model's own code is what the generated script runs; this is analysis only.

A Mamba-2 mixer (transformers' Mamba2Mixer and the hybrids' copies of it: Bamba, Zamba2, NemotronH, FalconH1,
GraniteMoeHybrid; state-spaces' Mamba2) without mamba_ssm runs the SSD algorithm as torch einsums over
(chunk x chunk) blocks: counted op by op, its fp32 intermediates and the s x s-per-chunk decay masks are bytes the
fused Triton kernels never write. It runs here as mamba_ssm's training path does: in_proj, one op for the causal
convolution, the chunked scan with D and dt's bias and softplus, and the gated RMS norm (``ssd_combined``), then
out_proj.
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


# Mamba-2's fused path (mamba_ssm/ops/triton/ssd_combined.py, MambaSplitConv1dScanCombinedFn): the op takes
# in_proj's output zxbcdt = [z, x, B, C, dt] (batch, seq, 2 d_inner + 2 groups state + heads) and returns the
# gated, normed scan output y (batch, seq, d_inner) that out_proj reads, and the norm's fp32 1/rms per group.
# The kernel saves zxbcdt, the scan's output before the norm and 1/rms (and recomputes the convolution and y in
# its backward); the stand-in saves y in place of the scan's output (the same shape and dtype): out_proj saves y
# too, so the count holds one copy, the bytes the kernel keeps.
@torch.library.custom_op("planner::ssd_combined", mutates_args=())
def ssd_combined(
    zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor,
    a_log: torch.Tensor, d: torch.Tensor, norm_weight: torch.Tensor, heads: int, groups: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = gated_rms_norm(ssd(conv(x, B, C), softplus(dt + dt_bias), -exp(a_log)) + D x, z), and 1/rms.
    Analysis only: no CPU kernel."""
    raise NotImplementedError("planner::ssd_combined is the analysis' stand-in for a GPU kernel (meta only)")


def _ssd_dims(zxbcdt: torch.Tensor, conv_weight: torch.Tensor, heads: int) -> tuple[int, int, int]:
    """(batch x seq, d_inner, conv channels) of a zxbcdt = [z, x, B, C, dt]."""
    conv_dim = conv_weight.shape[0]
    d_inner = zxbcdt.shape[-1] - conv_dim - heads
    return zxbcdt.numel() // zxbcdt.shape[-1], d_inner, conv_dim


@ssd_combined.register_fake
def _(
    zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor,
    a_log: torch.Tensor, d: torch.Tensor, norm_weight: torch.Tensor, heads: int, groups: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _, d_inner, _ = _ssd_dims(zxbcdt, conv_weight, heads)
    y = zxbcdt.new_empty((*zxbcdt.shape[:-1], d_inner))
    return y, zxbcdt.new_empty((*zxbcdt.shape[:-1], groups), dtype=torch.float32)


@torch.library.custom_op("planner::ssd_combined_backward", mutates_args=())
def ssd_combined_backward(
    grad: torch.Tensor, zxbcdt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor,
    dt_bias: torch.Tensor, a_log: torch.Tensor, d: torch.Tensor, norm_weight: torch.Tensor, y: torch.Tensor,
    rstd: torch.Tensor, heads: int, groups: int, chunk: int
) -> list[torch.Tensor]:
    """Gradients of zxbcdt and the weights (the backward recomputes the convolution, the chunk states and y)."""
    raise NotImplementedError("planner::ssd_combined_backward is an analysis stand-in (meta only)")


@ssd_combined_backward.register_fake
def _(grad: torch.Tensor, zxbcdt: torch.Tensor, *rest: Any) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in (zxbcdt, *rest[:6])]


def _ssd_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    ctx.save_for_backward(*inputs[:7], *output)
    ctx.sizes = inputs[7:]


def _ssd_backward(ctx: Any, grad: torch.Tensor, _rstd: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return (*ssd_combined_backward(grad, *ctx.saved_tensors, *ctx.sizes), None, None, None)


ssd_combined.register_autograd(_ssd_backward, setup_context=_ssd_setup)


def ssd_flops(batch: int, seq: int, heads: int, headdim: int, groups: int, state: int, chunk: int) -> float:
    """Forward tensor-core FLOPs of the chunked SSD algorithm (Dao & Gu 2024, sec. 6, the four steps of Listing 1),
    with chunks of length q_c (the last one shorter where `chunk` does not divide `seq`), per group or head:
    the diagonal blocks, C B^T per group (2 q_c^2 state) and its masked product with x per head
    (2 q_c^2 headdim); the chunk states B^T x (2 q_c state headdim per head); the off-diagonal outputs
    C h (as many). Each is a dense (chunk x chunk) or (chunk x state) matrix product, as the Triton kernels
    compute them (their causal blocks included)."""
    full, last = divmod(seq, chunk)
    squares = full * chunk * chunk + last * last  # sum over chunks of q_c^2
    per_sample = 2.0 * squares * (groups * state + heads * headdim) + 4.0 * seq * heads * headdim * state
    return batch * per_sample


def _ssd_elementwise_flops(batch: int, seq: int, heads: int, headdim: int, state: int, chunk: int,
                           conv_dim: int, width: int) -> float:
    """Forward FLOPs off the tensor cores: the causal convolution (2 x width per output) and its SiLU, the
    state passing between chunks (a multiply-add per state entry and chunk), the decays (one multiply per
    entry of each (chunk x chunk) mask and per output), D's skip (a multiply-add per output) and the gated
    RMS norm (SiLU of z, the product, the square, the sum and the two scales: 6 per output)."""
    chunks = -(-seq // chunk)
    d_inner = heads * headdim
    conv = (2.0 * width + 1) * seq * conv_dim
    scan = 2.0 * chunks * heads * headdim * state + heads * seq * min(seq, chunk) + 3.0 * seq * d_inner
    return batch * (conv + scan + 6.0 * seq * d_inner)


def _ssd_sizes(zxbcdt: torch.Tensor, conv_weight: torch.Tensor, heads: int, groups: int) -> dict[str, int]:
    tokens, d_inner, conv_dim = _ssd_dims(zxbcdt, conv_weight, heads)
    seq = zxbcdt.shape[-2] if zxbcdt.dim() >= 2 else 1
    return dict(batch=tokens // seq, seq=seq, heads=heads, headdim=d_inner // heads,
                state=(conv_dim - d_inner) // (2 * groups), d_inner=d_inner, conv_dim=conv_dim)


def _ssd_bytes(zxbcdt: torch.Tensor, conv_weight: torch.Tensor, heads: int, groups: int, chunk: int) -> float:
    """HBM bytes of the forward's kernels: the convolution reads x, B and C and writes them convolved; the scan
    reads those and dt and writes its output, with fp32 chunk states (written, read and rewritten by the state
    passing, read by the output kernel) and fp32 C B^T blocks (written, read); the gated norm reads the output
    and z and writes y and 1/rms."""
    z = _ssd_sizes(zxbcdt, conv_weight, heads, groups)
    e = zxbcdt.element_size()
    b, seq = z["batch"], z["seq"]
    chunks = -(-seq // chunk)
    full, last = divmod(seq, chunk)
    tokens = b * seq
    conv = 2 * tokens * z["conv_dim"] * e
    states = 4 * b * chunks * heads * z["headdim"] * z["state"] * 4
    blocks = 2 * b * groups * (full * chunk * chunk + last * last) * 4
    scan = tokens * (z["conv_dim"] + heads) * e + tokens * z["d_inner"] * e + states + blocks
    norm = 3 * tokens * z["d_inner"] * e + tokens * groups * 4
    return float(conv + scan + norm)


def _ssd_cost(args: tuple[Any, ...], out: Any) -> tuple[float, float, float]:
    """(FLOPs, bytes, tensor-core FLOPs) of the forward: ssd_flops on the tensor cores, plus the elementwise
    work (_ssd_elementwise_flops); bytes as _ssd_bytes."""
    zxbcdt, conv_weight = args[0], args[1]
    heads, groups, chunk = args[7], args[8], args[9]
    z = _ssd_sizes(zxbcdt, conv_weight, heads, groups)
    shape = (z["batch"], z["seq"], heads, z["headdim"])
    core = ssd_flops(*shape, groups, z["state"], chunk)
    other = _ssd_elementwise_flops(*shape, z["state"], chunk, z["conv_dim"], conv_weight.shape[-1])
    return core + other, _ssd_bytes(zxbcdt, conv_weight, heads, groups, chunk), core


def _ssd_backward_cost(args: tuple[Any, ...], out: Any) -> tuple[float, float, float]:
    """The backward (mamba_ssm's _mamba_chunk_scan_combined_bwd and the convolution's and norm's): twice each
    forward product (a gradient for each operand) plus the recomputed C B^T blocks and chunk states; twice the
    forward's elementwise work plus the recomputed convolution and norm; twice its bytes (each tensor read
    again and its gradient written)."""
    zxbcdt, conv_weight = args[1], args[2]
    heads, groups, chunk = args[10], args[11], args[12]
    flops, nbytes, core = _ssd_cost((zxbcdt, conv_weight, *args[3:8], heads, groups, chunk), None)
    z = _ssd_sizes(zxbcdt, conv_weight, heads, groups)
    full, last = divmod(z["seq"], chunk)
    recompute = z["batch"] * (2.0 * (full * chunk * chunk + last * last) * groups * z["state"]
                              + 2.0 * z["seq"] * heads * z["headdim"] * z["state"])
    bwd_core = 2 * core + recompute
    return bwd_core + 3 * (flops - core), 2 * nbytes, bwd_core


# Cost of each kernel op by its name: (FLOPs, memory-bound bytes[, tensor-core FLOPs]) from its arguments and
# output. The FLOPs count as the model's work (MFU); the time is the bytes' plus, where given, the tensor-core
# FLOPs' at the rate of fused attention kernels (SSD's chunks are structured masked attention, Dao & Gu 2024,
# sec. 5): the selective scan and the convolution are bandwidth-bound.
KERNEL_COSTS: dict[str, Callable[[tuple[Any, ...], Any], tuple[float, ...]]] = {
    "selective_scan": _scan_cost,
    "selective_scan_backward": _scan_backward_cost,
    "causal_conv1d": _conv_cost,
    "causal_conv1d_backward": _conv_backward_cost,
    "ssd_combined": _ssd_cost,
    "ssd_combined_backward": _ssd_backward_cost,
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


def _first(m: Any, *names: str) -> Any:
    return next((getattr(m, n) for n in names if isinstance(getattr(m, n, None), int)), None)


def _norm_weight(m: Any) -> torch.Tensor | None:
    """The weight of a Mamba-2 mixer's gated RMS norm, or None where it has none (FalconH1's nn.Identity)."""
    weight = getattr(m._modules.get("norm"), "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def _mamba2_inner(m: Any, heads: int, groups: int, chunk: int, hidden_states: torch.Tensor, *_: Any,
                  **__: Any) -> torch.Tensor:
    """A Mamba-2 mixer as mamba_ssm's fused training path (``mamba_split_conv1d_scan_combined``) computes it."""
    zxbcdt = F.linear(hidden_states, m.in_proj.weight, m.in_proj.bias)
    d_inner = m.out_proj.in_features
    conv = m.conv1d
    bias = conv.bias if conv.bias is not None else zxbcdt.new_zeros(conv.in_channels)
    norm_weight = _norm_weight(m)
    norm_weight = norm_weight if norm_weight is not None else zxbcdt.new_ones(d_inner)
    y, _ = ssd_combined(zxbcdt, conv.weight.squeeze(1), bias, m.dt_bias, m.A_log, m.D, norm_weight, heads,
                        groups, chunk)
    return F.linear(y, m.out_proj.weight, m.out_proj.bias)


def _mamba2_mixer(m: Any) -> Callable[..., torch.Tensor] | None:
    """The fused stand-in of a Mamba-2 mixer, or None where ``m``'s layout is not Mamba-2's: one A_log, D and
    dt_bias per head, in_proj to [z, x, B, C, dt] (d_inner + conv channels + heads), the convolution over
    [x, B, C] (d_inner + 2 groups state channels), out_proj from d_inner, a gated RMS norm of d_inner or none;
    the groups, state size and chunk length read from the mixer (transformers' names, mamba_ssm's)."""
    heads = m.A_log.numel()
    groups = _first(m, "n_groups", "ngroups")
    state = _first(m, "ssm_state_size", "d_state")
    chunk = _first(m, "chunk_size")
    dt_bias, d = m._parameters.get("dt_bias"), m._parameters.get("D")
    if groups is None or state is None or chunk is None or dt_bias is None or d is None or heads == 0:
        return None
    d_inner, conv_dim = m.out_proj.in_features, m.conv1d.in_channels
    norm_weight = _norm_weight(m)
    fits = (
        d_inner % heads == 0
        and conv_dim == d_inner + 2 * groups * state
        and m.in_proj.out_features == d_inner + conv_dim + heads
        and dt_bias.numel() == heads
        and d.numel() in (heads, d_inner)
        and (norm_weight is None or norm_weight.numel() == d_inner)
    )
    if not fits:
        return None

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _mamba2_inner(m, heads, groups, chunk, *args, **kwargs)

    return forward


def fused_mixer(m: Any) -> Callable[..., torch.Tensor] | None:
    """The fused stand-in for ``m``'s forward, or None where ``m`` is no Mamba mixer whose layout the fused
    path knows: Mamba-1's (in_proj to x and z, x_proj to dt, B and C, dt_proj; A_log of (d_inner, d_state)) or
    Mamba-2's (_mamba2_mixer: A_log of (heads,))."""
    if not is_ssm_mixer(m):
        return None
    if m.A_log.dim() == 1:
        return _mamba2_mixer(m)
    if m.A_log.dim() != 2:
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
    """While active, each Mamba-1 or Mamba-2 mixer of ``model`` runs as the fused kernels (its forward replaced on the
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
