"""The parallelisms, applied to one stage in torchtitan's order: tensor (and sequence) parallelism, then
activation checkpointing, then FSDP2 / replicate over the data-parallel ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .errors import RunError
from .experts import ExpertParallel
from .layout import FusedChunks, Layout, TPStyle, chunk_widths
from .recompute import apply_ac
from .stages import SP_MODULE_PREFIX, LocalStage, ModelStage, contains_tensor, has_module, module_paths
from .tp_rules import NORM_HEADS_DIM, check_tp, split_dim, splits_own_vocab

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


def find_replicate() -> Callable[..., object] | None:
    """FSDP2's replicate: DDP semantics that compose with TP and pipelining (recent torch), else None.
    FSDP is imported when data parallelism is applied, not with this module: the plan-time TP check
    imports it and shards with DTensor only."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        return None
    return replicate


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

    def extra_repr(self) -> str:  # the plan-time check tells conversions apart by their repr
        return f"as_dtensor={self.as_dtensor}"


class SequenceShardView(nn.Module):
    """This rank's sequence slice as a DTensor sharded along the sequence, without communication: its shape is
    the whole sequence's (for shape reads only)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False)


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


def _dotted_prefixes(path: str) -> list[str]:
    """blocks.7.attn.q -> blocks, blocks.7, blocks.7.attn, blocks.7.attn.q."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def inside(paths: list[str], module: str) -> bool:
    """Whether any of the module paths is `module` or lies under it."""
    return any(p == module or p.startswith(module + ".") for p in paths)


def sequence_parallel(
    gm: fx.GraphModule, values: dict[fx.Node, Any], example: tuple[torch.Tensor, ...], mesh: DeviceMesh,
    layout: Layout,
) -> dict[str, ParallelStyle]:
    """plan_sequence_parallel for the example batch's sequence (dimension 1 of the first input), whose share on
    each cp rank tp must divide. The graph is traced on the whole sequence; with context parallelism each rank
    runs it on seq / cp tokens, its sizes read from the tensors (an fx trace), and sequence parallelism splits
    that local sequence: its conversions (DTensor redistributions over the tp mesh) take the length they get."""
    first = example[0]
    seq_len = first.shape[1] if first.dim() >= 2 else 0
    local = seq_len // layout.cp
    if not seq_len or local % layout.tp:
        share = f", {local} tokens on each of the {layout.cp} cp ranks" if layout.cp_enabled else ""
        raise RunError(
            f"Sequence parallelism splits the sequence (length {seq_len}{share}) over tp={layout.tp}: it must "
            "divide. Re-plan with sequence parallelism off or a tp degree that divides the sequence."
        )
    return plan_sequence_parallel(gm, values, seq_len, mesh, layout.tp_plan.styles, layout.sharded_heads)


