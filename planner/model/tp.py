"""Tensor-parallel facts of one unit: its column/row Linear pairs, vocab-parallel embeddings and head.

Pairs are found on the unit's traced graph (fx or torch.export) after shape propagation, by following
each Linear's output through elementwise, view and attention ops to the one Linear it feeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import gcd
from typing import TYPE_CHECKING, Any, cast

from planner.model.counting import nbytes_of_meta, val_meta
from planner.model.graph import TPPair
from planner.runtime.tp_graph import index_at, indexed_dim
from planner.runtime.tp_rules import NORM_HEADS_DIM, mha_shardable

if TYPE_CHECKING:
    import torch
    import torch.fx
    import torch.nn as nn
    from torch.fx.node import Argument

_MIXING = (
    "layer_norm",
    "rms_norm",
    "group_norm",
    "batch_norm",
    "norm",
    "mean",
    "sum",
    "var",
    "std",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "logsumexp",
    "cat",
    "split",
    "chunk",
    "unbind",
    "cumsum",
    "sort",
    "topk",
)


@dataclass
class ModuleNames:
    """Original qualified names of modules and parameters, by object (split_module renames them)."""

    modules: dict[int, str]
    params: dict[int, list[str]]  # every name of a parameter: tied weights have several (wte, lm_head)
    by_name: dict[str, nn.Module] = field(default_factory=dict)  # qualified name -> module
    # placeholder node -> the tensor a unit graph received
    inputs: dict[torch.fx.Node, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> ModuleNames:
        params: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            params.setdefault(id(p), []).append(n)
        by_name = dict(model.named_modules(remove_duplicate=False))
        return cls({id(m): n for n, m in model.named_modules()}, params, by_name)

    def owner(self, param: object, kind: Callable[[object], bool]) -> str | None:
        """Name of the module ``kind(module)`` accepts that holds ``param`` as its ``weight``, or None."""
        for full in self.params.get(id(param), ()):
            if full.endswith(".weight"):
                mod_name = full[: -len(".weight")]
                if kind(self.by_name.get(mod_name)):
                    return mod_name
        return None


def _applied_module(
    node: torch.fx.Node,
    gm: torch.fx.GraphModule,
    names: ModuleNames,
    kind: Callable[[object], bool],
    aten_ops: tuple[object, ...],
    weight_arg: int,
) -> str | None:
    """Qualified name of the module of type `kind` a node applies (fx call_module, or an aten op on its
    weight for graphs from torch.export)."""
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(cast(str, node.target))  # a call_module's target is the module's name
        except AttributeError:
            return None
        return names.modules.get(id(mod)) if kind(mod) else None
    if node.op == "call_function" and node.target in aten_ops and len(node.args) > weight_arg:
        w: Any = node.args[weight_arg]  # a Node where op says so
        op = getattr(w, "op", None)
        if op in ("get_attr", "placeholder"):
            if op == "placeholder":  # a weight split_module passed in from the parent graph
                obj = names.inputs.get(w)
            else:
                obj = gm
                for atom in str(w.target).split("."):
                    obj = getattr(obj, atom, None)
            return names.owner(obj, kind)
    return None


def is_conv1d(mod: object) -> bool:
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is stored [in, out], applied with addmm."""
    w = getattr(mod, "weight", None)
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and w is not None and w.dim() == 2


def projection_dims(mod: Any) -> tuple[int, int]:
    """(input features, output features) of an nn.Linear or a Conv1D."""
    if is_conv1d(mod):
        return int(mod.weight.shape[0]), int(mod.weight.shape[1])
    return int(mod.in_features), int(mod.out_features)


def _linear_module(node: torch.fx.Node, gm: torch.fx.GraphModule, names: ModuleNames) -> str | None:
    """Qualified name of the projection (nn.Linear, or HF Conv1D) a node applies. A router or other module
    that calls F.linear on its own weight is not one: tensor parallelism leaves it replicated."""
    import torch
    import torch.nn as nn

    def is_linear(m: object) -> bool:
        return isinstance(m, nn.Linear)

    lin = _applied_module(node, gm, names, is_linear, (torch.ops.aten.linear.default, torch.nn.functional.linear), 1)
    if lin is None and node.op == "call_function" and node.target in (torch.ops.aten.addmm.default, torch.addmm):
        lin = _applied_module(node, gm, names, is_conv1d, (node.target,), 2)
    return lin


def _embedding_module(node: torch.fx.Node, gm: torch.fx.GraphModule, names: ModuleNames) -> str | None:
    import torch
    import torch.nn as nn

    def is_embedding(m: object) -> bool:
        return isinstance(m, nn.Embedding)

    # aten.embedding(weight, indices) from torch.export; F.embedding(indices, weight) where fx traces into an
    # nn.Embedding subclass's forward (BART's and Gemma's scaled word embeddings call super().forward()).
    return _applied_module(node, gm, names, is_embedding, (torch.ops.aten.embedding.default,), 0) or _applied_module(
        node, gm, names, is_embedding, (torch.nn.functional.embedding,), 1
    )


def embeddings_read_elsewhere(gm: torch.fx.GraphModule, names: ModuleNames) -> dict[str, str]:
    """The embeddings whose weight the whole traced graph `gm` also reads outside their lookups, with why each
    stays replicated: Whisper's decoder computes its logits as `x @ token_embedding.weight.T`. A vocab-parallel
    split (rowwise) would hand that matmul a sharded weight the code multiplies as a whole one; only a head that
    is a module (a tied nn.Linear) can be split alike. (fx and torch.export's unlifted module both read a
    weight through a get_attr node; an embedding called as a module fetches none.)"""
    import torch.nn as nn

    def is_embedding(m: object) -> bool:
        return isinstance(m, nn.Embedding)

    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        obj: Any = gm
        for atom in str(node.target).split("."):
            obj = getattr(obj, atom, None)
        name = names.owner(obj, is_embedding)
        if name is None or name in found:
            continue
        others = [u for u in node.users if _embedding_module(u, gm, names) != name]
        if others:
            found[name] = (
                f"{name} is not sharded (vocab-parallel): the model also reads its weight outside the lookup "
                f"(graph node {others[0].name}), as a whole matrix"
            )
    return found


