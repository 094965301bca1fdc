"""The parallelisms, applied to one stage in torchtitan's order: tensor (and sequence) parallelism, then
activation checkpointing, then FSDP2 / replicate over the data-parallel ranks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .errors import RunError
from .experts import ExpertParallel
from .layout import Layout
from .stages import LocalStage, contains_tensor, has_module, module_paths


def _find_replicate() -> Callable[..., object] | None:
    """FSDP2's replicate: DDP semantics that compose with TP and pipelining (recent torch), else None."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        return None
    return replicate


replicate = _find_replicate()


# Sequence parallelism: which values are split along the sequence between the TP regions.
class ToSequenceShard(nn.Module):
    """Replicated [b, s, ...] -> this rank's slice of the sequence (backward: all-gather the gradient)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return full.redistribute(self.mesh, [Shard(1)]).to_local()


class FromSequenceShard(nn.Module):
    """This rank's sequence slice -> the whole sequence (backward: reduce-scatter the gradient).

    Entering a TP region it returns a replicated DTensor, so the column-parallel Linears inside take it
    as is and their input gradients are reduce-scattered once; for the model output, a plain tensor.
    """

    def __init__(self, mesh: DeviceMesh, as_dtensor: bool) -> None:
        super().__init__()
        self.mesh = mesh
        self.as_dtensor = as_dtensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sliced = DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False)
        full = sliced.redistribute(self.mesh, [Replicate()])
        return full if self.as_dtensor else full.to_local()


class SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumGradientOverTP(nn.Module):
    """A weight used on sequence slices: identity forward, its gradient summed over the tp ranks."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        # torch leaves autograd.Function.apply unannotated (untyped_calls_exclude does not reach a subclass's).
        summed: torch.Tensor = SumGradient.apply(weight, self.mesh.get_group())  # type: ignore[no-untyped-call]
        return summed


def inside(paths: list[str], module: str) -> bool:
    """Whether any of the module paths is `module` or lies under it."""
    return any(p == module or p.startswith(module + ".") for p in paths)


