"""Grouping a traced graph into partition units and counting each unit's FLOPs, bytes and activations.

A unit is the smallest piece a pipeline stage takes whole: each block of the model's largest repeated
container (``blocks.0``, ``blocks.1``...), and the runs of other modules between them (embeddings before,
final norm and head after). Each distinct unit (by structure and input shapes) is analysed once, on the
meta device: forward and backward are run under a dispatch mode that counts FLOPs per op class with
torch's own FLOP formulas, and saved-tensor hooks that measure what autograd keeps for backward.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from math import gcd

from planner.errors import TraceError
from planner.model.graph import ModelGraph, TPPair, Unit
from planner.model.load import DTYPE_BYTES, LoadedModel, build_meta_model, meta_inputs
from planner.model.trace import trace_model

log = logging.getLogger(__name__)

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
# Ops that mix values along the hidden dimension: a column-sharded tensor must not reach them.
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
class _Counts:
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


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _make_counter(counts: _Counts):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    class OpCounter(TorchDispatchMode):
        """Counts FLOPs (torch's formulas) and memory-bound bytes per op class, forward or backward."""

        phase = "fwd"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            name = packet.__name__
            flops = 0.0
            if packet in flop_registry:
                flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            fwd = self.phase == "fwd"
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
                    nbytes = 2 * _tensor_bytes(out)  # a gather reads only the rows it returns
                else:
                    flat, _ = tree_flatten((args, kwargs, out))
                    nbytes = sum(_tensor_bytes(t) for t in flat if isinstance(t, torch.Tensor))
                if fwd:
                    counts.fwd_mem_bytes += nbytes
                else:
                    counts.bwd_mem_bytes += nbytes
            return out

    return OpCounter()


def _flash_mode(counts: _Counts):
    """Replace scaled_dot_product_attention by a flash-attention stand-in while counting.

    On a GPU, SDPA runs a fused kernel that keeps q, k, v, the output and the log-sum-exp for backward
    (Dao et al. 2022), not the s x s attention map the meta device's math fallback would save. Its FLOPs
    are 4*b*h*s_q*s_k*d forward (QK^T and AV) and twice that backward.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class _Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, _, _ = ctx.saved_tensors
            flops = 8.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
            counts.bwd_attention += flops
            counts.bwd_flops += flops
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    class FlashMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                q, k, v = args[:3]
                if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
                    rep = q.shape[-3] // k.shape[-3]
                    k = k.repeat_interleave(rep, dim=-3)
                    v = v.repeat_interleave(rep, dim=-3)
                flops = 4.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
                counts.fwd_attention += flops
                counts.fwd_flops += flops
                counts.flash = True
                return _Flash.apply(q, k, v)
            return func(*args, **kwargs)

    return FlashMode()


def _storage_key(t) -> int:
    return t.untyped_storage()._cdata


def analyse_callable(fn, inputs: tuple, params: list, seq_len: int | None) -> _Counts:
    """Run fn(*inputs) forward and backward on meta tensors, counting FLOPs, bytes and saved activations."""
    import torch

    counts = _Counts()
    param_keys = {_storage_key(p) for p in params}
    ins = tuple(
        t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs
    )
    sizes: dict[int, int] = {}

    def pack(t):
        key = _storage_key(t)
        if key not in param_keys:
            sizes[key] = max(sizes.get(key, 0), t.untyped_storage().nbytes())
            if seq_len and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == seq_len and seq_len > 1:
                counts.attention_core.add(key)
        return t

    counter = _make_counter(counts)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _flash_mode(counts), counter:
        out = fn(*ins)
    counts.saved = sizes
    outs = [o for o in _flatten_tensors(out) if o.requires_grad]
    if outs:
        counter.phase = "bwd"
        with counter:
            torch.autograd.backward(outs, grad_tensors=[torch.ones_like(o) for o in outs])
    return counts


def _flatten_tensors(x) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(x)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def find_block_container(model) -> str | None:
    """Qualified name of the largest ModuleList/Sequential of two or more same-type modules, or None."""
    import torch.nn as nn

    best: tuple[int, str] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            children = list(mod.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                if best is None or len(children) > best[0]:
                    best = (len(children), name)
    return best[1] if best else None


def unit_roots(model, container: str | None) -> tuple[list[str], set[str]]:
    """Modules that become units (in definition order) and the subset that are repeated blocks."""
    if container is None:
        return [n for n, _ in model.named_children()], set()
    roots: list[str] = []
    parts = container.split(".") if container else []
    prefix = ""
    mod = model
    for part in parts:
        for n, _ in mod.named_children():
            if n != part:
                roots.append(f"{prefix}{n}")
        mod = getattr(mod, part)
        prefix = f"{prefix}{part}."
    blocks = [f"{container}.{n}" for n, _ in mod.named_children()]
    return roots + blocks, set(blocks)


def _node_module_paths(node) -> list[str]:
    """Module paths (outer to inner) that a graph node executes under (the generated script's rule)."""
    from planner.runtime.stages import module_paths

    return module_paths(node)


def assign_nodes(gm, roots: list[str]) -> dict:
    """Map each compute node of the graph to the unit root that owns it (None before any module).

    Rule (shared with the generated train.py): a node belongs to the outermost unit root on its module
    stack; module-less nodes go with the nearest preceding owned node; get_attr nodes go with their first
    user (and are copied into every stage that uses them).
    """
    from planner.runtime.stages import owner_of

    root_set = set(roots)
    owner: dict = {}
    current = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        # the path itself or the root it lies under, innermost-first along the stack as the script does
        found = next((o for o in (owner_of(p, root_set) for p in _node_module_paths(node)) if o), None)
        if found is not None:
            current = found
        owner[node] = current
    return owner


def _group_units(gm, roots: list[str], blocks: set[str]) -> tuple[list[list[str]], dict]:
    """Merge roots into contiguous units in execution order; returns (unit root lists, node -> unit index)."""
    owner = assign_nodes(gm, roots)
    order = [n for n in gm.graph.nodes if n in owner]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, n in enumerate(order):
        r = owner[n]
        if r is None:
            continue
        first.setdefault(r, i)
        last[r] = i
    if not first:
        raise TraceError(
            "The traced model calls none of its submodules, so it cannot be split into pipeline units. "
            "Structure the model as modules (embedding, blocks in an nn.ModuleList, head)."
        )
    spans = sorted(first, key=lambda r: first[r])
    groups: list[list[str]] = []
    end = -1
    for r in spans:
        if groups and first[r] <= end:
            groups[-1].append(r)  # interleaved use (shared or re-entered module): keep together
        else:
            groups.append([r])
        end = max(end, last[r])
    # Consecutive non-block groups (embeddings + dropout, final norm + head) become one unit.
    merged: list[list[str]] = []
    for g in groups:
        is_block = len(g) == 1 and g[0] in blocks
        if merged and not is_block and not (len(merged[-1]) == 1 and merged[-1][0] in blocks):
            merged[-1].extend(g)
        else:
            merged.append(list(g))
    index = {r: i for i, g in enumerate(merged) for r in g}
    node_unit: dict = {}
    for n in order:
        r = owner[n]
        node_unit[n] = index[r] if r is not None else 0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            users = [node_unit[u] for u in n.users if u in node_unit]
            node_unit[n] = min(users) if users else 0
    return merged, node_unit


def _unit_name(group: list[str]) -> str:
    return group[0] if len(group) == 1 else "+".join(group)


def _val_meta(node):
    tm = node.meta.get("tensor_meta")
    if tm is not None:
        return tm
    return node.meta.get("val")


def _nbytes_of_meta(m) -> int:
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
        return sum(_nbytes_of_meta(x) for x in m)
    return 0


@dataclass
class _Names:
    """Original qualified names of modules and parameters, by object (split_module renames them)."""

    modules: dict[int, str]
    params: dict[int, str]
    inputs: dict = field(default_factory=dict)  # placeholder node -> the tensor a unit graph received

    @classmethod
    def of(cls, model) -> _Names:
        return cls({id(m): n for n, m in model.named_modules()}, {id(p): n for n, p in model.named_parameters()})


def _applied_module(node, gm, names: _Names, kind, aten_ops, weight_arg: int) -> str | None:
    """Qualified name of the module of type `kind` a node applies (fx call_module, or an aten op on its
    weight for graphs from torch.export)."""
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
        except AttributeError:
            return None
        return names.modules.get(id(mod)) if isinstance(mod, kind) else None
    if node.op == "call_function" and node.target in aten_ops and len(node.args) > weight_arg:
        w = node.args[weight_arg]
        op = getattr(w, "op", None)
        if op in ("get_attr", "placeholder"):
            if op == "placeholder":  # a weight split_module passed in from the parent graph
                obj = names.inputs.get(w)
            else:
                obj = gm
                for atom in str(w.target).split("."):
                    obj = getattr(obj, atom, None)
            full = names.params.get(id(obj), "")
            if full.endswith(".weight"):
                return full[: -len(".weight")]
    return None


def _linear_module(node, gm, names: _Names) -> str | None:
    """Qualified name of the nn.Linear a node applies."""
    import torch
    import torch.nn as nn

    return _applied_module(node, gm, names, nn.Linear, (torch.ops.aten.linear.default, torch.nn.functional.linear), 1)


def _embedding_module(node, gm, names: _Names) -> str | None:
    import torch
    import torch.nn as nn

    return _applied_module(node, gm, names, nn.Embedding, (torch.ops.aten.embedding.default,), 0)


def _is_tensor_node(node) -> bool:
    import torch

    m = _val_meta(node)
    return isinstance(m, torch.Tensor) or (hasattr(m, "shape") and hasattr(m, "dtype"))


def _splits_heads(node) -> bool:
    """A reshape that adds a dimension: the sharded width becomes (heads, head_dim)."""
    tgt = getattr(node.target, "__name__", str(node.target))
    if not any(k in tgt for k in ("view", "reshape", "unflatten")):
        return False
    out, src = _val_meta(node), _val_meta(node.args[0]) if node.args and hasattr(node.args[0], "meta") else None
    return out is not None and src is not None and len(out.shape) > len(src.shape)


def _is_mixing(node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_module":
        return True  # a non-Linear module (norm, activation module) is checked by its type below
    base = name.split(".")[0].lstrip("_")
    if "norm" in base:
        return True
    return any(base == m or base.startswith(m + "_") for m in _MIXING)


def detect_tp_pairs(
    sub, names: _Names, constants: frozenset = frozenset()
) -> tuple[list[tuple[list[str], str, object]], list[str]]:
    """Column/row Linear pairs inside one unit's graph: a Linear feeding, through elementwise, view and
    attention ops only, exactly one other Linear, which in turn takes its input from those columns only;
    plus the unit's embeddings (vocab-parallel, rowwise). ``sub`` is the unit's split GraphModule after
    shape propagation. Returns ([(column names, row name, row node)], embedding names).
    """
    import torch.nn as nn

    nodes = [n for n in sub.graph.nodes if n.op not in ("get_attr", "placeholder", "output")]
    linears = {n: name for n in nodes if (name := _linear_module(n, sub, names))}
    embeddings = [name for n in nodes if (name := _embedding_module(n, sub, names))]
    terminal: dict = {}
    for a in linears:
        ends: set = set()
        ok = True
        seen = set()
        # (node, heads_split): once a view splits the sharded width into (heads, head_dim), ops along
        # the last dimension (rotary cat, per-head norms) no longer touch the sharded dimension.
        stack = [(u, False) for u in a.users]
        while stack and ok:
            n, split = stack.pop()
            if (n, split) in seen:
                continue
            seen.add((n, split))
            if n in linears:
                ends.add(n)
                continue
            if n.op == "output":
                ok = False
                break
            if n.op == "call_module":
                mod = sub.get_submodule(n.target)
                if not isinstance(mod, (nn.GELU, nn.ReLU, nn.SiLU, nn.Dropout, nn.Tanh, nn.Sigmoid, nn.Identity)):
                    ok = False
                    break
            elif not split and _is_mixing(n):
                ok = False
                break
            split = split or _splits_heads(n)
            stack.extend((u, split) for u in n.users)
        if ok and len(ends) == 1:
            terminal[a] = next(iter(ends))
    pairs = []
    by_row: dict = {}
    for a, r in terminal.items():
        by_row.setdefault(r, []).append(a)
    for r, cols in by_row.items():
        if r in terminal:  # a row Linear must not itself feed another Linear through the same path
            continue
        # Every tensor reaching the row's input must come from the columns (or constants such as rotary
        # tables), not also straight from the unit's input (the residual stream).
        col_set = set(cols)
        ok = True
        stack = list(r.all_input_nodes)
        seen = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in linears:
                if n not in col_set:
                    ok = False
                continue
            if n.op == "get_attr" or not _is_tensor_node(n):
                continue  # parameters, buffers and shape arithmetic (x.shape[0]) carry no sharded values
            if n.op == "placeholder":
                if n.name in constants:
                    continue  # a buffer or constant read by the unit, not an activation
                ok = False
                break
            stack.extend(n.all_input_nodes)
        if ok:
            pairs.append((sorted(linears[c] for c in cols), linears[r], r))
    pairs.sort(key=lambda p: p[1])
    return pairs, embeddings


@dataclass
class _UnitInfo:
    group: list[str]
    index: int
    signature: str = ""


def _structure_key(model, group: list[str], blocks: set[str]) -> str:
    """Structural identity of a unit: equal for repeated identical blocks, unique otherwise."""
    if all(r in blocks for r in group):
        return "|".join(f"{type(model.get_submodule(r)).__name__}:{model.get_submodule(r)!r}" for r in group)
    return "|".join(group)


def _meta_like(x):
    """A fresh meta tensor of x's shape and dtype (pytrees mapped), to stand in for a repeated output."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t, x
    )


def run_units_once(parts, inputs: tuple, keys: dict[int, str]):
    """Run the split model on meta, executing each distinct (unit structure, input shapes) only once.

    Returns (model output, inputs captured per unit index, the unit index -> signature map). Identical
    blocks with identical input shapes have identical output shapes, so repeated ones are skipped.
    """
    import torch
    from torch.utils._pytree import tree_flatten

    env: dict = {}
    captured: dict[int, tuple] = {}
    sigs: dict[int, str] = {}
    cache: dict[str, object] = {}
    it = iter(inputs)
    out = None
    with torch.no_grad():
        for node in parts.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "call_module":
                idx = int(node.target.split("_")[1])
                args = tuple(env[a] if isinstance(a, torch.fx.Node) else a for a in node.args)
                flat, _ = tree_flatten(args)
                shapes = tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in flat)
                sig = hashlib.sha256(repr((keys[idx], shapes)).encode()).hexdigest()[:16]
                sigs[idx] = sig
                captured[idx] = args
                if sig not in cache:
                    cache[sig] = getattr(parts, node.target)(*args)
                env[node] = _meta_like(cache[sig])
            elif node.op == "call_function":
                args = tuple(env[a] if isinstance(a, torch.fx.Node) else a for a in node.args)
                env[node] = node.target(*args)
            elif node.op == "get_attr":
                obj = parts
                for atom in str(node.target).split("."):
                    obj = getattr(obj, atom)
                env[node] = obj
            elif node.op == "output":
                out = torch.fx.graph.map_arg(node.args[0], lambda n: env[n])
    return out, captured, sigs


def analyse_model(loaded: LoadedModel) -> ModelGraph:
    """Build on meta, trace, group into units and analyse each distinct unit once."""
    import torch
    from torch.fx.passes.split_module import split_module

    model = build_meta_model(loaded)
    inputs = meta_inputs(loaded, 1)
    n_in = model_input_count(model, len(inputs))
    container = find_block_container(model)
    roots, blocks = unit_roots(model, container)

    def split_and_run(gm):
        groups, node_unit = _group_units(gm, roots, blocks)
        parts = split_module(gm, model, lambda n: node_unit[n], keep_original_order=True)
        keys = {i: _structure_key(model, g, blocks) for i, g in enumerate(groups)}
        out, captured, sigs = run_units_once(parts, inputs[:n_in], keys)
        return groups, node_unit, parts, out, captured, sigs

    traced = trace_model(model, inputs[:n_in], loaded.source.path, check=split_and_run)
    groups, node_unit, parts, out, captured, unit_sig = traced.checked

    dtype_bytes = DTYPE_BYTES[loaded.source.dtype]
    tokens = None
    first = inputs[0]
    if not first.is_floating_point() and first.dim() >= 2:
        tokens = int(first.shape[1])

    # Bytes live across each cut: values produced at or before unit i and used after it.
    produced: dict = {}
    last_use: dict = {}
    sizes: dict = {}
    for node in parts.graph.nodes:
        if node.op == "placeholder":
            produced[node] = -1
        elif node.op == "call_module" and node.target.startswith("submod_"):
            produced[node] = int(node.target.split("_")[1])
        elif node.op == "call_function":  # getitem of a submodule's tuple output
            src = node.args[0]
            produced[node] = produced.get(src, -1)
        for arg in node.all_input_nodes:
            if node.op == "call_module" and node.target.startswith("submod_"):
                last_use[arg] = max(last_use.get(arg, -1), int(node.target.split("_")[1]))
            elif node.op == "output":
                last_use[arg] = len(groups)
    for node in parts.graph.nodes:
        if node.op == "call_module" and node.target.startswith("submod_"):
            idx = int(node.target.split("_")[1])
            for arg, val in zip(node.args, captured.get(idx, ())):
                if isinstance(val, torch.Tensor):
                    sizes[arg] = _tensor_bytes(val)

    params_by_name = dict(model.named_parameters())
    names = _Names.of(model)
    root_attrs: dict[int, list[str]] = {}
    for n, u in node_unit.items():
        if n.op == "get_attr" and str(n.target) in params_by_name:
            root_attrs.setdefault(u, []).append(str(n.target))
    units: list[Unit] = []
    analysed: dict[str, _Counts] = {}
    tp_info: dict[str, tuple[list[str], _TPInfo]] = {}
    seq = tokens
    for i, group in enumerate(groups):
        sub = getattr(parts, f"submod_{i}", None)
        unit_params = {}
        for r in group:
            for pn, p in model.get_submodule(r).named_parameters(prefix=r):
                unit_params[pn] = p
        for name in root_attrs.get(i, ()):  # root-level parameters fetched by get_attr
            unit_params.setdefault(name, params_by_name[name])
        args = captured.get(i, ())
        sig = unit_sig[i]
        if sig not in analysed:
            if sub is None:
                analysed[sig] = _Counts()
            else:
                analysed[sig] = analyse_callable(sub, args, list(unit_params.values()), seq)
                tp_info[sig] = (group, _tp_info(sub, args, model, names, _constant_inputs(parts, i)))
        c = analysed[sig]
        n_params = sum(p.numel() for p in unit_params.values())
        act = sum(c.saved.values())
        core = sum(v for k, v in c.saved.items() if k in c.attention_core)
        in_bytes = sum(_tensor_bytes(a) for a in args if isinstance(a, torch.Tensor))
        out_bytes = sum(sizes.get(v, 0) for v, p in produced.items() if p <= i < last_use.get(v, -1))

        first_group, info = tp_info.get(sig, (group, _TPInfo()))
        rename = _renamer(first_group, group)
        tp_pairs = [
            TPPair(column=[rename(c) for c in p.column], row=rename(p.row), allreduce_bytes=p.allreduce_bytes)
            for p in info.pairs
        ]
        styles = {rename(k): v for k, v in info.styles.items()}
        shard_flops = info.shard_flops + (c.fwd_attention if tp_pairs else 0.0)  # heads split with q/k/v
        if tp_pairs:
            # Matmuls between a column and its row Linear (explicit QK^T and AV after the head split) are
            # split by heads too: everything but the unit's unpaired Linears divides by t.
            shard_flops = max(shard_flops, c.fwd_matmul - info.unpaired_flops + c.fwd_attention)
        if i < len(groups) - 1 and info.gather_bytes:
            styles = {k: v for k, v in styles.items() if v != "colwise_gather"}  # only the model's output
            shard_flops -= info.shard_flops
        units.append(
            Unit(
                name=_unit_name(group),
                modules=list(group),
                kind="block" if all(r in blocks for r in group) else "other",
                signature=sig,
                params=n_params,
                param_bytes=sum(p.numel() * p.element_size() for p in unit_params.values()),
                fwd_flops=c.fwd_flops,
                bwd_flops=c.bwd_flops,
                matmul_flops=c.fwd_matmul,
                attention_flops=c.fwd_attention,
                memory_bound_bytes=c.fwd_mem_bytes,
                bwd_matmul_flops=c.bwd_matmul,
                bwd_attention_flops=c.bwd_attention,
                bwd_memory_bound_bytes=c.bwd_mem_bytes,
                activation_bytes=act,
                attention_core_bytes=core,
                input_bytes=in_bytes,
                output_bytes=out_bytes if i < len(groups) - 1 else sum(_tensor_bytes(t) for t in _flatten_tensors(out)),
                tp_pairs=tp_pairs,
                tp_shardable_params=info.shard_params if styles else 0,
                tp_gather_bytes=info.gather_bytes if i == len(groups) - 1 else 0,
                tp_shardable_flops=min(shard_flops, c.fwd_flops),
                tp_styles=styles,
                uses_flash_attention=c.flash,
                gemm_dim=info.gemm_dim,
                tp_granularity=info.granularity,
            )
        )
    return ModelGraph(
        source=loaded.source,
        model_class=type(model).__name__,
        trace_method=traced.method,  # type: ignore[arg-type]
        units=units,
        total_params=sum(p.numel() for p in model.parameters()),
        tokens_per_sample=tokens,
        sample_input_shapes=[list(t.shape) for t in inputs],
        distinct_blocks=len(analysed),
        dtype_bytes=dtype_bytes,
    )


def _split_groups(sub, model, name: str, names: _Names) -> int:
    """How many pieces a column Linear's output can be split into: its head count when a view splits
    the output into (..., heads, head_dim), else its width."""
    out = model.get_submodule(name).out_features
    for node in sub.graph.nodes:
        if _linear_module(node, sub, names) != name:
            continue
        for user in node.users:
            tgt = getattr(user.target, "__name__", str(user.target))
            if any(k in tgt for k in ("view", "reshape", "unflatten")) and user.args:
                last = user.args[-1]
                if isinstance(last, (tuple, list)) and last:
                    last = last[-1]
                if isinstance(last, int) and last > 1 and out % last == 0:
                    return out // last
    return out


@dataclass
class _TPInfo:
    """Tensor-parallel facts of one distinct unit, with module names of its first instance."""

    pairs: list[TPPair] = field(default_factory=list)
    styles: dict[str, str] = field(default_factory=dict)
    shard_params: int = 0
    shard_flops: float = 0.0  # linear FLOPs per sample that TP divides (attention added by the caller)
    granularity: int = 0
    gemm_dim: int = 0
    gather_bytes: int = 0
    unpaired_flops: float = 0.0  # forward FLOPs per sample of Linears that no TP pair covers


def _tp_info(sub, args: tuple, model, names: _Names, constants: frozenset) -> _TPInfo:
    """Shape-propagate one unit's graph on meta and find its column/row pairs and embeddings."""
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(sub).propagate(*args)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    names = _Names(names.modules, names.params, dict(zip(placeholders, args)))
    pairs, embeddings = detect_tp_pairs(sub, names, constants)
    info = _TPInfo(gemm_dim=_gemm_dim_of(sub))
    for cols, row, row_node in pairs:
        out_bytes = _nbytes_of_meta(_val_meta(row_node))
        info.pairs.append(TPPair(column=cols, row=row, allreduce_bytes=out_bytes))
        tokens = max(1, out_bytes // max(1, model.get_submodule(row).out_features * _elem(row_node)))
        for name in [*cols, row]:
            info.styles[name] = "colwise" if name in cols else "rowwise"
            lin = model.get_submodule(name)
            bias = lin.bias.numel() if lin.bias is not None and name in cols else 0
            info.shard_params += lin.weight.numel() + bias
            info.shard_flops += 2.0 * lin.in_features * lin.out_features * tokens
        for col in cols:
            info.granularity = gcd(info.granularity, _split_groups(sub, model, col, names))
    for name, node in _output_linears(sub, names):
        # A Linear whose output leaves the model unmixed (the LM head): vocab-parallel, output gathered.
        lin = model.get_submodule(name)
        info.styles[name] = "colwise_gather"
        info.gather_bytes += _nbytes_of_meta(_val_meta(node))
        info.shard_params += lin.weight.numel() + (lin.bias.numel() if lin.bias is not None else 0)
        out_bytes = _nbytes_of_meta(_val_meta(node))
        tokens = max(1, out_bytes // max(1, lin.out_features * _elem(node)))
        info.shard_flops += 2.0 * lin.in_features * lin.out_features * tokens
    for node in sub.graph.nodes:
        name = _linear_module(node, sub, names)
        if name and name not in info.styles:
            lin = model.get_submodule(name)
            out_b = _nbytes_of_meta(_val_meta(node))
            tok = max(1, out_b // max(1, lin.out_features * _elem(node)))
            info.unpaired_flops += 2.0 * lin.in_features * lin.out_features * tok
    for name in embeddings:
        info.styles[name] = "rowwise"
        info.shard_params += model.get_submodule(name).weight.numel()
    return info


def _output_linears(sub, names: _Names) -> list:
    """Linears whose output reaches the unit's output through shape-preserving ops only, when the unit
    is the model's last (its output is the model output)."""
    out = []
    for node in sub.graph.nodes:
        name = _linear_module(node, sub, names)
        if not name:
            continue
        users = list(node.users)
        if users and all(u.op == "output" for u in users):
            out.append((name, node))
    return out


def _constant_inputs(parts, index: int) -> frozenset:
    """Names of unit `index`'s inputs that are buffers or constants of the model (get_attr upstream)."""
    sub = getattr(parts, f"submod_{index}")
    call = next(n for n in parts.graph.nodes if n.op == "call_module" and n.target == f"submod_{index}")
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return frozenset(ph.name for ph, arg in zip(placeholders, call.args) if getattr(arg, "op", None) == "get_attr")


def _elem(node) -> int:
    import torch

    m = _val_meta(node)
    return torch.empty((), dtype=m.dtype).element_size() if m is not None else 1


def _renamer(first: list[str], group: list[str]):
    """Map module names of a unit's first instance to another instance (blocks.0.x -> blocks.7.x)."""
    pairs = sorted(zip(first, group), key=lambda p: -len(p[0]))

    def rename(name: str) -> str:
        for a, b in pairs:
            if name == a or name.startswith(a + "."):
                return b + name[len(a) :]
        return name

    return rename


def _gemm_dim_of(sub) -> int:
    """FLOP-weighted mean of min(in, out) over the unit's Linears: how large its GEMMs are."""
    import torch.nn as nn

    total = weight = 0.0
    for m in sub.modules():
        if isinstance(m, nn.Linear):
            w = float(m.in_features * m.out_features)
            total += w * min(m.in_features, m.out_features)
            weight += w
    return int(total / weight) if weight else 0


def model_input_count(model, available: int) -> int:
    """How many leading example inputs the model's forward takes (the rest go to the loss only): the
    generated script's rule."""
    from planner.runtime.model import input_count

    return input_count(model, available)