def _is_tensor_node(node: torch.fx.Node) -> bool:
    import torch

    m = val_meta(node)
    return isinstance(m, torch.Tensor) or (hasattr(m, "shape") and hasattr(m, "dtype"))


def _holds_tensors(node: torch.fx.Node) -> bool:
    """A node whose value is a tuple or list of tensors (what split returns, before getitem picks one)."""
    m = val_meta(node)
    return isinstance(m, (list, tuple)) and any(hasattr(t, "shape") and hasattr(t, "dtype") for t in m)


def _is_mixing(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_module":
        return True  # a non-Linear module (norm, activation module) is checked by its type below
    base = name.split(".")[0].lstrip("_")
    if "norm" in base:
        return True
    return any(base == m or base.startswith(m + "_") for m in _MIXING)


def _ancestor_placeholders(nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """The unit inputs (placeholder nodes) that ``nodes`` are computed from."""
    found: set[torch.fx.Node] = set()
    seen: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        stack.extend(n.all_input_nodes)
    return found


# Ops whose result shares its input's storage: an in-place op on one writes into that input.
_VIEWS = {"slice", "select", "narrow", "view", "as_strided", "unsqueeze", "squeeze", "transpose", "permute",
          "expand", "getitem", "unflatten", "diagonal", "t", "alias"}


def _in_place_writes(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """node -> the in-place ops that write into it or into a view of it (DeepSeek-V2 builds its keys as
    `k = x.new_empty(...); k[..., :d].copy_(k_nope); k[..., d:].copy_(k_rot)`): the values they write are
    part of the node's value, though no edge of the graph leads from them to its users."""
    import operator

    import torch.fx

    writes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method") or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        if not (_op_name(n).endswith("_") or n.target is operator.setitem):
            continue
        base = n.args[0]
        while _op_name(base) in _VIEWS and base.args and isinstance(base.args[0], torch.fx.Node):
            writes.setdefault(base, []).append(n)
            base = base.args[0]
        writes.setdefault(base, []).append(n)
    return writes


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    m = val_meta(node) if hasattr(node, "meta") else None
    return tuple(int(d) for d in m.shape) if m is not None and hasattr(m, "shape") else None


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name: str = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0].lstrip("_")


def _prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _reshaped_dim(src: tuple[int, ...], out: tuple[int, ...], pos: int) -> int | None:
    """Where dimension ``pos`` of ``src`` is sharded after a reshape to ``out``: contiguous sharding splits
    the outermost output dimension that overlaps its span (the heads of (heads, head_dim))."""
    inner = _prod(src[pos + 1 :])
    span = inner * src[pos]
    for j in range(len(out)):
        lo, hi = _prod(out[j + 1 :]), _prod(out[j:])
        if lo < span and hi > inner and out[j] > 1:
            return j
    return None


def _norm_dim(d: object, rank: int) -> int | None:
    return d + rank if isinstance(d, int) and d < 0 else (d if isinstance(d, int) else None)


_RESHAPES = {"view", "reshape", "unsafe_view", "flatten", "unflatten", "contiguous_view"}
_TRANSPOSES = {"transpose", "swapaxes", "t"}
_COMPLEX_VIEWS = {"view_as_complex", "view_as_real"}
_SPLITS = {"split", "split_with_sizes", "chunk", "tensor_split", "unbind"}
_PARTS = {"slice", "narrow", "select"}
_ATTENTION_FNS = ("scaled_dot_product", "flash_attention", "efficient_attention")
_BATCHED_MATMULS = {"matmul", "bmm", "baddbmm", "einsum"}
_METADATA_ATTRS = {"device", "dtype", "is_cuda", "requires_grad", "ndim", "layout"}
_SAFE_MODULES = ("GELU", "ReLU", "SiLU", "Dropout", "Tanh", "Sigmoid", "Identity", "NewGELUActivation",
                 "GELUActivation", "FastGELUActivation", "QuickGELUActivation", "SiLUActivation")


@dataclass
class _Walk:
    """What following one column's output found: the row Linears reached and what sharding needs."""

    ends: set[torch.fx.Node] = field(default_factory=set)
    failure: str = ""
    # (node, value): absolute sizes on the sharded dimension
    literals: list[tuple[torch.fx.Node, int]] = field(default_factory=list)
    fused: int = 0  # chunks the column's width is split into before its heads (fused q/k/v)
    widths: list[int] = field(default_factory=list)  # the chunks' widths where taken at fixed offsets (slices)
    sliced: torch.fx.Node | None = None  # the tensor those slices take the chunks of
    attention: bool = False
    groups: int = 0  # how many pieces the sharded dimension holds where heads are split off (the head count)
    reported: bool = False  # a failure tp_refused lists (a fixed-offset slice, a weight on the sharded values)
    norms: set[str] = field(default_factory=set)  # norms over each head it passes (norm_heads: Qwen3's q_norm)
    # weights held whole that reach the sharded values broadcast along the sharded dimension (a learned scale over
    # head_dim shared by all heads): each rank computes its own heads' share of their gradient, summed over tp
    summed: set[str] = field(default_factory=set)


def _size_args(node: torch.fx.Node) -> list[Any]:
    args = list(node.args[1:])
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return list(args[0])
    return args


def _walk_column(
    col: torch.fx.Node,
    linears: dict[torch.fx.Node, str],
    activation_arg: dict[torch.fx.Node, Argument],
    sub: torch.fx.GraphModule,
    from_columns: set[torch.fx.Node],
    weights: dict[torch.fx.Node, tuple[str, str | None]] | None = None,
) -> _Walk:
    """Follow a column Linear's output, tracking which dimension of each tensor is sharded (its width,
    then its heads), to the row Linears it feeds; fail where an op would mix the sharded dimension, or
    applies a trainable weight (``weights``: node -> (name, its norm module or None)) to the sharded values:
    every rank holds that weight whole but would compute only its own heads' share of its gradient. A norm
    over each head's features ([b, s, heads, head_dim], heads sharded: Qwen3's q_norm / k_norm) is kept
    (``norms``): the run gives it the norm_heads style, which sums its weight's gradient over tp."""
    w = _Walk()
    weights = weights or {}
    streams: set[torch.fx.Node] | None = None  # the unit inputs the column reads, once a side input needs them
    stack = [(u, col, len(_shape(col) or ()) - 1) for u in col.users]
    seen: set[tuple[torch.fx.Node, torch.fx.Node, int]] = set()
    while stack and not w.failure:
        n, src, pos = stack.pop()
        if (n, src, pos) in seen:
            continue
        seen.add((n, src, pos))
        src_shape = _shape(src) or ()
        rank = len(src_shape)
        if n in linears:
            if activation_arg.get(n) is src and pos == rank - 1:
                w.ends.add(n)
            else:
                w.failure = f"its output reaches {linears[n]} other than as the input features"
            continue
        if n.op == "output":
            w.failure = "its output leaves the unit unreduced"
            continue
        out = _shape(n)
        name = _op_name(n)
        if name == "getattr" and len(n.args) > 1 and n.args[1] in _METADATA_ATTRS:
            continue  # x.device / x.dtype carry no values: what is built from them is not sharded
        new: int | None = pos
        if n.op == "call_module":
            target = cast(str, n.target)  # a call_module's target is the module's name
            if type(sub.get_submodule(target)).__name__ not in _SAFE_MODULES:
                w.failure = f"{type(sub.get_submodule(target)).__name__} is applied to it"
        elif name == "getitem":
            src_meta = val_meta(src)
            # fx's TensorMetadata is a NamedTuple: a tuple of values is one without a shape
            of_tuple = isinstance(src_meta, (list, tuple)) and not hasattr(src_meta, "shape")
            if not of_tuple and out is not None and out != src_shape:
                try:  # read from the index (HF's repeat_kv: `x[:, :, None, :, :]` adds a dimension after the heads)
                    new = indexed_dim(n.args[1], rank, pos)
                    taken = out[new] if new is not None else src_shape[pos]
                except ValueError:  # a tensor index: matched by sizes
                    new = _matching_dim(src_shape, out, pos)
                    taken = out[pos] if len(out) == rank else src_shape[pos]
                if taken != src_shape[pos]:
                    # q, k and v of a fused projection taken at fixed offsets (`qkv[..., :q_width]`, Phi-3's
                    # grouped-query qkv_proj): each chunk split over tp on its own, the offsets made the rank's in
                    # the traced graph (tp_graph); anything else along the sharded dimension takes wrong columns
                    first = w.sliced is None and pos == rank - 1 and not w.fused and not w.widths and not w.groups
                    widths = _slice_chunks(src, pos, rank) if first else []
                    if w.sliced is src:
                        new = pos  # another chunk of the same slices
                    elif widths:
                        w.widths, w.sliced, new = widths, src, pos
                    else:
                        w.failure = f"{name} takes part of it at fixed offsets along the sharded dimension"
                        w.reported = True
        elif name in _SPLITS:
            dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
            if _norm_dim(dim, rank) == pos:
                m = val_meta(n)
                heads = [int(t.shape[pos]) for t in m] if isinstance(m, (list, tuple)) else []
                if pos != rank - 1 and w.groups and heads and min(heads) < max(heads):
                    # q, k and v taken out of one projection by head counts (Falcon's multi-query
                    # `split([num_heads, 1, 1], dim=-2)`): the smallest group is what tp would have to split
                    why = (
                        "a single key/value head (multi-query attention) cannot be split over tensor-parallel ranks"
                        if min(heads) == 1 else "groups taken by head count are not sharded"
                    )
                    w.failure = f"{name} takes groups of {heads} heads out of it (q, k and v of one projection): {why}"
                    w.reported = True
                elif pos != rank - 1 or w.fused or w.widths:
                    w.failure = f"{name} splits it along the sharded dimension"
                else:
                    widths = [int(t.shape[pos]) for t in m] if isinstance(m, (list, tuple)) else []
                    if len(set(widths)) > 1:
                        # q, k and v of grouped-query attention split out of one projection (ChatGLM's
                        # `split([q, kv, kv], dim=-1)`): each chunk split over tp on its own (TP_FUSED gives the
                        # widths), the split's sizes made the rank's in the traced graph, as for slices
                        w.widths = widths
                    else:
                        w.fused = len(m) if isinstance(m, (list, tuple)) else 0
                    size = n.args[1] if len(n.args) > 1 else None
                    if isinstance(size, int) and name == "split":
                        w.literals.append((n, size))
        elif name in _PARTS and isinstance(out, tuple):
            # Part of a tensor by fixed offsets (torch.export's slice of `qkv[..., :q_width]`, as Phi-3 takes q,
            # k and v from its fused projection): along the sharded dimension the offsets are the unsharded
            # ones, so each rank would take the wrong columns.
            dim = _norm_dim(n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), rank)
            if dim == pos and (name == "select" or out[pos] != src_shape[pos]):
                w.failure = f"{name} takes part of it at fixed offsets along the sharded dimension"
                w.reported = True
            elif name == "select" and dim is not None and dim < pos:
                new = pos - 1
        elif out is None:
            new = pos  # a tuple (split) or a non-tensor: its items keep the dimension
        elif name in _RESHAPES or name == "expand":
            new = _reshaped_dim(src_shape, out, pos) if name in _RESHAPES else pos
            if new is not None and len(out) > rank and new < len(out) - 1:
                # chunks taken at offsets may hold different head counts (q 32, k and v 8): tp divides each
                w.groups = gcd(w.groups, out[new]) if w.widths else (w.groups or out[new])
            sizes = _size_args(n)
            if new is not None and len(sizes) == len(out) and isinstance(sizes[new], int) and sizes[new] != -1:
                w.literals.append((n, sizes[new]))
        elif name in ("stack", "unsqueeze") and isinstance(out, tuple):
            # A new dimension at `dim` of the output (GPT-J's rotary stacks pairs at the end, then flattens
            # them): the sharded one moves up by one only where the new one lies before it.
            d = _norm_dim(n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0), len(out))
            new = pos + 1 if d is not None and d <= pos else pos
            if name == "stack":
                other = next((a for a in n.all_input_nodes if a is not src and a not in from_columns), None)
                if other is not None:
                    w.failure = f"stack joins it with {other.name}, which every rank holds whole"
        elif name in _COMPLEX_VIEWS:
            # view_as_complex pairs the last dimension into complex numbers (rotary embeddings), view_as_real
            # splits them out again: the dimensions before it keep their places.
            if pos >= len(out or ()) or (name == "view_as_complex" and pos == rank - 1):
                w.failure = f"{name} pairs up the sharded dimension"
        elif name in _TRANSPOSES:
            a = _norm_dim(n.args[1] if len(n.args) > 1 else 0, rank)
            b = _norm_dim(n.args[2] if len(n.args) > 2 else 1, rank)
            new = b if pos == a else (a if pos == b else pos)
        elif name == "permute":
            dims = [_norm_dim(d, rank) for d in _size_args(n)]
            new = dims.index(pos) if pos in dims else None
        elif any(k in name for k in _ATTENTION_FNS):
            if pos >= rank - 2:
                w.failure = "attention sees it before its heads are split"
            w.attention = True
            new = len(out) - 3
            # The mask or bias added to the scores must broadcast over heads (T5's position bias does not).
            w.failure = w.failure or _side_input_conflict(n, src, out, new, from_columns)
        elif name in _BATCHED_MATMULS:
            if pos >= rank - 2:
                w.failure = f"{name} contracts the sharded dimension"
            w.attention = True
            new = len(out) - (rank - pos)
            # baddbmm's added input (BLOOM's ALiBi bias, [batch x heads, 1, seq]) must hold one rank's heads too
            w.failure = w.failure or _side_input_conflict(n, src, out, new, from_columns)
        elif pos == rank - 1 and _is_mixing(n):
            w.failure = f"{name} mixes the sharded width"
        else:
            new = len(out) - (rank - pos) if len(out) >= rank - pos else None
            w.failure = w.failure or _side_input_conflict(n, src, out, new, from_columns)
        if new is None and not w.failure:
            w.failure = f"the sharded dimension cannot be followed through {name}"
        held = next((weights[a] for a in n.all_input_nodes if a in weights and a is not src), None)
        if held is not None and not w.failure:
            param, norm = held
            if norm is not None and w.groups and new == NORM_HEADS_DIM and out is not None and len(out) == 4:
                w.norms.add(norm)
            else:
                # A weight every rank holds whole, broadcast along the sharded dimension (a scale over head_dim
                # shared by all heads): each rank computes its own heads' share of its gradient, which the run
                # sums over tp (TP_SUMMED). One that spans the sharded dimension failed above (side input).
                w.summed.add(param)
        if not w.failure:
            for side in n.all_input_nodes:
                if side is src or side in from_columns or side in weights:
                    continue
                streams = streams if streams is not None else _ancestor_placeholders([col])
                why = _side_weights(side, weights, streams, w.summed)
                if why:
                    w.failure = f"{name} combines it with {side.name}, {why}"
                    w.reported = True
                    break
        if not w.failure:
            stack.extend((u, n, cast(int, new)) for u in n.users)  # not None: a lost dimension is a failure
    return w