def plan_sequence_parallel(
    gm: fx.GraphModule, values: dict[fx.Node, Any], seq_len: int, mesh: DeviceMesh, tp_plan: dict[str, str]
) -> dict[str, ParallelStyle]:
    """Rewrite the graph so the residual stream stays split along the sequence between TP regions.

    Megatron-style (Korthikanti et al. 2022): a row-parallel Linear reduce-scatters its output along the
    sequence; norms, dropout and residual adds run on sequence slices; the sequence is all-gathered where
    a TP region (the parent module of a row-parallel Linear: attention, MLP) begins. Replicated values
    meeting sliced ones are sliced, weights used on slices get their gradients summed over tp, and the
    model output is gathered. Returns the parallel styles of the modules involved (tp_plan's Linears and
    the modules that now see sequence slices). Every rank rewrites the whole graph the same way, so the
    layouts agree across pipeline stages.
    """
    regions = {name.rpartition(".")[0] for name, style in tp_plan.items() if style == "rowwise"} - {""}
    seq_shaped = {
        n for n, v in values.items() if isinstance(v, torch.Tensor) and v.dim() >= 3 and v.shape[1] == seq_len
    }
    sliced: set[fx.Node] = set()  # values held as sequence slices
    styles: dict[str, ParallelStyle] = {}
    converted: dict[tuple[str, fx.Node], fx.Node] = {}

    def convert(node: fx.Node, arg: fx.Node, kind: str) -> None:
        """Feed `node` with `arg` converted: "slice", "gather" (for the model output), "gather-dtensor"
        (entering a TP region) or "sum-grad" (a weight used on slices)."""
        if (kind, arg) not in converted:
            name = f"sequence_parallel_{len(converted)}"
            makers: dict[str, Callable[[], nn.Module]] = {
                "slice": lambda: ToSequenceShard(mesh),
                "gather": lambda: FromSequenceShard(mesh, as_dtensor=False),
                "gather-dtensor": lambda: FromSequenceShard(mesh, as_dtensor=True),
                "sum-grad": lambda: SumGradientOverTP(mesh),
            }
            module = makers[kind]()
            gm.add_module(name, module)
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, (arg,))
            # Placed with its user, so the conversion runs in the user's stage.
            new.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
            values[new] = values[arg]
            if kind == "slice":
                sliced.add(new)
            converted[(kind, arg)] = new
        node.replace_input_with(arg, converted[(kind, arg)])

    def tensor_inputs(node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if isinstance(values.get(a), torch.Tensor)]

    for node in list(gm.graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            for a in tensor_inputs(node):
                if a in sliced:
                    convert(node, a, "gather")
            continue
        paths = module_paths(node)
        region = next((r for r in sorted(regions) if inside(paths, r)), "")
        target = str(node.target)
        if region:
            # Entering a TP region: gather the sliced inputs that come from outside it.
            for a in tensor_inputs(node):
                if a in sliced and not inside(module_paths(a), region):
                    convert(node, a, "gather-dtensor")
            if node.op == "call_module" and tp_plan.get(target) == "rowwise" and node in seq_shaped:
                styles[target] = RowwiseParallel(output_layouts=Shard(1))
                sliced.add(node)
                continue
        args = tensor_inputs(node)
        if not any(a in sliced for a in args):
            continue
        # A sliced input makes the node run on sequence slices (norms, dropout, residual adds work token
        # by token): slice its other sequence-shaped inputs, and sum the gradients of weights it uses.
        for a in args:
            if a in sliced:
                continue
            if a in seq_shaped:
                convert(node, a, "slice")
            elif a.op == "get_attr" and isinstance(values.get(a), nn.Parameter):
                convert(node, a, "sum-grad")
        if node.op == "call_module":
            if tp_plan.get(target) == "colwise":
                styles[target] = ColwiseParallel(input_layouts=Shard(1))
                continue  # its output is split by features, over the whole sequence
            if tp_plan.get(target) == "colwise_gather":
                styles[target] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
                continue  # the LM head: whole logits on every rank
            if any(True for _ in gm.get_submodule(target).parameters()):
                # Weights replicated as DTensors: their gradients are summed over tp by DTensor.
                styles[target] = SequenceParallel(use_local_output=True)
        if node in seq_shaped:
            sliced.add(node)
        elif contains_tensor(values.get(node)):
            raise RunError(
                f"Sequence parallelism cannot follow {node.name} ({node.target}): it changes the sequence "
                "dimension of a sequence-split value. Re-plan with sequence_parallel off for this model."
            )
    gm.graph.lint()
    gm.recompile()
    return styles


def parallel_style(style: str, module: nn.Module) -> ParallelStyle:
    """A TP_PLAN style as a torch parallel style. colwise: split a Linear's outputs (an Embedding's
    features); rowwise: split a Linear's inputs (an Embedding's vocabulary), summing the partial outputs;
    colwise_gather: the vocabulary-parallel LM head, its logits all-gathered."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        # A row-parallel Linear takes its input split by features (from a column-parallel one); an
        # Embedding takes whole token ids.
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate())
        return RowwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    raise ValueError(f"Unknown TP style {style!r}: expected colwise, rowwise or colwise_gather.")


def apply_tp(
    stage: LocalStage, tp_mesh: DeviceMesh, layout: Layout, sp_styles: dict[str, ParallelStyle]
) -> None:
    """Shard the TP plan's modules: column-parallel Linears (split outputs) feeding row-parallel ones (split
    inputs), vocabulary-parallel embeddings and LM head.

    Heads follow on their own: the model reshapes with -1, so a rank holding 1/TP of q's output columns
    sees 1/TP of the heads. With sequence parallelism the styles come from plan_sequence_parallel().
    """
    roots = stage.tp_roots()
    check_tp(roots, layout)
    apply_head_attrs(roots, layout)
    for piece in roots:
        plan: dict[str, ParallelStyle] = {}
        for name, style in layout.tp_plan.items():
            if has_module(piece, name):
                plan[name] = sp_styles.get(name) or parallel_style(style, piece.get_submodule(name))
        plan.update({n: s for n, s in sp_styles.items() if n not in layout.tp_plan and has_module(piece, n)})
        if plan:
            parallelize_module(piece, tp_mesh, plan)


def check_tp(roots: list[nn.Module], layout: Layout) -> None:
    """Whether the TP plan applies to the modules under `roots`: each sharded weight's split dimension and
    each head-count attribute divides by tp. Raises RunError naming the module (also at plan time)."""
    for root in roots:
        for name, style in layout.tp_plan.items():
            if not has_module(root, name):
                continue
            module = root.get_submodule(name)
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise RunError(
                    f"TP_PLAN shards {name}, a {type(module).__name__} ({style}), but torch's ColwiseParallel and "
                    "RowwiseParallel take only nn.Linear and nn.Embedding (GPT-2's Conv1D is neither). Re-plan "
                    "without this pair (or with tp=1)."
                )
            weight = module.weight
            # The weight dimension split: Linear weights are [out, in], Embedding weights [vocab, features].
            split = 0 if style.startswith("colwise") else 1
            if isinstance(module, nn.Embedding):
                split = 1 - split
            size = weight.shape[split]
            if size % layout.tp:
                raise RunError(
                    f"TP_PLAN splits {name} ({style}, size {size}) over tp={layout.tp}: the size must divide. "
                    "Re-plan with a tp degree that divides it."
                )
        for name, attrs in layout.tp_head_attrs.items():
            if not has_module(root, name):
                continue
            module = root.get_submodule(name)
            for attr in attrs:
                value = getattr(module, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise RunError(
                        f"TP_HEAD_ATTRS names {name}.{attr}, which is {type(value).__name__}, not a head count. "
                        "Re-plan the model."
                    )
                if value % layout.tp:
                    raise RunError(
                        f"{name}.{attr} = {value} heads cannot be split over tp={layout.tp}: it must divide. "
                        "Re-plan with a tp degree that divides the head count."
                    )


def apply_head_attrs(roots: list[nn.Module], layout: Layout) -> None:
    """Divide the head-count attributes of TP_HEAD_ATTRS by tp (as torchtitan's parallelize does
    `attn.n_heads //= tp`): code that reshapes by the head count then sees this rank's heads."""
    for root in roots:
        for name, attrs in layout.tp_head_attrs.items():
            if has_module(root, name):
                module = root.get_submodule(name)
                for attr in attrs:
                    setattr(module, attr, getattr(module, attr) // layout.tp)


# Ops of the attention core (QK^T, softmax, AV): what selective recomputation recomputes in backward
# (Korthikanti et al. 2022, section 5); every other op's output is kept.
ATTENTION_CORE = {
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_attention_math",
        "_softmax",
        "bmm",
    )
    if hasattr(torch.ops.aten, name)
}


