"""Counting one unit's FLOPs, memory-bound bytes and saved activations on the meta device.

Forward and backward run under a dispatch mode that applies torch's own FLOP formulas per op and splits
matmul, attention and memory-bound work; saved-tensor hooks measure what autograd keeps for backward.

The meta device runs torch's composite (CPU) paths, which keep more than the kernels the script runs on a GPU.
While counting, three ops run as stand-ins that save what the GPU kernels save (`_gpu_kernels_mode`):
``scaled_dot_product_attention`` as the fused flash / memory-efficient / cuDNN kernels (q, k, v, the output
in the kernels' (b, s, heads, d) layout, the fp32 log-sum-exp; the math backend's s x s scores are recorded
apart, in ``Counts.sdpa_scores``, for a target without a fused backend), dropout as ``native_dropout`` (a
one-byte mask, not the composite path's mask in the input's dtype) and ``rms_norm`` as ``_fused_rms_norm``
(the input and the fp32 reciprocal RMS, not three fp32 copies).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.fx
    from torch.overrides import TorchFunctionMode

# aten ops that only re-describe memory: they move no bytes.
_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "t",
    "permute",
    "expand",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "detach",
    "alias",
    "as_strided",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "narrow",
    "_reshape_alias",
    "lift_fresh",
    "empty",
    "empty_like",
    "ones_like",
    "zeros_like",
    "new_empty",
    "clone_meta",
}
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "convolution_backward", "_scaled_mm"}
_ATTENTION_OPS = {
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
}


@dataclass
class Counts:
    fwd_flops: float = 0.0
    fwd_matmul: float = 0.0
    fwd_attention: float = 0.0
    fwd_mem_bytes: float = 0.0
    bwd_flops: float = 0.0
    bwd_matmul: float = 0.0
    bwd_attention: float = 0.0
    bwd_mem_bytes: float = 0.0
    saved: dict[int, int] = field(default_factory=dict)
    attention_core: set[int] = field(default_factory=set)
    flash: bool = False
    # bytes the SDPA calls would keep on top of the fused kernels' under the math backend: the softmax's
    # (b, heads, s_q, s_k) probabilities in the input dtype (planner.cost.memory.activation_bytes adds them
    # where the target's attention backend is "math")
    sdpa_scores: int = 0
    # bytes of the keys and values the SDPA calls read (before a GQA repeat): what context parallelism
    # all-gathers over the cp ranks (planner.cost.terms.cp_kv_exchange_time)
    sdpa_kv: int = 0
    sdpa_masked: bool = False  # some SDPA call got an attn_mask (which context parallelism cannot shard)
    # FLOPs of the ops that read a tagged storage (MoE expert weights, see planner.model.moe), per phase.
    tagged_fwd: float = 0.0
    tagged_bwd: float = 0.0
    # Per-op selective checkpointing (torchtitan's "op" policy, planner.runtime.recompute.OP_SAC_SAVED): the
    # forward's aten.mm calls so far, the bytes of the outputs the policy keeps (every odd mm, the SDPA kernels'
    # output and log-sum-exp) and the forward matmul FLOPs it does not re-run in backward.
    op_sac_mm_count: int = 0
    op_sac_saved: int = 0
    op_sac_kept_matmul: float = 0.0
    # the most bytes the backward's own results (gradients, temporaries) hold at once, saved tensors aside
    bwd_peak: int = 0


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _PhasedCounter(Protocol):
    """The op counter _make_counter returns: a dispatch mode whose `phase` ("fwd" | "bwd") says where FLOPs go."""

    phase: str

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any, /) -> Any: ...


def _make_counter(counts: Counts, tagged: frozenset[int] = frozenset()) -> _PhasedCounter:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    live: dict[int, int] = {}  # storages the backward has allocated and that are still alive -> bytes

    def freed(key: int) -> None:
        live.pop(key, None)

    def track(out: Any, args: Any) -> None:
        """The backward's new storages, held until their last tensor dies (a finalizer per storage's first
        tensor), and the most bytes they hold at once. An output that views an input (a saved tensor unpacked by
        detach, a reshape) allocates nothing."""
        flat, _ = tree_flatten(out)
        ins, _ = tree_flatten(args)
        aliased = {_storage_key(a) for a in ins if isinstance(a, torch.Tensor)}
        for t in flat:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key not in live and key not in aliased:
                    live[key] = t.untyped_storage().nbytes()
                    weakref.finalize(t, freed, key)
        counts.bwd_peak = max(counts.bwd_peak, sum(live.values()))

    class OpCounter(TorchDispatchMode):
        """Counts FLOPs (torch's formulas) and memory-bound bytes per op class, forward or backward."""

        phase = "fwd"

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.phase == "bwd":
                track(out, (args, kwargs))
            packet = func._overloadpacket
            name = packet.__name__
            kernel = None
            if packet.__module__ == "torch._ops.planner":  # loaded where a mixer runs as them (planner.model.fused)
                from planner.model.kernels import KERNEL_COSTS

                kernel = KERNEL_COSTS.get(name)
            if kernel is not None:  # a fused kernel's stand-in (planner.model.kernels): its own FLOPs and bytes
                flops, nbytes, *core = kernel(args, out)
                tensor_core = core[0] if core else 0.0  # timed as fused attention kernels are
                if self.phase == "fwd":
                    counts.fwd_flops += flops
                    counts.fwd_mem_bytes += nbytes
                    counts.fwd_attention += tensor_core
                else:
                    counts.bwd_flops += flops
                    counts.bwd_mem_bytes += nbytes
                    counts.bwd_attention += tensor_core
                return out
            flops = 0.0
            if packet in flop_registry:
                flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            fwd = self.phase == "fwd"
            if flops and tagged and _reads(args, tagged):
                if fwd:
                    counts.tagged_fwd += flops
                else:
                    counts.tagged_bwd += flops
            if fwd and name == "mm":  # torchtitan's op policy: keep every odd aten.mm's output (1st, 3rd, ...)
                counts.op_sac_mm_count += 1
                if counts.op_sac_mm_count % 2 == 1:
                    counts.op_sac_saved += tensor_bytes(out)
                    counts.op_sac_kept_matmul += flops
            if flops:
                if name in _ATTENTION_OPS:
                    if fwd:
                        counts.fwd_attention += flops
                    else:
                        counts.bwd_attention += flops
                elif fwd:
                    counts.fwd_matmul += flops
                else:
                    counts.bwd_matmul += flops
                if fwd:
                    counts.fwd_flops += flops
                else:
                    counts.bwd_flops += flops
            elif name not in _VIEW_OPS and name not in _MATMUL_OPS:
                if name == "embedding":
                    nbytes = 2 * tensor_bytes(out)  # a gather reads only the rows it returns
                else:
                    flat, _ = tree_flatten((args, kwargs, out))
                    nbytes = sum(tensor_bytes(t) for t in flat if isinstance(t, torch.Tensor))
                if fwd:
                    counts.fwd_mem_bytes += nbytes
                else:
                    counts.bwd_mem_bytes += nbytes
            return out

    from planner.runtime.meta import meta_without_dynamo

    meta_without_dynamo(OpCounter.__torch_dispatch__)  # torch wraps a mode's dispatch to import torch._dynamo
    return OpCounter()  # type: ignore[no-untyped-call]


def _reads(args: Iterable[object], storages: frozenset[int]) -> bool:
    """Whether an op's arguments include a view of one of the given storages."""
    import torch

    return any(isinstance(a, torch.Tensor) and _storage_key(a) in storages for a in args)


def _gpu_kernels_mode(counts: Counts) -> TorchFunctionMode:
    """Run SDPA, dropout and rms_norm as stand-ins that save for backward what their GPU kernels save.

    - SDPA: the fused kernels (flash, Dao et al. 2022; memory-efficient, Rabe & Staats 2021 / xFormers;
      cuDNN) keep q, k, v, the output and the fp32 log-sum-exp for backward, not the s x s attention map the
      meta device's math fallback would save. Their output is allocated as (b, s, heads, d) and returned
      transposed (aten/src/ATen/native/transformers/cuda/attention.cu), so the usual
      ``y.transpose(1, 2).flatten(2)`` before the output projection is a view of it, not a copy. FLOPs are
      4*b*h*s_q*s_k*d forward (QK^T and AV) and twice that backward.
    - dropout: on a GPU ``F.dropout`` runs ``native_dropout``, which keeps a one-byte mask
      (aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``); on meta it multiplies by a noise
      tensor of the input's dtype.
    - rms_norm: on a GPU ``F.rms_norm`` runs ``_fused_rms_norm``, whose backward reads the input and the fp32
      reciprocal RMS; on meta it decomposes into fp32 ops that keep three fp32 copies of the input.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class _Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if q.dim() >= 3:  # (..., heads, s, d) viewed from a (..., s, heads, d) buffer, as the kernels do
                shape = q.shape[:-3] + (q.shape[-2], q.shape[-3], v.shape[-1])
                out = torch.empty(shape, dtype=q.dtype, device=q.device).transpose(-2, -3)
            else:
                out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q, k, v, _, _ = ctx.saved_tensors
            flops = 8.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
            counts.bwd_attention += flops
            counts.bwd_flops += flops
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    class _FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int, eps: float) -> torch.Tensor:
            rstd = torch.empty(x.shape[: x.dim() - dims] + (1,) * dims, dtype=torch.float32, device=x.device)
            ctx.save_for_backward(x, rstd, weight)
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
            x, _, weight = ctx.saved_tensors
            # elementwise passes over the input and the gradient, as the kernel's backward reads them
            return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None, None

    # An fx graph calls the function; a torch.export graph (the fallback tracer) the aten op it records.
    sdpa = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
    dropout = (F.dropout, torch.ops.aten.dropout.default)
    rms_norm = (F.rms_norm, torch.ops.aten.rms_norm.default)

    class GpuKernelsMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in sdpa:
                q, k, v = args[:3]
                counts.sdpa_kv += tensor_bytes(k) + tensor_bytes(v)
                if kwargs.get("attn_mask") is not None or (len(args) > 3 and args[3] is not None):
                    counts.sdpa_masked = True
                if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
                    rep = q.shape[-3] // k.shape[-3]
                    k = k.repeat_interleave(rep, dim=-3)
                    v = v.repeat_interleave(rep, dim=-3)
                flops = 4.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
                counts.fwd_attention += flops
                counts.fwd_flops += flops
                counts.flash = True
                counts.sdpa_scores += q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.element_size()
                out = _Flash.apply(q, k, v)  # type: ignore[no-untyped-call]
                # the per-op policy keeps the kernel's outputs: the attention output and the fp32 log-sum-exp
                counts.op_sac_saved += tensor_bytes(out) + q.shape[:-1].numel() * 4
                return out
            if func in dropout:
                x = args[0]
                p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
                train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
                inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
                if train and 0.0 < p < 1.0 and not inplace and isinstance(x, torch.Tensor) and x.is_floating_point():
                    return torch.native_dropout(x, p, True)[0]
            if func in rms_norm:
                x, shape = args[0], args[1]
                weight = args[2] if len(args) > 2 else kwargs.get("weight")
                eps = args[3] if len(args) > 3 else kwargs.get("eps")
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    dims = len(shape) if isinstance(shape, (list, tuple)) else 1
                    # same FLOPs-free memory-bound pass as the op: read x, write y
                    counts.fwd_mem_bytes += 2 * tensor_bytes(x)
                    counts.bwd_mem_bytes += 3 * tensor_bytes(x)
                    return _FusedRMSNorm.apply(  # type: ignore[no-untyped-call]
                        x, weight, dims, 1e-6 if eps is None else float(eps)
                    )
            return func(*args, **kwargs)

    return GpuKernelsMode()


def mixed_precision_mode(dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """While active, matmuls and convolutions take their fp32 floating inputs in ``dtype`` (bf16/fp16), as
    torch.autocast and FSDP2's mixed precision (its input cast) give them on a GPU: a model that computes a value
    in fp32 on purpose (a diffusion UNet's sinusoidal timestep embedding, `.float()`) and feeds it to a Linear
    holding bf16 weights runs here as in the run, instead of failing on mixed dtypes. The cast is an op like any
    other (counted). A null context for fp32."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    if dtype == torch.float32:
        return contextlib.nullcontext()
    ops = {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
           F.conv_transpose3d, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.matmul,
           torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm, torch.einsum}

    def cast(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(a, torch.fx.Proxy) and a.dtype == torch.float32:
            return a.to(dtype)
        return a

    class MixedPrecisionMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in ops:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                if any(t.dtype == dtype for t in tensors) and any(t.dtype == torch.float32 for t in tensors):
                    args = tuple(cast(a) for a in args)
                    kwargs = {k: cast(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    return MixedPrecisionMode()


def _storage_key(t: torch.Tensor) -> int:
    key: int = t.untyped_storage()._cdata
    return key


def analyse_callable(
    fn: Callable[..., Any],
    inputs: tuple[Any, ...],
    params: Sequence[torch.Tensor],
    seq_len: int | None,
    buffers: tuple[torch.Tensor, ...] = (),
    tagged: frozenset[int] = frozenset(),
) -> Counts:
    """Run fn(*inputs) forward and backward on meta tensors, counting FLOPs, bytes and saved activations.

    Floating inputs are activations and get gradients, except the model's ``buffers`` passed in as inputs
    (batch norm's running statistics): autograd refuses gradients for those. FLOPs of ops reading a
    ``tagged`` storage (MoE expert weights) are also summed apart, for planner.model.moe to replace.
    """
    import torch

    counts = Counts()
    param_keys = {_storage_key(p) for p in params}
    buffer_keys = {_storage_key(b) for b in buffers}
    # Non-leaf copies: a unit may update its input in place (ReLU(inplace=True) on a residual stream). The
    # unit's own weights passed in as inputs (a torch.export graph reads every weight at its top, so the split
    # hands them to the unit) stay the parameters: a copy would count them as saved activations.
    ins = tuple(
        t.detach().requires_grad_(True).clone()
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and _storage_key(t) not in buffer_keys
        and _storage_key(t) not in param_keys
        else t
        for t in inputs
    )
    sizes: dict[int, int] = {}
    # Every saved tensor is held until the count ends: a storage freed on the way (a branch whose graph autograd
    # drops) would leave its address to a later one, and two storages would count as one, by chance.
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        held.append(t)
        if key not in param_keys:
            sizes[key] = max(sizes.get(key, 0), t.untyped_storage().nbytes())
            if seq_len and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == seq_len and seq_len > 1:
                counts.attention_core.add(key)
        return t

    counter = _make_counter(counts, tagged)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _gpu_kernels_mode(counts), counter:
        out = fn(*ins)
    counts.saved = sizes
    outs = [o for o in flatten_tensors(out) if o.requires_grad]
    if outs:
        counter.phase = "bwd"
        with counter:
            torch.autograd.backward(outs, grad_tensors=[torch.ones_like(o) for o in outs])
    return counts


def flatten_tensors(x: Any) -> list[torch.Tensor]:
    import torch
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(x)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def val_meta(node: torch.fx.Node) -> Any:
    tm = node.meta.get("tensor_meta")
    if tm is not None:
        return tm
    return node.meta.get("val")


def nbytes_of_meta(m: Any) -> int:
    import torch

    if m is None:
        return 0
    if isinstance(m, torch.Tensor):
        return m.numel() * m.element_size()
    if hasattr(m, "shape") and hasattr(m, "dtype"):
        numel = 1
        for d in m.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=m.dtype).element_size()
    if isinstance(m, (list, tuple)):
        return sum(nbytes_of_meta(x) for x in m)
    return 0
