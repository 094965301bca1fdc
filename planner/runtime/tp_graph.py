"""Tensor parallelism in a traced graph: the sizes the graph holds for the sharded dimension, made this rank's.

A traced graph has the model's head counts and split widths baked in (`q.view(B, T, self.n_head, C // self.n_head)`,
`qkv.split(self.n_embd, dim=2)`: nanoGPT's and Megatron's fused-qkv attention), and a graph traced with meta values
(`tracers.meta_trace`) every shape. A column-parallel projection gives each rank 1/tp of its output features, so
from there to the row-parallel projection each tensor has 1/tp of one dimension (the features, then the heads).
`localise_tp_sizes` follows that dimension from each colwise module's call through the graph, as the planner's
pair detection did (planner.model.tp), and rewrites the sizes given for it: a split's widths and a reshape's or
expand's size there divided by tp (a size computed in the graph gets a `// tp` node), -1 left as is. The other
sizes (the head dimension `C // n_head`, the batch, the sequence) are the model's own. A fused projection's
output is split in equal chunks of the local width, or sliced at offsets divided by tp (`qkv[..., :q_width]`, chunks
of any widths), each rank's weight holding its share of every chunk (parallel.interleave_fused): this rank's q, k
and v heads.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

_RESHAPES = {"view", "reshape", "unflatten", "_unsafe_view"}
_SPLITS = {"split", "split_with_sizes", "chunk", "tensor_split", "unbind"}
_TRANSPOSES = {"transpose", "swapaxes", "swapdims"}


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _shape(values: dict[fx.Node, Any], node: Any) -> tuple[int, ...] | None:
    v = values.get(node) if isinstance(node, fx.Node) else None
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def reshaped_dim(src: tuple[int, ...], out: tuple[int, ...], pos: int) -> int | None:
    """Where dimension `pos` of `src` is sharded after a reshape to `out`: contiguous sharding splits the
    outermost output dimension that overlaps its span (the heads of (heads, head_dim))."""
    inner = _prod(src[pos + 1 :])
    span = inner * src[pos]
    for j in range(len(out)):
        lo, hi = _prod(out[j + 1 :]), _prod(out[j:])
        if lo < span and hi > inner and out[j] > 1:
            return j
    return None


def indexed_dim(index: Any, rank: int, pos: int) -> int | None:
    """Where dimension `pos` of a rank-`rank` tensor lies after `x[index]`, read from the index itself: a None
    adds a dimension where it stands (HF's repeat_kv, `x[:, :, None, :, :]`, puts it after the kv heads), an
    int removes one (the sharded one taken by an int: None), an Ellipsis stands for the dimensions no other
    entry names. Raises ValueError for an index it cannot read (a tensor index, which may move dimensions)."""
    items = index if isinstance(index, (tuple, list)) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in items):
        raise ValueError(f"an index of {index!r} is not read")
    named = sum(1 for i in items if i is not None and i is not Ellipsis)
    if named > rank or sum(1 for i in items if i is Ellipsis) > 1:
        raise ValueError(f"index {index!r} of a rank-{rank} tensor")
    expanded: list[Any] = []
    for i in items:
        expanded.extend([slice(None)] * (rank - named) if i is Ellipsis else [i])
    consumed = sum(1 for i in expanded if i is not None)
    expanded.extend([slice(None)] * (rank - consumed))
    src = out = 0
    for i in expanded:
        if i is None:
            out += 1
            continue
        if src == pos:
            return None if isinstance(i, int) else out
        src += 1
        out += 0 if isinstance(i, int) else 1
    return None


def _dim_arg(node: fx.Node, index: int, default: int | None = 0) -> Any:
    return node.kwargs.get("dim", node.args[index] if len(node.args) > index else default)


def _local(graph: fx.Graph, user: fx.Node, size: Any, tp: int) -> Any:
    """`size` divided by tp: an int divided here, a size computed in the graph by a `// tp` node before `user`."""
    if isinstance(size, bool) or size is None:
        return size
    if isinstance(size, int):
        return size if size == -1 else size // tp
    if isinstance(size, fx.Node):
        with graph.inserting_before(user):
            return graph.call_function(operator.floordiv, (size, tp))
    return size


def index_at(index: Any, rank: int, pos: int) -> tuple[list[Any], int | None] | None:
    """`index`'s items (a tuple's, or the one) and which of them takes dimension `pos` of a rank-`rank` tensor
    (None where the Ellipsis or the implicit trailing slices take it); None where the index adds a dimension
    (None), holds several Ellipsis or more items than the tensor has dimensions."""
    items = list(index) if isinstance(index, tuple) else [index]
    named = sum(1 for i in items if i is not Ellipsis)
    if any(i is None for i in items) or len(items) - named > 1 or named > rank:
        return None
    dim = 0
    for k, i in enumerate(items):
        if i is Ellipsis:
            dim += rank - named
            continue
        if dim == pos:
            return items, k
        dim += 1
    return items, None


def _local_slice(index: Any, rank: int, pos: int, tp: int) -> Any:
    """`index` with its slice of dimension `pos` at offsets divided by tp (`qkv[..., 32:48]` -> `[..., 16:24]` at
    tp 2: each chunk of a fused projection holds 1/tp of its width on each rank, parallel.chunk_shard_order), or
    None where it takes no part of that dimension at numbered offsets."""
    found = index_at(index, rank, pos)
    if found is None or found[1] is None:
        return None
    items, at = found[0], found[1]
    cut = items[at]
    if not isinstance(cut, slice) or cut.step not in (None, 1) or (cut.start is None and cut.stop is None):
        return None
    ends = [cut.start, cut.stop]
    if any(e is not None and (not isinstance(e, int) or isinstance(e, bool)) for e in ends):
        return None
    start, stop = (None if e is None else (e // tp if e >= 0 else -((-e) // tp)) for e in ends)
    items[at] = slice(start, stop, cut.step)
    return tuple(items) if isinstance(index, tuple) else items[0]


def _rewrite_sizes(graph: fx.Graph, node: fx.Node, at: int, tp: int) -> None:
    """Divide the size a reshape / expand gives for output dimension `at` (given as *sizes or one sequence)."""
    args: list[Any] = list(node.args)
    seq: Any = args[1] if len(args) == 2 else None
    if isinstance(seq, (list, tuple)):
        sizes: list[Any] = list(seq)
        if at < len(sizes):
            sizes[at] = _local(graph, node, sizes[at], tp)
            args[1] = tuple(sizes) if isinstance(seq, tuple) else sizes
    elif "size" in node.kwargs or "shape" in node.kwargs:
        key = "size" if "size" in node.kwargs else "shape"
        given: Any = node.kwargs[key]
        sizes = list(given)
        sizes[at] = _local(graph, node, sizes[at], tp)
        node.kwargs = {**node.kwargs, key: tuple(sizes) if isinstance(given, tuple) else sizes}
        return
    elif at + 1 < len(args):
        args[at + 1] = _local(graph, node, args[at + 1], tp)
    node.args = tuple(args)


def localise_tp_sizes(
    gm: fx.GraphModule, values: dict[fx.Node, Any], tp_plan: Mapping[str, str], tp: int,
    fused: Mapping[str, Any] | None = None,
) -> int:
    """Rewrite the sizes of the sharded dimension between each colwise module's call and the row-parallel
    projection it feeds to this rank's (see the module docstring); the offsets of slices only after a module
    whose fused chunks are given by widths (TP_FUSED), whose rows each rank holds chunk by chunk. Returns how
    many sizes it rewrote."""
    sliced = {name for name, chunks in (fused or {}).items() if isinstance(chunks, list)}
    graph = gm.graph
    rowwise = {n for n, s in tp_plan.items() if s == "rowwise"}
    starts = [n for n in graph.nodes if n.op == "call_module" and tp_plan.get(str(n.target)) == "colwise"]
    rewritten = 0
    seen: set[tuple[fx.Node, int]] = set()
    stack: list[tuple[fx.Node, fx.Node, int, bool]] = []
    for start in starts:
        shape = _shape(values, start)
        if shape:
            stack.extend((u, start, len(shape) - 1, str(start.target) in sliced) for u in start.users)
    while stack:
        n, src, pos, chunks = stack.pop()
        if (n, pos) in seen:
            continue
        seen.add((n, pos))
        if n.op == "output" or (n.op == "call_module" and str(n.target) in rowwise):
            continue
        src_shape = _shape(values, src) or ()
        out = _shape(values, n)
        name = _op_name(n)
        new: int | None = pos
        if name == "getitem":
            v = values.get(src)
            if isinstance(v, torch.Tensor) and out is not None:
                try:
                    new = indexed_dim(n.args[1], len(src_shape), pos)
                except ValueError:  # a tensor index: the old reading, new dimensions in front
                    if len(out) != len(src_shape):
                        new = None if len(out) < len(src_shape) else pos + len(out) - len(src_shape)
                local = _local_slice(n.args[1], len(src_shape), pos, tp) if chunks else None
                if local is not None:  # a fused projection's chunk taken at fixed offsets: the rank's offsets
                    n.args = (n.args[0], local, *n.args[2:])
                    rewritten += 1
        elif name in _SPLITS and n.args and n.args[0] is src:
            dim = _dim_arg(n, 2)
            if isinstance(dim, int) and (dim % max(1, len(src_shape))) == pos and name in ("split", "split_with_sizes"):
                size = n.kwargs.get("split_size_or_sections", n.kwargs.get("split_size", n.args[1]))
                local = [_local(graph, n, s, tp) for s in size] if isinstance(size, (list, tuple)) else _local(
                    graph, n, size, tp
                )
                if "split_size_or_sections" in n.kwargs or "split_size" in n.kwargs:
                    key = "split_size_or_sections" if "split_size_or_sections" in n.kwargs else "split_size"
                    n.kwargs = {**n.kwargs, key: local}
                else:
                    n.args = (n.args[0], local, *n.args[2:])
                rewritten += 1
        elif out is None:
            new = pos  # a tuple (what split returns) or a non-tensor: its items keep the dimension
        elif name in _RESHAPES and n.args and n.args[0] is src:
            new = reshaped_dim(src_shape, out, pos)
            if new is not None and len(n.args) + len(n.kwargs) > 1:
                _rewrite_sizes(graph, n, new, tp)
                rewritten += 1
        elif name == "expand" and n.args and n.args[0] is src:
            new = pos + len(out) - len(src_shape)  # the dimensions expand adds come first
            _rewrite_sizes(graph, n, new, tp)
            rewritten += 1
        elif name == "unsqueeze" and n.args and n.args[0] is src and len(out) == len(src_shape) + 1:
            d = _dim_arg(n, 1)
            if isinstance(d, int):  # the new dimension moves the sharded one up only where it lies before it
                new = pos + 1 if d % len(out) <= pos else pos
        elif name == "squeeze" and n.args and n.args[0] is src and src_shape:
            d = _dim_arg(n, 1, default=None)
            gone = [i for i, s in enumerate(src_shape) if s == 1] if d is None else (
                [d] if isinstance(d, int) else list(d) if isinstance(d, (list, tuple)) else [])
            gone = [int(i) % len(src_shape) for i in gone if isinstance(i, int) and src_shape[int(i)] == 1]
            new = None if pos in gone else pos - sum(1 for i in gone if i < pos)
        elif name in _TRANSPOSES or name == "t":
            a, b = (_dim_arg(n, 1), n.args[2] if len(n.args) > 2 else 0) if name != "t" else (0, 1)
            if isinstance(a, int) and isinstance(b, int) and src_shape:
                a, b = a % len(src_shape), b % len(src_shape)
                new = b if pos == a else a if pos == b else pos
        elif name == "permute" and src_shape:
            order = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
            order = [int(d) % len(src_shape) for d in order if isinstance(d, int)]
            new = order.index(pos) if pos in order else pos
        elif src_shape and len(out) != len(src_shape):
            new = pos + len(out) - len(src_shape) if len(out) > len(src_shape) else None
        if new is not None:
            stack.extend((u, n, new, chunks) for u in n.users)
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