def recompute_attention_core(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ATTENTION_CORE else CheckpointPolicy.MUST_SAVE


class Recompute(nn.Module):
    """Activation checkpointing around one piece (one block): keep its inputs, recompute in backward.

    "full" recomputes the whole block; "selective" keeps everything but the attention core.
    """

    def __init__(self, inner: nn.Module, selective: bool) -> None:
        super().__init__()
        self.inner = inner
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.selective:
            context = functools.partial(create_selective_checkpoint_contexts, recompute_attention_core)
            return checkpoint(self.inner, *args, use_reentrant=False, context_fn=context, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def apply_ac(stage: LocalStage, recompute: str, schedule: str) -> None:
    if recompute not in ("full", "selective"):
        raise ValueError(f"Unknown recompute policy {recompute!r}: expected none, selective or full.")
    # Selective checkpointing allows one backward per region, but zero-bubble splits each backward in two
    # (input gradients, then weight gradients): there, recompute everything instead.
    selective = recompute == "selective" and schedule != "zero-bubble"
    for i, unit in enumerate(stage.units()):
        if any(True for _ in unit.parameters()):
            stage.replace_unit(i, Recompute(unit, selective=selective))


def apply_expert_data_parallel(
    stage: LocalStage, replica_mesh: DeviceMesh, layout: Layout, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    """FSDP2 (or replicate) of each expert-parallel slice over the dp/ep ranks holding the same experts,
    as torchtitan does for its experts: their gradients are averaged over those replicas only (the
    all-to-all's backward already summed the other ep ranks' tokens in; `ExpertParallel` scales them by
    1/ep so that the result is the mean over dp)."""
    for m in stage.modules():
        if isinstance(m, ExpertParallel):
            if layout.zero_stage == 0:
                assert replicate is not None  # checked by the caller
                replicate(m, mesh=replica_mesh, mp_policy=mp)
            else:
                fully_shard(m, mesh=replica_mesh, mp_policy=mp, reshard_after_forward=reshard)


def apply_data_parallel(
    stage: LocalStage, dp_mesh: DeviceMesh, device: torch.device, layout: Layout, dtype: str,
    replica_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 over the dp ranks (ZeRO stage 1-3), or replicate (0: DDP semantics on FSDP2's machinery).

    Applied even when DP == 1: it is what casts to bf16 on GPUs (MixedPrecisionPolicy, fp32 gradient
    reduction and master weights), and a one-rank reduction is free.
    """
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if device.type == "cuda" and low is not None:
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # CPU: fp32 throughout
    if layout.zero_stage == 0:
        if replicate is None:
            raise RunError(
                f"ZERO_STAGE 0 needs FSDP2 replicate, which torch {torch.__version__} lacks: upgrade torch, "
                "or set ZERO_STAGE = 1 above (the same training, with weights sharded across dp)."
            )
        if replica_mesh is not None:
            apply_expert_data_parallel(stage, replica_mesh, layout, mp, False)
        replicate(stage, mesh=dp_mesh, mp_policy=mp)
        return
    # ZeRO-3 frees gathered weights after forward and gathers them again for backward; ZeRO-1/2 keep them
    # (with a pipeline, that also avoids an all-gather per micro-batch). Zero-bubble keeps them too: its
    # split backward computes weight gradients after FSDP's post-backward, and resharding in between
    # loses them (torch.distributed.pipelining with reshard_after_forward=True gives wrong gradients).
    reshard = layout.zero_stage == 3 and layout.schedule != "zero-bubble"
    if replica_mesh is not None:
        apply_expert_data_parallel(stage, replica_mesh, layout, mp, reshard)
    # One FSDP unit per piece (a block's weights are gathered just for it), then the stage for the rest;
    # pieces sharing a weight (tied) are left to the stage unit, since a weight belongs to one unit.
    owners: dict[int, int] = {}
    units = stage.units()
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owners[id(p)] = i if owners.get(id(p), i) == i else -1
    for i, unit in enumerate(units):
        params = [id(p) for p in unit.parameters()]
        if params and all(owners[p] == i for p in params):
            fully_shard(unit, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)


def parallelize(
    stage: LocalStage,
    mesh: DeviceMesh,
    layout: Layout,
    recompute: str,
    device: torch.device,
    sp_styles: dict[str, ParallelStyle],
    dtype: str,
    ep_mesh: DeviceMesh | None = None,
) -> None:
    """TP, then activation checkpointing, then (compile: not used) FSDP/replicate, as in torchtitan; the
    expert-parallel slices (already cut, `experts.shard_experts`) get their own FSDP over `ep_mesh`'s
    dp_replica dimension first."""
    if layout.tp_enabled:
        apply_tp(stage, mesh["tp"], layout, sp_styles)
    if recompute != "none":
        apply_ac(stage, recompute, layout.schedule)
    replica = ep_mesh["dp_replica"] if ep_mesh is not None else None
    apply_data_parallel(stage, mesh["dp"], device, layout, dtype, replica)