def plan_sequence_parallel(
    gm: fx.GraphModule, values: dict[fx.Node, Any], seq_len: int, mesh: DeviceMesh, tp_plan: Mapping[str, str],
    sharded_heads: frozenset[str] = frozenset(),
) -> dict[str, ParallelStyle]:
    """Rewrite the graph so the residual stream stays split along the sequence between TP regions.

    Megatron-style (Korthikanti et al. 2022): a row-parallel Linear reduce-scatters its output along the
    sequence; norms, dropout and residual adds run on sequence slices; the sequence is all-gathered where
    a TP region (the parent module of a row-parallel Linear: attention, MLP) begins. Replicated values
    meeting sliced ones are sliced, weights used on slices get their gradients summed over tp, and the
    model output is gathered. Returns the parallel styles of the modules involved (tp_plan's Linears and
    the modules that now see sequence slices). Every rank rewrites the whole graph the same way, so the
    layouts agree across pipeline stages. A head in `sharded_heads` (loss parallelism, vocab.py) keeps its
    logits split by vocabulary instead of gathering them.
    """
    # (a vocabulary-parallel embedding is no region: nanoGPT's `transformer` ModuleDict holds its wte and blocks)
    regions = {
        name.rpartition(".")[0] for name, style in tp_plan.items()
        if style == "rowwise" and not (has_module(gm, name) and isinstance(gm.get_submodule(name), nn.Embedding))
    } - {""}
    seq_shaped = {
        n for n, v in values.items() if isinstance(v, torch.Tensor) and v.dim() >= 3 and v.shape[1] == seq_len
    }
    sliced: set[fx.Node] = set()  # values held as sequence slices
    styles: dict[str, ParallelStyle] = {}
    converted: dict[tuple[str, fx.Node], fx.Node] = {}

    def convert(node: fx.Node, arg: fx.Node, kind: str) -> None:
        """Feed `node` with `arg` converted: "slice", "gather" (for the model output), "gather-dtensor"
        (entering a TP region), "sum-grad" (a weight used on slices) or "global-shape" (a slice's shape read
        as the whole sequence's)."""
        if (kind, arg) not in converted:
            name = f"{SP_MODULE_PREFIX}{len(converted)}"
            makers: dict[str, Callable[[], nn.Module]] = {
                "slice": lambda: ToSequenceShard(mesh),
                "gather": lambda: FromSequenceShard(mesh, as_dtensor=False),
                "gather-dtensor": lambda: FromSequenceShard(mesh, as_dtensor=True),
                "sum-grad": lambda: SumGradientOverTP(mesh),
                "global-shape": lambda: SequenceShardView(mesh),
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
        # The first TP region (in sorted order) that one of the paths is or lies under: the regions among
        # the paths' dotted prefixes (not a scan of every region for every node: 96 layers have 192).
        prefixes = {q for p in paths for q in _dotted_prefixes(p)}
        region = min(prefixes & regions, default="")
        target = str(node.target)
        tp_module = node.op == "call_module" and target in tp_plan
        reads = not contains_tensor(values.get(node))  # a shape, size or dtype read
        if region and (tp_module or reads):
            # Entering a TP region: gather the sliced inputs that come from outside it, as a replicated DTensor,
            # for its TP Linears (their input gradients are then reduce-scattered once) and its shape reads.
            # Its other nodes run on slices as they do outside one: where the region is the block itself (its
            # MLP's Linears directly under it), the block's norms and residual adds.
            for a in tensor_inputs(node):
                if a in sliced and not inside(module_paths(a), region):
                    convert(node, a, "gather-dtensor")
            if tp_module and tp_plan[target] == "rowwise" and node in seq_shaped:
                styles[target] = RowwiseParallel(output_layouts=Shard(1))
                sliced.add(node)
                continue
        args = tensor_inputs(node)
        if not any(a in sliced for a in args):
            continue
        if reads:
            # The shape of a sequence slice, read to shape whole-sequence values (the heads' view of a
            # column-parallel output): the whole sequence's, from a DTensor view of the slice (no communication).
            for a in args:
                if a in sliced:
                    convert(node, a, "global-shape")
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
                if target in sharded_heads:  # the LM head: this rank's vocabulary share, the loss parallel
                    styles[target] = ColwiseParallel(
                        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
                    )
                else:  # the LM head: whole logits on every rank
                    styles[target] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
                continue
            if any(True for _ in gm.get_submodule(target).parameters()):
                # Weights replicated as DTensors: their gradients are summed over tp by DTensor.
                styles[target] = SequenceParallel(use_local_output=True)
        if node in seq_shaped:
            sliced.add(node)
            # A reshape or expand on sequence slices whose sizes a trace with meta values fixed for the whole
            # sequence (GPT-2's `hidden_states.view(-1, seq, width)`): the slice's length instead.
            if node.op == "call_method" and node.target in ("view", "reshape", "expand"):
                given = list(node.args[1:])
                whole = isinstance(given[0], (list, tuple)) if len(given) == 1 else False
                sizes = list(given[0]) if whole else given
                if len(sizes) > 1 and sizes[1] == seq_len:
                    sizes[1] = seq_len // mesh.size()
                    node.args = (node.args[0], tuple(sizes)) if whole else (node.args[0], *sizes)
        elif contains_tensor(values.get(node)):
            if node.op == "call_module" and target in styles:
                raise RunError(
                    f"Sequence parallelism cannot follow {node.name} ({node.target}): it changes the sequence "
                    "dimension of a sequence-split value. Re-plan with sequence_parallel off for this model."
                )
            # An op that merges or drops the sequence dimension (a loss computed in forward: nanoGPT's
            # `logits.view(-1, vocab)`) runs on the whole sequence, gathered as the model output is.
            for a in args:
                if a in sliced:
                    convert(node, a, "gather")
    gm.graph.lint()
    gm.recompile()
    return styles


def parallel_style(style: str, module: nn.Module, sharded: bool = False) -> ParallelStyle:
    """A TP_PLAN style as a torch parallel style. colwise: split a Linear's outputs (an Embedding's
    features); rowwise: split a Linear's inputs (an Embedding's vocabulary), summing the partial outputs;
    colwise_gather: the vocabulary-parallel LM head, its logits all-gathered; norm_heads: a norm applied to
    each head ([b, s, heads, head_dim], Qwen3's q_norm / k_norm) between a column-parallel projection and
    attention, run on this rank's heads with its weight replicated, so its gradient is summed over tp (as
    torchtitan's Qwen3 plan does). `sharded`: a colwise_gather head's logits stay split by vocabulary, a DTensor
    (loss parallelism, vocab.py), as torchtitan's head under loss parallelism."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        # A row-parallel Linear takes its input split by features (from a column-parallel one); an
        # Embedding takes whole token ids.
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate())
        return RowwiseParallel()
    if style == "colwise_gather":
        if sharded:
            return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(output_layouts=Replicate())
    if style == "norm_heads":
        return SequenceParallel(sequence_dim=NORM_HEADS_DIM, use_local_output=True)
    raise ValueError(f"Unknown TP style {style!r}: expected colwise, rowwise, colwise_gather or norm_heads.")


def chunk_shard_order(width: int, chunks: FusedChunks, tp: int) -> torch.Tensor:
    """Indices that reorder a fused output of chunks (q | k | v: `chunks` equal ones, or the widths given) so
    that its contiguous tp slices are [q_r | k_r | v_r] for each rank r: a plain Shard then gives every rank its
    own heads' slice of each chunk, laid out as the model's split, or its slices at offsets made the rank's
    (tp_graph), of the fused output expect."""
    widths = chunk_widths(width, chunks)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    order = [
        start + r * (w // tp) + i for r in range(tp) for start, w in zip(starts, widths, strict=True)
        for i in range(w // tp)
    ]
    return torch.tensor(order, dtype=torch.long)


@torch.no_grad()
def interleave_fused(module: nn.Module, style: str, chunks: FusedChunks, tp: int) -> None:
    """Reorder a fused column projection's output features in place (weight and bias) by chunk_shard_order.

    Every rank reorders the same initial values, so the sharded weight is the model's, chunk by chunk; the
    reorder is a fixed permutation of parameters, which training (AdamW, the gradient norm) does not see.
    """
    dim = split_dim(module, style)
    for name, param in module.named_parameters(recurse=False):
        d = dim if name == "weight" else 0  # the bias holds the output features
        order = chunk_shard_order(param.shape[d], chunks, tp).to(param.device)
        param.copy_(param.index_select(d, order))


class SumOverTP(torch.autograd.Function):
    """Partial outputs of a row-parallel projection summed over tp; the gradient passes through as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ShardedConv1D(nn.Module):
    """GPT-2's Conv1D (y = x @ W + b, W stored [in, out]) sharded over tp, in place of the original module.

    Column-parallel: W split along dim 1 (outputs) and b with it; the input is whole on every rank and its
    gradient is summed over tp. Row-parallel: W split along dim 0 (inputs), b replicated; the partial
    outputs are summed over tp before the bias. The parameters keep their names (`c_attn.weight`), shapes
    (as DTensors) and values, so FSDP, the optimizer and the gradient norm treat them as any TP weight.
    """

    def __init__(self, conv: nn.Module, mesh: DeviceMesh, column: bool, sequence_shard: bool = False) -> None:
        super().__init__()
        self.mesh = mesh
        self.column = column
        self.sequence_shard = sequence_shard  # row-parallel under sequence parallelism: output split along dim 1
        weight, bias = conv.weight, getattr(conv, "bias", None)
        assert isinstance(weight, torch.Tensor)
        self.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(1 if column else 0)]))
        self.bias = None
        if isinstance(bias, torch.Tensor):
            self.bias = nn.Parameter(distribute_tensor(bias.detach(), mesh, [Shard(0) if column else Replicate()]))
        self.nf = int(getattr(conv, "nf", weight.shape[1]))  # this rank's output width, as the model reads it

    @staticmethod
    def local(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local: torch.Tensor = t.to_local()
            return local
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.mesh.get_group()
        # Under sequence parallelism a column-parallel input is the whole sequence as a replicated DTensor
        # (FromSequenceShard): its local tensor, whose summed gradient the DTensor then splits by sequence.
        x = self.local(x)
        w = self.local(self.weight)
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor
        if self.column:
            flat = SumGradient.apply(flat, group)  # type: ignore[no-untyped-call]
            out = flat @ w
        else:
            out = SumOverTP.apply(flat @ w, group)  # type: ignore[no-untyped-call]
        if self.bias is not None:
            out = out + self.local(self.bias)  # row-parallel: added once, after the sum
        out = out.view(*x.shape[:-1], w.shape[1])
        if self.sequence_shard:  # the sum's sequence slice: a reduce-scatter, as RowwiseParallel(Shard(1)) gives
            whole = DTensor.from_local(out, self.mesh, [Replicate()], run_check=False)
            out = whole.redistribute(self.mesh, [Shard(1)]).to_local()
        return out


class ShardedMultiheadAttention(nn.Module):
    """nn.MultiheadAttention over tp, in place of the original module: its packed in_proj (q | k | v rows) is
    sharded chunk by chunk (parallel.interleave_fused has put [q_r | k_r | v_r] in rank r's rows), so each rank
    runs num_heads / tp heads, and out_proj stays its child, row-parallel (the plan's RowwiseParallel sums the
    heads' partial outputs). torch's F.multi_head_attention_forward cannot run a shard: it checks the packed
    weight against the input's width and splits it by that width. The inputs are whole on every rank, their
    gradients summed over tp. Parameters keep their names and global shapes (DTensors) and values."""

    def __init__(self, mha: nn.MultiheadAttention, mesh: DeviceMesh) -> None:
        super().__init__()
        tp = mesh.size()
        self.mesh = mesh
        self.embed_dim = mha.embed_dim
        self.num_heads = mha.num_heads // tp  # this rank's
        self.total_heads = mha.num_heads
        self.head_dim = mha.head_dim
        self.dropout = mha.dropout
        self.batch_first = mha.batch_first
        self._qkv_same_embed_dim = True  # read by nn.TransformerEncoderLayer's fast-path checks
        self.in_proj_weight = nn.Parameter(distribute_tensor(mha.in_proj_weight.detach(), mesh, [Shard(0)]))
        bias = mha.in_proj_bias
        self.in_proj_bias = None if bias is None else nn.Parameter(distribute_tensor(bias.detach(), mesh, [Shard(0)]))
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.out_proj = mha.out_proj

    def _mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int,
              dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask of MultiheadAttention's semantics (True or -inf: not attended) for this rank's heads,
        broadcastable to [batch, heads, L, S]."""
        mask = None
        if attn_mask is not None:
            m = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(attn_mask, float("-inf")) if (
                attn_mask.dtype == torch.bool) else attn_mask.to(dtype)
            if m.dim() == 3:  # [batch * heads, L, S]: this rank's heads
                first = self.mesh.get_local_rank() * self.num_heads
                m = m.view(batch, self.total_heads, *m.shape[1:])[:, first : first + self.num_heads]
            mask = m
        if key_padding_mask is not None:
            k = torch.zeros_like(key_padding_mask, dtype=dtype).masked_fill(key_padding_mask, float("-inf")) if (
                key_padding_mask.dtype == torch.bool) else key_padding_mask.to(dtype)
            k = k.view(batch, 1, 1, -1)
            mask = k if mask is None else mask + k
        return mask

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if need_weights and not average_attn_weights:
            raise RunError(
                "MultiheadAttention under tensor parallelism returns its attention weights averaged over the heads "
                "only (average_attn_weights=True): each rank holds its own heads. Re-plan with tp=1."
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        group = self.mesh.get_group()
        # Column-parallel inputs: whole on every rank, each rank's heads give part of their gradient.
        q_in = SumGradient.apply(query, group)  # type: ignore[no-untyped-call]
        k_in = q_in if key is query else SumGradient.apply(key, group)  # type: ignore[no-untyped-call]
        v_in = k_in if value is key else q_in if value is query else SumGradient.apply(value, group)  # type: ignore[no-untyped-call]
        w = ShardedConv1D.local(self.in_proj_weight)
        b = ShardedConv1D.local(self.in_proj_bias) if self.in_proj_bias is not None else None
        wq, wk, wv = w.chunk(3)
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
        batch, length = q_in.shape[0], q_in.shape[1]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

        q = heads(nn.functional.linear(q_in, wq, bq))
        k = heads(nn.functional.linear(k_in, wk, bk))
        v = heads(nn.functional.linear(v_in, wv, bv))
        mask = self._mask(attn_mask, key_padding_mask, batch, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = q @ k.transpose(-2, -1) / self.head_dim**0.5
            if mask is not None:
                scores = scores + mask
            elif is_causal:
                causal = torch.ones(length, k.shape[2], dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~causal, float("-inf"))
            probs = nn.functional.dropout(scores.softmax(-1), dropout)
            out = probs @ v
            # the mean over all heads: this rank's heads' sum, summed over tp
            weights = SumOverTP.apply(probs.sum(1), group) / self.total_heads  # type: ignore[no-untyped-call]
        else:
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None
            )
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


def _sum_partial_rows(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    group = module.tp_group
    summed: torch.Tensor = SumOverTP.apply(out, group)  # type: ignore[no-untyped-call]
    return summed


def shard_own_vocab(module: nn.Module, mesh: DeviceMesh) -> None:
    """Vocabulary-parallel embedding as torchtitan shards its own (weight Shard(0), ids whole, partial rows
    summed over tp): the weight becomes a Shard(0) DTensor parameter (so FSDP, the optimizer and the gradient
    norm treat it as any TP weight), the module gets the tp group its forward masks with, and its output
    is all-reduced over tp (backward: the gradient as is, as for RowwiseParallel's Partial -> Replicate)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    module.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]))
    setattr(module, "tp_group", mesh.get_group())  # noqa: B010 - nn.Module types attributes as Tensor | Module
    module.register_forward_hook(_sum_partial_rows)


def replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def apply_tp(
    stage: LocalStage, tp_mesh: DeviceMesh, layout: Layout, sp_styles: dict[str, ParallelStyle],
    skip: frozenset[str] = frozenset(),
) -> None:
    """Shard the TP plan's modules: column-parallel projections (split outputs) feeding row-parallel ones
    (split inputs), vocabulary-parallel embeddings and LM head.

    Heads follow on their own where the model reshapes with -1 (a rank holding 1/TP of q's output columns
    sees 1/TP of the heads); head counts the model reads from attributes (TP_HEAD_ATTRS) are divided by tp.
    A fused projection (TP_FUSED: q, k, v in one Linear) is reordered so each rank's slice holds its part
    of every chunk; a Conv1D (TP_TRANSPOSED) is replaced by ShardedConv1D, since torch's parallel styles
    take only nn.Linear / nn.Embedding. An Embedding that runs its own vocabulary-parallel lookup
    (torchtitan's, splits_own_vocab) gets its tp group and a sharded weight instead of RowwiseParallel. With
    sequence parallelism the styles come from plan_sequence_parallel(). `skip`: modules left whole, with what
    they hold (the plan-time check's repeats of a block, which never run: `repeats.repeated_units`).
    """
    roots = stage.tp_roots()
    # A traced stage's graph has its sizes made this rank's (tp_graph.localise_tp_sizes): the model as written
    # reads its head counts from the attributes, divided here.
    as_written = isinstance(stage, ModelStage)
    check_tp(roots, layout, heads=as_written)
    if as_written:
        apply_head_attrs(roots, layout, skip)
    # Tied weights across the stage's pieces too (nanoGPT's wte and lm_head, run by the first and the last piece
    # of a traced stage): (piece, module, attribute) of each parameter several modules hold.
    tied = tied_holders(roots)
    for i, piece in enumerate(roots):
        plan: dict[str, ParallelStyle] = {}
        for name, style in layout.tp_plan.styles.items():
            if (skip and _within(name, skip)) or not has_module(piece, name):
                continue
            module = piece.get_submodule(name)
            if name in layout.tp_plan.fused:
                interleave_fused(module, style, layout.tp_plan.fused[name], layout.tp)
            if isinstance(module, nn.MultiheadAttention):
                if layout.sp_enabled:
                    raise RunError(
                        f"Sequence parallelism cannot run {name}, an nn.MultiheadAttention sharded by heads (the "
                        "script's own module takes its inputs whole, not split by sequence). Re-plan with "
                        "sequence_parallel off."
                    )
                # q, k and v each by heads; its out_proj (a child, in the plan) row-parallel by parallelize_module
                replace_module(piece, name, ShardedMultiheadAttention(module, tp_mesh))
                continue
            if name in layout.tp_plan.transposed:
                # (under sequence parallelism a row-parallel projection's output stays split by sequence)
                split = isinstance(sp_styles.get(name), RowwiseParallel)
                replace_module(piece, name, ShardedConv1D(module, tp_mesh, style == "colwise", split))
                continue
            if style == "rowwise" and splits_own_vocab(module):
                if name in sp_styles:
                    raise RunError(
                        f"Sequence parallelism cannot shard {name}, a {type(module).__name__} that runs its own "
                        "vocabulary-parallel lookup. Re-plan with sequence_parallel off for this model."
                    )
                shard_own_vocab(module, tp_mesh)
                continue
            plan[name] = sp_styles.get(name) or parallel_style(style, module, name in layout.sharded_heads)
        plan.update({n: s for n, s in sp_styles.items() if n not in layout.tp_plan.styles and has_module(piece, n)})
        # A module of the same type holding a tied copy of a sharded weight (T5 / BART's shared and
        # encoder.embed_tokens) runs with the same style: the copies stay one weight, split alike.
        # A Linear tied to a vocab-parallel embedding (BART's lm_head, followed by a bias add) is the
        # vocab-parallel LM head, its logits gathered: the same split of the same weight.
        for holders in tied:
            styled = next(((j, m) for j, m, _ in holders if m in layout.tp_plan.styles or (j == i and m in plan)), None)
            if styled is None:
                continue
            j, styled_name = styled
            source = roots[j].get_submodule(styled_name)
            for k, mod_name, _ in holders:
                if k != i or not mod_name or mod_name in plan or mod_name in layout.tp_plan.styles:
                    continue
                holder = piece.get_submodule(mod_name)
                if type(holder) is type(source):
                    plan[mod_name] = plan[styled_name] if j == i and styled_name in plan else parallel_style(
                        layout.tp_plan.styles[styled_name], holder
                    )
                elif isinstance(holder, nn.Linear) and isinstance(source, nn.Embedding):
                    if layout.tp_plan.styles.get(styled_name) == "rowwise":
                        plan[mod_name] = parallel_style("colwise_gather", holder)
        for name, parallel in plan.items():
            if skip and _within(name, skip):
                continue
            # each module by itself: torch's plan dict matches every name by fnmatch against every child at
            # each level (0.1 s of an 80-layer model's check); a plain name is the one module either way
            module = piece.get_submodule(name) if name else piece
            parallelize_module(module, tp_mesh, parallel)
            if name in layout.tp_plan.copied:
                module.register_forward_hook(_output_copy)
    retie(roots, tied)


def _output_copy(module: nn.Module, args: Any, output: Any) -> Any:
    """A row-parallel module's output as a tensor of its own (TP_COPIED): RowwiseParallel returns a view of the
    reduced DTensor's local tensor, which autograd does not let the model change in place (`out += residual`)."""
    return output.clone() if isinstance(output, torch.Tensor) else output


def tied_styles(root: nn.Module, tp_plan: Mapping[str, TPStyle]) -> dict[str, TPStyle]:
    """TP styles for the modules outside the plan that hold a tied copy of a weight the plan shards: a module of
    the same type gets the same style; a Linear tied to a vocabulary-parallel embedding is the vocabulary-parallel
    LM head (colwise_gather). A traced stage adds them to its plan before it is rewritten and cut, since the two
    may run in different pieces or stages (nanoGPT's lm_head, with its loss in forward: never the model's output,
    so the planner does not find it as the head)."""
    extra: dict[str, TPStyle] = {}
    for holders in tied_holders([root]):
        names = [m for _, m, _ in holders]
        styled = next((m for m in names if m in tp_plan), None)
        if styled is None:
            continue
        source = root.get_submodule(styled)
        for name in names:
            if name in tp_plan or not name:
                continue
            holder = root.get_submodule(name)
            if type(holder) is type(source):
                extra[name] = tp_plan[styled]
            elif isinstance(holder, nn.Linear) and isinstance(source, nn.Embedding) and tp_plan[styled] == "rowwise":
                extra[name] = "colwise_gather"
    return extra


def with_tied_styles(layout: Layout, root: nn.Module) -> Layout:
    """The layout with `tied_styles` of the model (or traced graph module) `root` added to its TP plan."""
    extra = tied_styles(root, layout.tp_plan.styles)
    if not extra:
        return layout
    styles = {**layout.tp_plan.styles, **extra}
    return dataclasses.replace(layout, tp_plan=dataclasses.replace(layout.tp_plan, styles=styles))


def tied_holders(roots: list[nn.Module]) -> list[list[tuple[int, str, str]]]:
    """(root, module, attribute) of each parameter held by several modules under `roots` (GPT-2's wte.weight and
    lm_head.weight; in a traced stage, possibly in two of its pieces)."""
    holders: dict[int, list[tuple[int, str, str]]] = {}
    for i, root in enumerate(roots):
        for mod_name, module in root.named_modules(remove_duplicate=False):
            for name, param in module.named_parameters(recurse=False):
                holders.setdefault(id(param), []).append((i, mod_name, name))
    return [h for h in holders.values() if len(h) > 1]


def retie(roots: list[nn.Module], tied: list[list[tuple[int, str, str]]]) -> None:
    """Make tied weights one parameter again after sharding: parallelize_module replaces each module's
    weight by its own DTensor, which would train the copies apart. Sharded copies must be split alike (the
    vocab-parallel embedding and LM head both split the vocabulary); an unsharded holder outside the TP
    plan (BERT's cls.predictions.bias, tied to the decoder's) holds the sharded parameter too."""
    for holders in tied:
        params = [getattr(roots[i].get_submodule(m), n) for i, m, n in holders]
        sharded = [(h, p) for h, p in zip(holders, params) if isinstance(p, DTensor)]
        if not sharded:
            continue
        (_, first_mod, first_name), first = sharded[0]
        for (_, mod_name, name), other in sharded[1:]:
            if other is not first and tuple(other.placements) != tuple(first.placements):
                raise RunError(
                    f"{first_mod}.{first_name} and {mod_name}.{name} are one tied weight, but TP_PLAN splits them "
                    f"differently ({tuple(first.placements)} vs {tuple(other.placements)}). Re-plan with the same "
                    "style for both or neither."
                )
        for (i, mod_name, name), other in zip(holders, params):
            holder = roots[i].get_submodule(mod_name)
            if other is not first and isinstance(holder, (nn.Linear, nn.Embedding)) and not isinstance(other, DTensor):
                raise RunError(
                    f"{mod_name}.{name} is tied to {first_mod}.{first_name}, which TP_PLAN shards, but it computes "
                    "with the whole weight. Re-plan with tp=1, or shard neither."
                )
            if other is not first:
                setattr(holder, name, first)


def _within(name: str, modules: frozenset[str]) -> bool:
    """Whether module `name` is one of `modules` or inside one."""
    return any(p in modules for p in _dotted_prefixes(name))


def apply_head_attrs(roots: list[nn.Module], layout: Layout, skip: frozenset[str] = frozenset()) -> None:
    """Divide the head-count attributes of TP_HEAD_ATTRS by tp (as torchtitan's parallelize does
    `attn.n_heads //= tp`): code that reshapes by the head count then sees this rank's heads (not in `skip`)."""
    for root in roots:
        for name, attrs in layout.tp_plan.head_attrs.items():
            if not _within(name, skip) and has_module(root, name):
                module = root.get_submodule(name)
                for attr in attrs:
                    setattr(module, attr, getattr(module, attr) // layout.tp)


def apply_expert_data_parallel(
    stage: LocalStage, replica_mesh: DeviceMesh, layout: Layout, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    """FSDP2 (or replicate) of each expert-parallel slice over the dp/ep ranks holding the same experts,
    as torchtitan does for its experts: their gradients are averaged over those replicas only (the
    all-to-all's backward already summed the other ep ranks' tokens in; `ExpertParallel` scales them by
    1/ep so that the result is the mean over dp)."""
    from torch.distributed.fsdp import fully_shard

    replicate = find_replicate()
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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    replicate = find_replicate()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if device.type == "cuda" and low is not None:
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # CPU: fp32 throughout
    # Scalar (0-dim) parameters, CLIP's logit_scale: FSDP2 shards a parameter along a dimension and refuses them,
    # so they stay whole on every rank, outside FSDP, with their gradients averaged over dp here.
    ignored = replicated_scalars(stage, dp_mesh) or None
    if layout.zero_stage == 0:
        if replicate is None:
            raise RunError(
                f"ZERO_STAGE 0 needs FSDP2 replicate, which torch {torch.__version__} lacks: upgrade torch, "
                "or set ZERO_STAGE = 1 above (the same training, with weights sharded across dp)."
            )
        if replica_mesh is not None:
            apply_expert_data_parallel(stage, replica_mesh, layout, mp, False)
        replicate(stage, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
        return
    # ZeRO-3 frees gathered weights after forward and gathers them again for backward; ZeRO-1/2 keep them
    # (with a pipeline, that also avoids an all-gather per micro-batch). Zero-bubble keeps them too: its
    # split backward computes weight gradients after FSDP's post-backward, and resharding in between
    # loses them (torch.distributed.pipelining with reshard_after_forward=True gives wrong gradients).
    reshard = layout.zero_stage == 3 and layout.schedule != "zero-bubble"
    if replica_mesh is not None:
        apply_expert_data_parallel(stage, replica_mesh, layout, mp, reshard)
    # One FSDP unit per piece (a block's weights are gathered just for it), then the stage for the rest;
    # pieces sharing a weight (tied) are left to the stage unit, since a weight belongs to one unit, and so are
    # the model's modules whose weights it reads outside their forward (Whisper's token embedding, its logits'
    # matrix too), which ZeRO-3 would have freed by then.
    owners: dict[int, int] = {}
    units = stage.units()
    alone = {id(u) for u in stage.sharded_units()}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owners[id(p)] = i if owners.get(id(p), i) == i else -1
    for i, unit in enumerate(units):
        params = [id(p) for p in unit.parameters()]
        if id(unit) in alone and params and all(owners[p] == i for p in params):
            fully_shard(unit, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored)
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored)


def replicated_scalars(stage: nn.Module, dp_mesh: DeviceMesh) -> set[nn.Parameter]:
    """The stage's 0-dim parameters, kept whole on every rank (FSDP2 cannot shard them): each trainable one gets
    its gradient averaged over the dp ranks after every accumulation into it (the average of the accumulated sum
    equals the sum of the micro-batches' averages), as FSDP averages the others'. Returns them."""
    scalars = {p for p in stage.parameters() if p.dim() == 0}
    group = dp_mesh.get_group()
    size = dp_mesh.size()

    def average(p: torch.Tensor) -> None:
        if p.grad is not None and size > 1:
            dist.all_reduce(p.grad, group=group)  # SUM, then divide: gloo has no AVG
            p.grad.div_(size)

    for p in scalars:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)
    return scalars


def parallelize(
    stage: LocalStage,
    mesh: DeviceMesh,
    layout: Layout,
    recompute: str,
    device: torch.device,
    sp_styles: dict[str, ParallelStyle],
    dtype: str,
    ep_mesh: DeviceMesh | None = None,
    dp_mesh: DeviceMesh | None = None,
    full: Collection[str] = (),
) -> None:
    """TP, then activation checkpointing (`full`: the planned modules recomputed fully whatever `recompute`,
    the stage's first blocks under Megatron-LM's block method), then compile (async TP only), then
    FSDP/replicate, as in torchtitan; the
    expert-parallel slices (already cut, `experts.shard_experts`) get their own FSDP over `ep_mesh`'s
    dp_replica dimension first. `dp_mesh`: the ranks the weights are replicated or sharded over (default: the dp
    dimension; with context parallelism the flattened dp x cp one, torchtitan's `dp_shard_cp`)."""
    if layout.tp_enabled:
        apply_tp(stage, mesh["tp"], layout, sp_styles)
    if recompute != "none" or full:
        apply_ac(stage, recompute, layout.schedule, full)
    if layout.async_tp:
        apply_async_tp(stage, mesh["tp"], device)
    replica = ep_mesh["dp_replica"] if ep_mesh is not None else None
    apply_data_parallel(stage, mesh["dp"] if dp_mesh is None else dp_mesh, device, layout, dtype, replica)


ASYNC_TP_DEVICE = (
    "ASYNC_TP (torch's async tensor parallelism) runs on CUDA symmetric memory and this rank's device is {device}. "
    "Run on NVIDIA GPUs, or re-plan without it (planner plan ... --no-async-tp) and set ASYNC_TP = False."
)


def apply_async_tp(stage: LocalStage, tp_mesh: DeviceMesh, device: torch.device) -> None:
    """torch's async TP, as torchtitan's maybe_enable_async_tp: inductor's micro-pipeline TP pass (which
    decomposes sequence parallelism's all-gather -> matmul and matmul -> reduce-scatter into overlapped steps)
    on, the TP group on symmetric memory, and each unit of the stage compiled in place (after TP and
    checkpointing, before FSDP, torchtitan's order). CUDA only: refused on other devices with why."""
    if device.type != "cuda":
        raise RunError(ASYNC_TP_DEVICE.format(device=device.type))
    import warnings

    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
    from torch.distributed import _symmetric_memory

    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None:  # torch < 2.10 needs it; later versions deprecate it as a no-op need
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(tp_mesh.get_group().group_name)
    for unit in stage.units():
        unit.compile()


class SummedOverTP:
    """This rank's weights of TP_SUMMED: held whole by every tp rank, applied alike to every head (a learned scale
    over head_dim shared by all heads), so each rank's backward computes its own heads' share of their gradient.
    `sum_gradients`, after the backward (and the data-parallel reduction, which sums over other ranks), makes
    each the sum over the tp ranks: the whole model's gradient, the same on every tp rank. The parameters are
    looked up by name in the stages as wrapped (FSDP replaces them)."""

    def __init__(self, stages: Collection[LocalStage], layout: Layout, group: dist.ProcessGroup) -> None:
        found: dict[int, nn.Parameter] = {}
        for stage in stages:
            for root in stage.tp_roots():
                for name in layout.tp_plan.summed:
                    try:
                        param = root.get_parameter(name)
                    except AttributeError:
                        continue  # another stage's
                    found[id(param)] = param
        self.params = list(found.values())
        self.group = group

    def sum_gradients(self) -> None:
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params if p.grad is not None
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all of them
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
