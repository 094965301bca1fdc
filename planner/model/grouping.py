"""Grouping a traced graph into partition units: which modules are units, and which graph nodes each owns.

A unit is the smallest piece a pipeline stage takes whole: each repeated block of the model (``blocks.0``,
``blocks.1``...), and the runs of other modules between them (embeddings before, final norm and head after).
"""

from __future__ import annotations

import hashlib

from planner.errors import TraceError


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
    """Module paths (outer to inner) that a graph node executes under."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for key, val in stack.items():
        path = val[0] if isinstance(val, tuple) else key
        if isinstance(path, str):
            # torch.export records paths like "L['self'].blocks.0" in some versions.
            path = path.replace("L['self'].", "").replace("L__self__.", "")
            paths.append(path)
    if node.op == "call_module" and isinstance(node.target, str) and node.target not in paths:
        paths.append(node.target)
    return paths


def assign_nodes(gm, roots: list[str]) -> dict:
    """Map each compute node of the graph to the unit root that owns it (None before any module).

    Rule (shared with the generated train.py): a node belongs to the outermost unit root on its module
    stack; module-less nodes go with the nearest preceding owned node; get_attr nodes go with their first
    user (and are copied into every stage that uses them).
    """
    root_set = set(roots)
    owner: dict = {}
    current = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        found = None
        for path in _node_module_paths(node):
            # match the path itself or the root it lies under
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                cand = ".".join(parts[:i])
                if cand in root_set:
                    found = cand
                    break
            if found:
                break
        if found is not None:
            current = found
        owner[node] = current
    return owner


def group_units(gm, roots: list[str], blocks: set[str]) -> tuple[list[list[str]], dict]:
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


def unit_name(group: list[str]) -> str:
    return group[0] if len(group) == 1 else "+".join(group)


def structure_key(model, group: list[str], blocks: set[str]) -> str:
    """Structural identity of a unit: equal for repeated identical blocks, unique otherwise."""
    if all(r in blocks for r in group):
        return "|".join(f"{type(model.get_submodule(r)).__name__}:{model.get_submodule(r)!r}" for r in group)
    return "|".join(group)


def meta_like(x):
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
                env[node] = meta_like(cache[sig])
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


def model_input_count(model, available: int) -> int:
    """How many leading example inputs the model's forward takes (the rest go to the loss only)."""
    import inspect

    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return 1
    required = 0
    positional = 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
            if p.default is p.empty:
                required += 1
        elif p.kind == p.VAR_POSITIONAL:
            return available
    return max(1, min(available, required or positional))
