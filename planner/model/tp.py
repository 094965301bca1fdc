"""Tensor-parallel facts of one unit: its column/row Linear pairs, vocab-parallel embeddings and head.

Pairs are found on the unit's traced graph (fx or torch.export) after shape propagation, by following
each Linear's output through elementwise, view and attention ops to the one Linear it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

from planner.model.counting import nbytes_of_meta, val_meta
from planner.model.graph import TPPair

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
    by_name: dict[str, object] = field(default_factory=dict)  # qualified name -> module
    inputs: dict = field(default_factory=dict)  # placeholder node -> the tensor a unit graph received

    @classmethod
    def of(cls, model) -> ModuleNames:
        params: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            params.setdefault(id(p), []).append(n)
        by_name = dict(model.named_modules(remove_duplicate=False))
        return cls({id(m): n for n, m in model.named_modules()}, params, by_name)

    def owner(self, param, kind) -> str | None:
        """Name of the module of type ``kind`` that holds ``param`` as its ``weight``, or None."""
        for full in self.params.get(id(param), ()):
            if full.endswith(".weight"):
                mod_name = full[: -len(".weight")]
                if isinstance(self.by_name.get(mod_name), kind):
                    return mod_name
        return None


def _applied_module(node, gm, names: ModuleNames, kind, aten_ops, weight_arg: int) -> str | None:
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
            return names.owner(obj, kind)
    return None


def _linear_module(node, gm, names: ModuleNames) -> str | None:
    """Qualified name of the nn.Linear a node applies."""
    import torch
    import torch.nn as nn

    return _applied_module(node, gm, names, nn.Linear, (torch.ops.aten.linear.default, torch.nn.functional.linear), 1)


def _embedding_module(node, gm, names: ModuleNames) -> str | None:
    import torch
    import torch.nn as nn

    return _applied_module(node, gm, names, nn.Embedding, (torch.ops.aten.embedding.default,), 0)


def _is_tensor_node(node) -> bool:
    import torch

    m = val_meta(node)
    return isinstance(m, torch.Tensor) or (hasattr(m, "shape") and hasattr(m, "dtype"))


def _splits_heads(node) -> bool:
    """A reshape that adds a dimension: the sharded width becomes (heads, head_dim)."""
    tgt = getattr(node.target, "__name__", str(node.target))
    if not any(k in tgt for k in ("view", "reshape", "unflatten")):
        return False
    out, src = val_meta(node), val_meta(node.args[0]) if node.args and hasattr(node.args[0], "meta") else None
    return out is not None and src is not None and len(out.shape) > len(src.shape)


def _is_mixing(node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_module":
        return True  # a non-Linear module (norm, activation module) is checked by its type below
    base = name.split(".")[0].lstrip("_")
    if "norm" in base:
        return True
    return any(base == m or base.startswith(m + "_") for m in _MIXING)


def _ancestor_placeholders(nodes) -> set:
    """The unit inputs (placeholder nodes) that ``nodes`` are computed from."""
    found: set = set()
    seen: set = set()
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


def detect_tp_pairs(
    sub, names: ModuleNames, constants: frozenset = frozenset()
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
        # Every tensor reaching the row's input must come from the columns, not also straight from the
        # unit's input the columns read (the residual stream). Other inputs are side data every rank holds
        # whole: buffers, rotary cos/sin tables and attention masks computed by an earlier unit.
        col_set = set(cols)
        streams = _ancestor_placeholders(cols)
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
                if n.name in constants or n not in streams:
                    continue  # a buffer, constant or side input (mask, rotary table), not the stream
                ok = False
                break
            stack.extend(n.all_input_nodes)
        if ok:
            pairs.append((sorted(linears[c] for c in cols), linears[r], r))
    pairs.sort(key=lambda p: p[1])
    return pairs, embeddings


def _split_groups(sub, model, name: str, names: ModuleNames) -> int:
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
class TPInfo:
    """Tensor-parallel facts of one distinct unit, with module names of its first instance."""

    pairs: list[TPPair] = field(default_factory=list)
    styles: dict[str, str] = field(default_factory=dict)
    shard_params: int = 0
    shard_flops: float = 0.0  # linear FLOPs per sample that TP divides (attention added by the caller)
    granularity: int = 0
    gemm_dim: int = 0
    gather_bytes: int = 0
    unpaired_flops: float = 0.0  # forward FLOPs per sample of Linears that no TP pair covers


def tp_info(sub, args: tuple, model, names: ModuleNames, constants: frozenset) -> TPInfo:
    """Shape-propagate one unit's graph on meta and find its column/row pairs and embeddings."""
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(sub).propagate(*args)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    names = ModuleNames(names.modules, names.params, names.by_name, dict(zip(placeholders, args)))
    pairs, embeddings = detect_tp_pairs(sub, names, constants)
    info = TPInfo(gemm_dim=_gemm_dim_of(sub))
    for cols, row, row_node in pairs:
        out_bytes = nbytes_of_meta(val_meta(row_node))
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
        info.gather_bytes += nbytes_of_meta(val_meta(node))
        info.shard_params += lin.weight.numel() + (lin.bias.numel() if lin.bias is not None else 0)
        out_bytes = nbytes_of_meta(val_meta(node))
        tokens = max(1, out_bytes // max(1, lin.out_features * _elem(node)))
        info.shard_flops += 2.0 * lin.in_features * lin.out_features * tokens
    for node in sub.graph.nodes:
        name = _linear_module(node, sub, names)
        if name and name not in info.styles:
            lin = model.get_submodule(name)
            out_b = nbytes_of_meta(val_meta(node))
            tok = max(1, out_b // max(1, lin.out_features * _elem(node)))
            info.unpaired_flops += 2.0 * lin.in_features * lin.out_features * tok
    for name in embeddings:
        info.styles[name] = "rowwise"
        info.shard_params += model.get_submodule(name).weight.numel()
    return info


def _output_linears(sub, names: ModuleNames) -> list:
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


def constant_inputs(parts, index: int) -> frozenset:
    """Names of unit `index`'s inputs that are buffers or constants of the model (get_attr upstream)."""
    sub = getattr(parts, f"submod_{index}")
    call = next(n for n in parts.graph.nodes if n.op == "call_module" and n.target == f"submod_{index}")
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    return frozenset(ph.name for ph, arg in zip(placeholders, call.args) if getattr(arg, "op", None) == "get_attr")


def _elem(node) -> int:
    import torch

    m = val_meta(node)
    return torch.empty((), dtype=m.dtype).element_size() if m is not None else 1


def renamer(first: list[str], group: list[str]):
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