def _slice_chunks(src: torch.fx.Node, pos: int, rank: int) -> list[int]:
    """The widths of the chunks that `src`'s users take of its dimension `pos` at fixed offsets, in order, where
    every user is an index that slices that dimension alone (`src[..., a:b]`, step 1) and the slices tile it,
    each offset a number (q, k and v of a fused projection); [] otherwise."""
    shape = _shape(src)
    if not shape:
        return []
    width = shape[pos]
    spans = []
    for user in src.users:
        if _op_name(user) != "getitem" or len(user.args) < 2 or user.args[0] is not src:
            return []
        found = index_at(user.args[1], rank, pos)
        if found is None or found[1] is None:
            return []
        items, at = found[0], found[1]
        others = items[:at] + items[at + 1 :]
        cut = items[at]
        if not isinstance(cut, slice) or any(i is not Ellipsis and i != slice(None) for i in others):
            return []
        ends = []
        for v, default in ((cut.start, 0), (cut.stop, width)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                return []  # an offset computed in the graph
            v = default if v is None else v
            ends.append(min(width, max(0, v + width if v < 0 else v)))
        if cut.step not in (None, 1) or ends[1] <= ends[0]:
            return []
        spans.append((ends[0], ends[1]))
    spans.sort()
    if len(spans) < 2 or spans[0][0] != 0 or spans[-1][1] != width:
        return []
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return []
    return [b - a for a, b in spans]


def _matching_dim(src: tuple[int, ...], out: tuple[int, ...], pos: int) -> int | None:
    """After indexing, the output dimension that keeps the sharded one: same place from the right, or the
    only dimension of that size."""
    back = len(src) - pos
    if len(out) >= back and out[len(out) - back] == src[pos]:
        return len(out) - back
    same = [j for j, d in enumerate(out) if d == src[pos]]
    return same[0] if len(same) == 1 else None


def _side_weights(
    a: torch.fx.Node,
    weights: dict[torch.fx.Node, tuple[str, str | None]],
    streams: set[torch.fx.Node],
    summed: set[str],
) -> str:
    """A side input `a` combined with the sharded values (broadcast along the sharded dimension) carries back to
    what it is computed from only this rank's heads' share of its gradient. From trainable weights alone (a scale
    over head_dim, `self.scale.exp()`), those weights' gradients are summed over tp (added to `summed`); from the
    unit's input the columns read (`streams`) that gradient would be wrong on every rank, and no sum of weights'
    gradients mends it: the reason, else "". (A side input computed from a Linear's output is not one: the
    caller leaves those to the pairs' check of the row's inputs.)"""
    found: set[str] = set()
    seen: set[torch.fx.Node] = set()
    stack = [a]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in weights:
            found.add(weights[n][0])
        elif n.op == "get_attr" or not (_is_tensor_node(n) or _holds_tensors(n)):
            continue  # buffers and shape arithmetic carry no gradient (as the pairs' check of a row's inputs)
        elif n in streams:
            return (
                "computed from the block's input (the stream its projections read), whose gradient through it each "
                "rank would compute from its own heads only"
            )
        else:
            stack.extend(n.all_input_nodes)
    summed.update(found)
    return ""


def _side_input_conflict(
    n: torch.fx.Node, src: torch.fx.Node, out: tuple[int, ...], new: int | None, from_columns: set[torch.fx.Node]
) -> str:
    """A tensor combined elementwise with the sharded one must broadcast along the sharded dimension (a
    mask, a rotary table) or be sharded itself; a side input holding every head (T5's position bias) is not."""
    if new is None:
        return ""
    for a in n.all_input_nodes:
        if a is src or a in from_columns:
            continue
        shape = _shape(a)
        if not shape:
            continue
        back = len(out) - new
        if len(shape) >= back and shape[len(shape) - back] > 1:
            return (
                f"{_op_name(n)} combines it with {a.name} (shape {list(shape)}), which holds all "
                f"{shape[len(shape) - back]} heads/columns rather than one rank's share (a position bias over all "
                "heads, as T5's), so it cannot be split"
            )
    return ""


def _descendants(nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    found: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in found:
                found.add(u)
                stack.append(u)
    return found


@dataclass
class FoundPair:
    """A column/row pair found in one unit's graph, with what its sharding needs."""

    columns: list[str]
    row: str
    row_node: torch.fx.Node
    literals: list[tuple[torch.fx.Node, int]]  # (node, value): absolute sizes on the sharded dimension (see tp_info)
    fused: dict[str, int | list[int]]  # column -> chunks of a fused projection (q, k, v in one Linear): count or widths
    attention: bool  # the pair's path runs attention (its FLOPs are split by heads too)
    groups: int  # gcd of the pieces TP splits (head counts, else widths): tp must divide it
    norms: set[str] = field(default_factory=set)  # norms over each head between the columns and attention
    summed: set[str] = field(default_factory=set)  # weights held whole, broadcast over the heads (_Walk.summed)


def _embedding_indices_inside(node: torch.fx.Node, name: str) -> str:
    """Why a vocab-parallel split cannot apply to this embedding lookup: torch's RowwiseParallel masks the
    indices the module is called with, so indices the module computes in its own forward (BART's learned
    positions: `super().forward(arange(...) + offset)`) would meet a sharded weight unmasked. "" if it can."""
    import torch

    from planner.model.grouping import node_module_paths

    if node.op != "call_function" or len(node.args) < 2:
        return ""  # an fx call_module: the module is called with its indices
    indices: Any = node.args[0] if node.target is torch.nn.functional.embedding else node.args[1]
    paths = node_module_paths(indices) if hasattr(indices, "op") else []
    if indices.op != "placeholder" and any(p == name or p.startswith(name + ".") for p in paths):
        return "it computes its indices in its own forward (positions), so its calls' inputs are not the indices"
    return ""


def _activation_input(node: torch.fx.Node) -> Argument:
    """The graph node a projection node reads its input features from."""
    import torch

    if node.op == "call_function" and node.target in (torch.ops.aten.addmm.default, torch.addmm):
        return node.args[1]
    return node.args[0] if node.args else None


def detect_tp_pairs(
    sub: torch.fx.GraphModule, names: ModuleNames, constants: frozenset[str] = frozenset()
) -> tuple[list[FoundPair], list[str], list[str]]:
    """Column/row pairs inside one unit's graph: a projection (nn.Linear or HF Conv1D) whose output
    reaches, through elementwise, view and attention ops that keep its sharded dimension apart, exactly
    one other projection, which takes its input from those columns only; plus the unit's embeddings
    (vocab-parallel, rowwise). ``sub`` is the unit's split GraphModule after shape propagation.
    Returns ([FoundPair], embedding names, reasons why attention-like paths were not paired).
    """
    nodes = [n for n in sub.graph.nodes if n.op not in ("get_attr", "placeholder", "output")]
    linears = {n: name for n in nodes if (name := _linear_module(n, sub, names))}
    activation_arg = {n: _activation_input(n) for n in linears}
    embeddings: list[str] = []
    refused: list[str] = []
    for n in nodes:
        name = _embedding_module(n, sub, names)
        if not name:
            continue
        why = _embedding_indices_inside(n, name)
        if why:
            refused.append(f"{name} is not sharded (vocab-parallel): {why}")
        else:
            embeddings.append(name)
    from_columns = _descendants(linears) | set(linears)  # the columns too: gelu(x) reads x twice
    weights = _trainable_weights(sub, names)
    walks: dict[torch.fx.Node, _Walk] = {}
    for a in linears:
        w = _walk_column(a, linears, activation_arg, sub, from_columns, weights)
        if not w.failure and len(w.ends) == 1:
            walks[a] = w
        elif w.failure and (w.attention or w.fused or w.groups or w.reported):
            refused.append(f"{linears[a]} is not sharded: {w.failure}")
    terminal = {a: next(iter(w.ends)) for a, w in walks.items()}
    writes = _in_place_writes(sub.graph)
    pairs: list[FoundPair] = []
    by_row: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for a, r in terminal.items():
        by_row.setdefault(r, []).append(a)
    for r, cols in by_row.items():
        if r in terminal:  # a row Linear must not itself feed another Linear through the same path
            continue
        # Every tensor reaching the row's input must come from the columns, not also straight from the
        # unit's input the columns read (the residual stream). Other inputs are side data every rank holds
        # whole: buffers, rotary cos/sin tables and attention masks computed by an earlier unit.
        col_set = set(cols)
        streams = _ancestor_placeholders(cols)
        ok = True
        stack = list(r.all_input_nodes)
        seen: set[torch.fx.Node] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in linears:
                if n not in col_set:
                    ok = False
                    if any(walks[c].attention for c in cols):
                        # DeepSeek-V2's rotary key: one replicated projection broadcast over the sharded heads;
                        # each rank's backward would sum its gradient over its own heads only.
                        refused.append(
                            f"{', '.join(sorted(linears[c] for c in cols))} -> {linears[r]} is not sharded: its "
                            f"heads also read {linears[n]}, which is not sharded with them (each rank would "
                            "compute only its own heads' share of that projection's gradient)"
                        )
                continue
            if n.op == "get_attr" or not (_is_tensor_node(n) or _holds_tensors(n)):
                continue  # parameters, buffers and shape arithmetic (x.shape[0]) carry no sharded values
            if n.op == "placeholder":
                if n.name in constants or n not in streams:
                    continue  # a buffer, constant or side input (mask, rotary table), not the stream
                ok = False
                break
            stack.extend(n.all_input_nodes)
            for writer in writes.get(n, ()):
                stack.extend(writer.all_input_nodes)
        if not ok:
            continue
        groups = 0
        for c in cols:
            w = walks[c]
            width = (_shape(c) or (0,))[-1]
            groups = gcd(groups, w.groups or (gcd(*w.widths) if w.widths else width // max(1, w.fused or 1)))
        pairs.append(
            FoundPair(
                columns=sorted(linears[c] for c in cols),
                row=linears[r],
                row_node=r,
                literals=[lit for c in cols for lit in walks[c].literals],
                fused={linears[c]: chunks for c in cols if (chunks := walks[c].widths or walks[c].fused)},
                attention=any(walks[c].attention for c in cols),
                groups=groups,
                norms=set().union(*(walks[c].norms for c in cols)),
                summed=set().union(*(walks[c].summed for c in cols)),
            )
        )
    pairs.sort(key=lambda p: p.row)
    return pairs, embeddings, sorted(set(refused))


@dataclass
class TPInfo:
    """Tensor-parallel facts of one distinct unit, with module names of its first instance."""

    pairs: list[TPPair] = field(default_factory=list)
    styles: dict[str, str] = field(default_factory=dict)
    shard_params: int = 0
    shard_flops: float = 0.0  # linear FLOPs per sample that TP divides (attention added by the caller)
    granularity: int = 0
    gemm_dim: int = 0
    gemm_shapes: list[tuple[int, int, int, str]] = field(default_factory=list)  # (tokens, in, out, TP style or "")
    gather_bytes: int = 0
    unpaired_flops: float = 0.0  # forward FLOPs per sample of Linears that no TP pair covers
    head_attrs: dict[str, list[str]] = field(default_factory=dict)  # module -> attributes to divide by tp
    fused: dict[str, int | list[int]] = field(default_factory=dict)  # column -> chunks of a fused projection
    transposed: list[str] = field(default_factory=list)  # sharded Conv1D modules (weight stored [in, out])
    copied: list[str] = field(default_factory=list)  # row-parallel modules whose output the model changes in place
    summed: list[str] = field(default_factory=list)  # weights held whole whose gradient the run sums over tp
    refused: list[str] = field(default_factory=list)  # why a pair through attention was not sharded
    attention: bool = False  # some pair's path runs attention: its FLOPs divide by tp


# Attribute names that hold a per-rank count or width under TP (heads, the width of a split). Per-head sizes
# never change with tp, and names like layer_idx are not sizes at all.
_PER_HEAD = {"head_dim", "head_size", "attention_head_size", "key_value_proj_dim", "d_kv", "kv_channels"}
_WIDTHS = {"dim", "embed_dim", "hidden_size", "all_head_size", "inner_dim", "n_embd", "d_model", "width", "n_state"}


def _size_attr_rank(attr: str) -> int:
    """0: not a size TP divides; 1: a generic width name; 2: a head count, split size or Conv1D width."""
    a = attr.lower()
    if a in _PER_HEAD or a.startswith("_"):
        return 0
    if "head" in a or "split" in a or a == "nf":
        return 2
    return 1 if a in _WIDTHS else 0


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    out = []
    for atoms in zip(*parts):
        if len(set(atoms)) != 1:
            break
        out.append(atoms[0])
    return ".".join(out)


def _head_attrs(pair: FoundPair, names: ModuleNames, method: str) -> tuple[dict[str, list[str]], str]:
    """The module attributes each rank must divide by tp so the pair's reshapes see the local width.

    Each absolute size on the sharded dimension (``view(b, s, self.heads, -1)``, ``split(self.dim)``,
    Conv1D's ``nf``) is matched to an integer attribute of the modules the reshape runs in, inside the
    pair's attention/MLP module. Under torch.export every size is a number, also those read from tensor
    shapes (correct on each rank as it is): an unmatched size there is one of those. Under fx an
    unmatched size is a literal in the code: the pair is refused (returns the reason).
    """
    from planner.model.grouping import node_module_paths

    scope = _common_prefix([*pair.columns, pair.row]) or ""
    found: dict[str, set[str]] = {}
    for node, value in pair.literals:
        paths = node_module_paths(node)
        if any(p == pair.row or p.startswith(pair.row + ".") for p in paths):
            continue  # the row reads its (local) input width from the tensor
        inside = [p for p in reversed(paths) if p == scope or p.startswith(scope + ".") or not scope]
        best: list[tuple[int, str, str]] = []
        for path in inside or [scope]:
            mod = names.by_name.get(path)
            for attr, v in sorted(vars(mod).items()) if mod is not None else ():
                rank = _size_attr_rank(attr)
                if rank and isinstance(v, int) and not isinstance(v, bool) and v == value:
                    best.append((rank, path, attr))
            if best:
                break
        if best:
            top = max(r for r, _, _ in best)
            for r, path, attr in best:
                if r == top:
                    found.setdefault(path, set()).add(attr)
        elif method == "fx":
            where = scope or "the unit"
            return {}, (
                f"{', '.join(pair.columns)} -> {pair.row} is not sharded: {where} reshapes by the number {value} "
                f"({node.name}), which no attribute of it holds, so a rank cannot divide it by tp; write -1 for "
                "that size (x.view(b, s, -1, head_dim)) or keep it in an attribute such as self.num_heads"
            )
    return {k: sorted(v) for k, v in sorted(found.items())}, ""


def tp_info(
    sub: torch.fx.GraphModule,
    args: tuple[Any, ...],
    model: nn.Module,
    names: ModuleNames,
    constants: frozenset[str],
    method: str = "fx",
) -> TPInfo:
    """Shape-propagate one unit's graph on meta and find its column/row pairs and embeddings."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(sub).propagate(*args)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    names = ModuleNames(names.modules, names.params, names.by_name, dict(zip(placeholders, args)))
    pairs, embeddings, refused = detect_tp_pairs(sub, names, constants)
    info = TPInfo(gemm_dim=_gemm_dim_of(sub), refused=list(refused))
    for pair in pairs:
        attrs, why = _head_attrs(pair, names, method)
        if why:
            info.refused.append(why)
            continue
        for mod, names_ in attrs.items():
            info.head_attrs.setdefault(mod, [])
            info.head_attrs[mod] = sorted(set(info.head_attrs[mod]) | set(names_))
        info.fused.update(pair.fused)
        info.attention = info.attention or pair.attention
        out_bytes = nbytes_of_meta(val_meta(pair.row_node))
        info.pairs.append(TPPair(column=pair.columns, row=pair.row, allreduce_bytes=out_bytes))
        tokens = max(1, out_bytes // max(1, projection_dims(model.get_submodule(pair.row))[1] * _elem(pair.row_node)))
        for name in [*pair.columns, pair.row]:
            # A module applied several times (ALBERT's one shared layer, run 12 times) is one pair per call:
            # each call's FLOPs and all-reduce count, its parameters once.
            lin: Any = model.get_submodule(name)  # an nn.Linear or a Conv1D
            if name not in info.styles:
                if is_conv1d(lin):
                    info.transposed.append(name)
                bias = lin.bias.numel() if lin.bias is not None and name in pair.columns else 0
                info.shard_params += lin.weight.numel() + bias
            info.styles[name] = "colwise" if name in pair.columns else "rowwise"
            fin, fout = projection_dims(lin)
            info.shard_flops += 2.0 * fin * fout * tokens
        for norm in sorted(pair.norms):
            info.styles[norm] = "norm_heads"  # its weight stays whole: nothing more to shard or count
        info.summed = sorted(set(info.summed) | pair.summed)
        info.granularity = gcd(info.granularity, pair.groups)
    for name, node in _attention_modules(sub, names):
        # nn.MultiheadAttention kept as one call: its packed in_proj column-parallel in 3 chunks (q, k, v each by
        # heads) and its out_proj row-parallel (parallel.ShardedMultiheadAttention runs the shard).
        mha = cast("nn.MultiheadAttention", model.get_submodule(name))
        why = mha_shardable(mha)
        if why:
            info.refused.append(f"{name} (nn.MultiheadAttention) is not sharded: {why}")
            continue
        meta = val_meta(node)
        out = meta[0] if isinstance(meta, (list, tuple)) and not hasattr(meta, "shape") else meta
        out_bytes = nbytes_of_meta(out)
        row = f"{name}.out_proj"
        info.pairs.append(TPPair(column=[name], row=row, allreduce_bytes=out_bytes))
        info.styles[name], info.styles[row] = "colwise", "rowwise"
        info.fused[name] = 3
        info.attention = True
        in_bias = mha.in_proj_bias.numel() if mha.in_proj_bias is not None else 0
        info.shard_params += mha.in_proj_weight.numel() + in_bias + mha.out_proj.weight.numel()
        width = mha.embed_dim
        elem = torch.empty((), dtype=out.dtype).element_size() if out is not None else 1
        tokens = max(1, out_bytes // max(1, width * elem))
        info.shard_flops += 2.0 * width * 4 * width * tokens  # in_proj (3 E x E) and out_proj (E x E)
        info.granularity = gcd(info.granularity, mha.num_heads)
    for name, node in _output_linears(sub, names):
        # A Linear whose output leaves the model unmixed (the LM head): vocab-parallel, output gathered.
        head: Any = model.get_submodule(name)  # an nn.Linear or a Conv1D
        if is_conv1d(head):
            continue
        fin, fout = projection_dims(head)
        if fout <= fin:
            # A head narrower than its input (a classifier, a regression output) costs less than the block
            # before it: sharding saves little, its all-gather costs, and a few outputs cannot give every
            # rank a row. It stays replicated; only vocabulary-wide heads are split.
            continue
        info.styles[name] = "colwise_gather"
        info.gather_bytes += nbytes_of_meta(val_meta(node))
        info.shard_params += head.weight.numel() + (head.bias.numel() if head.bias is not None else 0)
        out_bytes = nbytes_of_meta(val_meta(node))
        tokens = max(1, out_bytes // max(1, fout * _elem(node)))
        info.shard_flops += 2.0 * fin * fout * tokens
    for node in sub.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        linear = _linear_module(node, sub, names)
        weight = _param_weight(node, sub, names)
        if linear in info.styles or (linear is None and weight is None):
            continue
        # Unsharded matmuls on parameters: unpaired Linears, routers (F.linear on their own weight).
        matrix = cast("torch.Tensor", weight)  # not None where linear is None (skipped above)
        fin, fout = projection_dims(model.get_submodule(linear)) if linear else (matrix.shape[-1], matrix.shape[0])
        out_b = nbytes_of_meta(val_meta(node))
        tok = max(1, out_b // max(1, fout * _elem(node)))
        info.unpaired_flops += 2.0 * fin * fout * tok
    for name in embeddings:
        info.styles[name] = "rowwise"
        info.shard_params += cast("nn.Embedding", model.get_submodule(name)).weight.numel()
    info.refused.extend(_linears_traced_through(sub, names))
    info.copied = _changed_in_place(sub, names, info.styles)
    info.transposed.sort()
    info.gemm_shapes = _gemm_shapes_of(sub, model, names, info.styles)
    return info


def _changed_in_place(sub: torch.fx.GraphModule, names: ModuleNames, styles: dict[str, str]) -> list[str]:
    """The unit's row-parallel modules whose output its code changes in place, or a view of it (Falcon's parallel
    attention: `mlp_output += attention_output`, which the tracer marks: tracers.IN_PLACE; `out.add_(x)`,
    `out[..., :d] = y`). torch's RowwiseParallel returns that output as a view of its reduced DTensor, which
    autograd does not let be modified in place: the runtime gives such a module's output as a copy
    (`parallel.apply_tp`), one tensor per call, and only for these."""
    import torch

    from planner.runtime.tracers import IN_PLACE

    linears = {node: _linear_module(node, sub, names) for node in sub.graph.nodes}
    rows = {node: name for node, name in linears.items() if name is not None and styles.get(name) == "rowwise"}
    targets: list[Any] = list(_in_place_writes(sub.graph))
    targets += [n.args[0] for n in sub.graph.nodes if n.meta.get(IN_PLACE) and n.args]
    out: set[str] = set()
    for base in targets:
        while isinstance(base, torch.fx.Node) and base not in rows and _op_name(base) in _VIEWS and base.args:
            base = base.args[0]
        if isinstance(base, torch.fx.Node) and base in rows:
            out.add(rows[base])
    return sorted(out)


def _linears_traced_through(sub: torch.fx.GraphModule, names: ModuleNames) -> list[str]:
    """Why the unit's nn.Linear subclasses with a forward of their own are not sharded: the trace runs through
    them (Falcon's FalconLinear computes `x @ weight.T`), so no Linear call is left to pair; one line each."""
    import torch.nn as nn

    out: list[str] = []
    seen: set[str] = set()
    for node in sub.graph.nodes:
        obj: Any = None
        if node.op == "placeholder":  # a parameter the unit's graph receives
            obj = names.inputs.get(node)
        elif node.op == "get_attr":
            obj = sub
            for atom in str(node.target).split("."):
                obj = getattr(obj, atom, None)
        for qual in names.params.get(id(obj), [])[:1] if obj is not None else []:
            owner = qual.rpartition(".")[0]
            mod = names.by_name.get(owner)
            if owner in seen or not isinstance(mod, nn.Linear) or type(mod).forward is nn.Linear.forward:
                continue
            seen.add(owner)
            out.append(
                f"{owner} is not sharded: it is a {type(mod).__name__}, a subclass of nn.Linear with a forward of its "
                "own, which the trace runs through (its matmul is no Linear call to pair as column and row)"
            )
    return out


def _trainable_weights(sub: torch.fx.GraphModule, names: ModuleNames) -> dict[torch.fx.Node, tuple[str, str | None]]:
    """The unit graph's nodes that are trainable parameters (fx get_attr, or torch.export's lifted weights
    that split_module passes in as placeholders), by node: their qualified names, and the module holding
    them where it is a norm (its class name says Norm), else None."""
    import torch

    found: dict[torch.fx.Node, tuple[str, str | None]] = {}
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            obj = names.inputs.get(n)
        elif n.op == "get_attr":
            obj = sub
            for atom in str(n.target).split("."):
                obj = getattr(obj, atom, None)
        else:
            continue
        if isinstance(obj, torch.nn.Parameter) and obj.requires_grad and id(obj) in names.params:
            name = names.params[id(obj)][0]
            owner = name.rpartition(".")[0]
            norm = "Norm" in type(names.by_name.get(owner)).__name__
            found[n] = (name, owner if norm else None)
    return found


def _param_weight(node: torch.fx.Node, gm: torch.fx.GraphModule, names: ModuleNames) -> torch.Tensor | None:
    """The 2-D parameter an F.linear node multiplies by, when it is one (a router's weight), else None."""
    import torch

    if node.op != "call_function" or node.target not in (torch.ops.aten.linear.default, torch.nn.functional.linear):
        return None
    w: Any = node.args[1] if len(node.args) > 1 else None  # a Node where op says so
    op = getattr(w, "op", None)
    if op == "placeholder":
        obj = names.inputs.get(w)
    elif op == "get_attr":
        obj = gm
        for atom in str(w.target).split("."):
            obj = getattr(obj, atom, None)
    else:
        return None
    return obj if id(obj) in names.params and getattr(obj, "dim", lambda: 0)() == 2 else None


def _attention_modules(sub: torch.fx.GraphModule, names: ModuleNames) -> list[tuple[str, torch.fx.Node]]:
    """The nn.MultiheadAttention modules the unit's graph calls (each once: a module applied twice is left whole)."""
    import torch.nn as nn

    def is_mha(m: object) -> bool:
        return isinstance(m, nn.MultiheadAttention)

    calls: dict[str, list[torch.fx.Node]] = {}
    for n in sub.graph.nodes:
        name = _applied_module(n, sub, names, is_mha, (), 0) if n.op == "call_module" else None
        if name:
            calls.setdefault(name, []).append(n)
    return [(name, nodes[0]) for name, nodes in calls.items() if len(nodes) == 1]


def _output_linears(sub: torch.fx.GraphModule, names: ModuleNames) -> list[tuple[str, torch.fx.Node]]:
    """Linears whose output reaches the unit's output through shape-preserving ops only, when the unit
    is the model's last (its output is the model output)."""
    out: list[tuple[str, torch.fx.Node]] = []
    for node in sub.graph.nodes:
        name = _linear_module(node, sub, names)
        if not name:
            continue
        users = list(node.users)
        if users and all(u.op == "output" for u in users):
            out.append((name, node))
    return out


def constant_inputs(parts: torch.fx.GraphModule, index: int) -> frozenset[str]:
    """Names of unit `index`'s inputs that are buffers or constants of the model (get_attr upstream)."""
    sub = getattr(parts, f"submod_{index}")
    call = next(n for n in parts.graph.nodes if n.op == "call_module" and n.target == f"submod_{index}")
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return frozenset(ph.name for ph, arg in zip(placeholders, call.args) if getattr(arg, "op", None) == "get_attr")


def _elem(node: torch.fx.Node) -> int:
    import torch

    m = val_meta(node)
    return torch.empty((), dtype=m.dtype).element_size() if m is not None else 1


def renamer(first: list[str], group: list[str]) -> Callable[[str], str]:
    """Map module names of a unit's first instance to another instance (blocks.0.x -> blocks.7.x)."""
    pairs = sorted(zip(first, group), key=lambda p: -len(p[0]))

    def rename(name: str) -> str:
        for a, b in pairs:
            if name == a or name.startswith(a + "."):
                return b + name[len(a) :]
        return name

    return rename


def _gemm_shapes_of(sub: torch.fx.GraphModule, model: nn.Module, names: ModuleNames, styles: dict[str, str]
                    ) -> list[tuple[int, int, int, str]]:
    """(tokens, in, out, TP style or "") of each Linear (or Conv1D) call in the unit's graph: the GEMM it runs,
    tokens x in x out, with tokens its output's rows (batch included; `tp_per_sample` divides)."""
    out = []
    for node in sub.graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        name = _linear_module(node, sub, names)
        if name is None:
            continue
        fin, fout = projection_dims(model.get_submodule(name))
        meta = val_meta(node)
        shape = getattr(meta, "shape", None)
        if shape is None or not len(shape) or int(shape[-1]) != fout:
            continue
        tokens = 1
        for d in shape[:-1]:
            tokens *= int(d)
        out.append((tokens, fin, fout, styles.get(name, "")))
    return out


def _gemm_dim_of(sub: nn.Module) -> int:
    """FLOP-weighted mean of min(in, out) over the unit's Linears: how large its GEMMs are."""
    import torch.nn as nn

    total = weight = 0.0
    for m in sub.modules():
        if isinstance(m, nn.Linear) or is_conv1d(m):
            fin, fout = projection_dims(m)
            w = float(fin * fout)
            total += w * min(fin, fout)
            weight += w
    return int(total / weight) if weight else 0
