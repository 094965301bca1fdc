"""Grouping a traced graph into partition units: which modules are units, and which graph nodes each owns.

A unit is the smallest piece a pipeline stage takes whole: each repeated block of the model (``blocks.0``,
``blocks.1``...), and the runs of other modules between them (embeddings before, final norm and head after).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from planner.errors import TraceError

if TYPE_CHECKING:
    import torch.fx
    import torch.nn as nn


@dataclass
class Structure:
    """The modules that become partition units, in definition order, and why."""

    roots: list[str]
    blocks: set[str]
    found: list[str] = field(default_factory=list)  # e.g. "12 x GPT2Block in transformer.h (ModuleList)"
    stateless: frozenset[str] = frozenset()  # roots without parameters or buffers (see group_units)


# Containers whose members run side by side on the same input (MoE experts), not one after another.
_PARALLEL_CONTAINERS = ("experts",)


def _is_container(mod: nn.Module) -> bool:
    import torch.nn as nn

    return isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


def _repeated_runs(mod: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Maximal runs of two or more consecutive children of a container that share a type."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for name, child in mod.named_children():
        if runs and type(runs[-1][-1][1]) is type(child):
            runs[-1].append((name, child))
        else:
            runs.append([(name, child)])
    return [r for r in runs if len(r) >= 2]


def _holds_blocks(mod: nn.Module) -> bool:
    """Whether a module contains (below itself) a container of repeated, sequential blocks: runs of
    composite modules (a Sequential of two Linears inside an MLP is not a stack of blocks)."""
    for name, sub in mod.named_modules():
        if name and _is_container(sub) and name.split(".")[-1] not in _PARALLEL_CONTAINERS:
            if any(any(True for _ in c.children()) for run in _repeated_runs(sub) for _, c in run):
                return True
    return False


def discover_structure(model: nn.Module) -> Structure:
    """Find the repeated blocks however the model holds them and make the rest units at module boundaries.

    Blocks are the members of runs of same-type children of a ModuleList, ModuleDict or Sequential
    (the model itself included: a top-level Sequential of stem, blocks, head), however deep they sit: a
    block that itself holds repeated blocks (ResNet's stages of bottlenecks) is expanded into them, one
    level deep, and
    every such container becomes blocks, so encoder and decoder stacks both split. Modules that hold no
    repeated blocks are units whole; a module with repeated blocks somewhere below is opened up.
    """
    roots: list[str] = []
    blocks: set[str] = set()
    runs: dict[tuple[str, str, str], int] = {}  # (block type, container pattern, container type) -> count

    def pattern(name: str, nested: list[str]) -> str:
        parts = name.split(".") if name else []
        for outer in nested:  # the index of each enclosing block becomes '*'
            parts[len(outer.split(".")) if outer else 0] = "*"
        return ".".join(parts) or "(the model)"

    def visit(mod: nn.Module, prefix: str, nested: list[str], inside_block: bool) -> None:
        def name_of(n: str) -> str:
            return f"{prefix}.{n}" if prefix else n

        members: set[str] = set()
        if _is_container(mod) and prefix.split(".")[-1] not in _PARALLEL_CONTAINERS:
            children = list(mod.named_children())
            same = len({type(c) for _, c in children}) == 1
            for run in (_repeated_runs(mod) or ([children] if inside_block and same and children else [])):
                members.update(n for n, _ in run)
        for n, child in mod.named_children():
            full = name_of(n)
            if n in members:
                # One level of nesting (stages of blocks); a block's own inner stack (the convolutions of
                # a residual bottleneck) stays inside it, as its residual connection spans them.
                if not inside_block and _holds_blocks(child):
                    visit(child, full, [*nested, prefix], True)
                    continue
                roots.append(full)
                blocks.add(full)
                key = (type(child).__name__, pattern(prefix, nested), type(mod).__name__)
                runs[key] = runs.get(key, 0) + 1
            elif _holds_blocks(child) or (_is_container(child) and _repeated_runs(child)):
                visit(child, full, nested, inside_block)
            else:
                roots.append(full)

    visit(model, "", [], False)
    if not blocks:
        roots = _open_single_child(model)
        found = [f"no repeated blocks: {len(roots)} units at module boundaries ({', '.join(roots)})"]
    else:
        found = [
            f"{n} x {typ} in {where} ({ctype}{', nested' if '*' in where else ''})"
            for (typ, where, ctype), n in runs.items()
        ]
    found.extend(_moe_blocks(model, blocks))
    stateless = frozenset(
        r for r in roots if not any(True for _ in model.get_submodule(r).parameters())
        and not any(True for _ in model.get_submodule(r).buffers())
    )
    return Structure(roots, blocks, found, stateless)


def _open_single_child(model: nn.Module) -> list[str]:
    """Top-level children as units; a child holding nearly all parameters is opened into its children."""
    roots = [n for n, _ in model.named_children()]
    total = sum(p.numel() for p in model.parameters())
    while True:
        big = [r for r in roots if sum(p.numel() for p in model.get_submodule(r).parameters()) >= 0.9 * total]
        if len(big) != 1 or not list(model.get_submodule(big[0]).children()) or total == 0:
            return roots
        i = roots.index(big[0])
        roots[i : i + 1] = [f"{big[0]}.{n}" for n, _ in model.get_submodule(big[0]).named_children()]


def node_module_paths(node: torch.fx.Node) -> list[str]:
    """Module paths (outer to inner) that a graph node executes under (the generated script's rule)."""
    from planner.runtime.stages import module_paths

    return module_paths(node)


def assign_nodes(gm: torch.fx.GraphModule, roots: list[str]) -> dict[torch.fx.Node, str | None]:
    """Map each compute node of the graph to the unit root that owns it (None before any module).

    Rule (shared with the generated train.py): a node belongs to the outermost unit root on its module
    stack; module-less nodes go with the nearest preceding owned node; get_attr nodes go with their first
    user (and are copied into every stage that uses them).
    """
    from planner.runtime.stages import owner_of

    root_set = set(roots)
    owner: dict[torch.fx.Node, str | None] = {}
    current: str | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        # the path itself or the root it lies under, innermost-first along the stack as the script does
        found = next((o for o in (owner_of(p, root_set) for p in node_module_paths(node)) if o), None)
        if found is not None:
            current = found
        owner[node] = current
    return owner


def _spans(
    gm: torch.fx.GraphModule, owner: dict[torch.fx.Node, str | None]
) -> tuple[list[torch.fx.Node], dict[str, int], dict[str, int]]:
    order = [n for n in gm.graph.nodes if n in owner]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, n in enumerate(order):
        r = owner[n]
        if r is None:
            continue
        first.setdefault(r, i)
        last[r] = i
    return order, first, last


def group_units(
    gm: torch.fx.GraphModule, roots: list[str], blocks: set[str], stateless: frozenset[str] = frozenset()
) -> tuple[list[list[str]], dict[torch.fx.Node, int]]:
    """Merge roots into contiguous units in execution order; returns (unit root lists, node -> unit index).

    A ``stateless`` root (no parameters, no buffers: a shared dropout or activation) that is called again
    after other units ran would glue everything between its calls into one unit; it is dropped from the
    roots instead, so its nodes go with the unit that precedes each call (the module-less rule).
    """
    owner = assign_nodes(gm, roots)
    order, first, last = _spans(gm, owner)
    reentered = {
        r for r in stateless if r in first and any(first[r] < first[o] <= last[r] for o in first if o != r)
    }
    if reentered:
        roots = [r for r in roots if r not in reentered]
        owner = assign_nodes(gm, roots)
        order, first, last = _spans(gm, owner)
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
    # Consecutive non-block groups (embeddings + dropout, final norm + head) become one unit. A model without
    # repeated blocks (an LSTM LM, a hybrid stack of different layers) keeps one unit per module boundary, as
    # its structure reports them: the places a pipeline can cut.
    merged: list[list[str]] = []
    for g in groups:
        is_block = len(g) == 1 and g[0] in blocks
        if blocks and merged and not is_block and not (len(merged[-1]) == 1 and merged[-1][0] in blocks):
            merged[-1].extend(g)
        else:
            merged.append(list(g))
    index = {r: i for i, g in enumerate(merged) for r in g}
    node_unit: dict[torch.fx.Node, int] = {}
    for n in order:
        root = owner[n]
        node_unit[n] = index[root] if root is not None else 0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            users = [node_unit[u] for u in n.users if u in node_unit]
            node_unit[n] = min(users) if users else 0
    return merged, node_unit


def unit_name(group: list[str]) -> str:
    return group[0] if len(group) == 1 else "+".join(group)


def structure_key(model: nn.Module, group: list[str], blocks: set[str]) -> str:
    """Structural identity of a unit: equal for repeated identical blocks, unique otherwise."""
    if all(r in blocks for r in group):
        return "|".join(f"{type(model.get_submodule(r)).__name__}:{model.get_submodule(r)!r}" for r in group)
    return "|".join(group)


def meta_like(x: Any) -> Any:
    """A fresh meta tensor of x's shape and dtype (pytrees mapped), to stand in for a repeated output."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t, x
    )


def returned_nodes(graph: torch.fx.Graph) -> str:
    """What a unit's graph returns, as positions of its nodes (the output's structure kept): equal for two
    units that return the same values."""
    import torch

    index = {n: i for i, n in enumerate(graph.nodes)}
    out = next(n for n in graph.nodes if n.op == "output")
    return repr(torch.fx.graph.map_arg(out.args[0], lambda n: index[n]))


def folded_calls(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The call_module nodes of folded blocks in `graph` (tracers._Recording.fold). split_module copies a node's
    meta to the placeholders that take its value: only the calls count."""
    from planner.runtime.tracers import FOLDED

    return [n for n in graph.nodes if n.op == "call_module" and FOLDED in n.meta]


def fold_templates(parts: torch.fx.GraphModule, groups: list[list[str]], keys: dict[int, str]) -> dict[int, int] | None:
    """Unit index -> the index of the unit it repeats, for each unit that is a folded block (one call_module node
    of a block traced before: tracers._Recording.fold), so that it takes that unit's signature (and its counts
    and tensor-parallel layout); None where a folded block is not a unit of its own (nodes of the model's beside
    it, or another block) or repeats none (the analysis then traces again without folding)."""
    from planner.runtime.tracers import FOLD_MADE, FOLDED

    index = {g[0]: i for i, g in enumerate(groups) if len(g) == 1}
    templates: dict[int, int] = {}
    for i, group in enumerate(groups):
        sub = getattr(parts, f"submod_{i}", None)
        if sub is None:
            continue
        calls = folded_calls(sub.graph)
        if not calls:
            continue
        if len(calls) != 1 or group != [calls[0].meta[FOLDED][0]]:
            return None
        if any(n.op not in ("placeholder", "output") and FOLD_MADE not in n.meta for n in sub.graph.nodes):
            return None  # nodes of the model's own beside the call (module-less ops after the block join its unit)
        t = index.get(calls[0].meta[FOLDED][1])
        if t is None or t >= i or keys[t] != keys[i] or t in templates:
            return None
        templates[i] = t
    return templates


def _run_folded(part: torch.fx.GraphModule, args: tuple[Any, ...]) -> Any:
    """A folded block's unit run on meta with its call answered by the meta values the trace recorded (the block's
    own Python need not run on meta: transformers' MoE takes a data-dependent path outside a trace)."""
    import torch.fx

    from planner.runtime.tracers import FOLDED

    calls = set(folded_calls(part.graph))

    class Folded(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n in calls:
                return meta_like(n.meta[FOLDED][2])
            return super().run_node(n)

    return Folded(part).run(*args)


def run_units_once(
    parts: torch.fx.GraphModule, inputs: tuple[Any, ...], keys: dict[int, str], templates: dict[int, int] | None = None
) -> tuple[Any, dict[int, tuple[Any, ...]], dict[int, str]]:
    """Run the split model on meta, executing each distinct (unit structure, input shapes) only once.

    Returns (model output, inputs captured per unit index, the unit index -> signature map). Identical
    blocks with identical input shapes have identical output shapes, so repeated ones are skipped.
    `templates`: folded blocks (`fold_templates`), which take the signature of the unit they repeat and are run
    with the meta values their trace recorded where it has them.
    """
    import torch
    from torch.utils._pytree import tree_flatten

    from planner.runtime.tracers import FOLDED

    templates = templates or {}

    env: dict[torch.fx.Node, Any] = {}
    captured: dict[int, tuple[Any, ...]] = {}
    sigs: dict[int, str] = {}
    cache: dict[tuple[str, str], Any] = {}
    it = iter(inputs)
    out: Any = None
    with torch.no_grad():
        for node in parts.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "call_module":
                target = cast(str, node.target)  # a call_module's target is the submodule's name
                idx = int(target.split("_")[1])
                args = tuple(env[a] if isinstance(a, torch.fx.Node) else a for a in node.args)
                flat, _ = tree_flatten(args)
                shapes = tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in flat)
                if idx in templates:
                    sig = sigs[templates[idx]]
                else:
                    sig = hashlib.sha256(repr((keys[idx], shapes)).encode()).hexdigest()[:16]
                sigs[idx] = sig
                captured[idx] = args
                part = getattr(parts, target)
                # Identical blocks can differ in what they return: a value made in one block and read by the
                # later ones (torch.export traces DeepSeek-V2's `position_embeddings.to(device)`, which returns
                # its input, as made in the first block) is passed on by every block but the last.
                run = (sig, returned_nodes(part.graph))
                if run not in cache:
                    recorded = idx in templates and all(n.meta[FOLDED][2] is not None for n in folded_calls(part.graph))
                    cache[run] = _run_folded(part, args) if recorded else part(*args)
                env[node] = meta_like(cache[run])
            elif node.op == "call_function":
                args = tuple(env[a] if isinstance(a, torch.fx.Node) else a for a in node.args)
                env[node] = cast(Callable[..., Any], node.target)(*args)
            elif node.op == "get_attr":
                obj = parts
                for atom in str(node.target).split("."):
                    obj = getattr(obj, atom)
                env[node] = obj
            elif node.op == "output":
                out = torch.fx.graph.map_arg(node.args[0], lambda n: env[n])
    return out, captured, sigs


def model_input_count(model: nn.Module, available: int) -> int:
    """How many leading example inputs the model's forward takes (the rest go to the loss only): the
    generated script's rule."""
    from planner.runtime.model import input_count

    return input_count(model, available)


def _moe_blocks(model: nn.Module, blocks: set[str]) -> list[str]:
    """Mixture-of-experts layers in the first block of each type that has them (DeepSeek's first layers are
    dense blocks of the same type): experts, top-k and router, one line each (recognised by
    planner.model.moe's rules)."""
    from planner.model.moe import experts_count, experts_module, router_of, top_k_of

    lines: list[str] = []
    seen: set[str] = set()
    for root in sorted(blocks, key=_natural):
        block = model.get_submodule(root)
        if type(block).__name__ in seen:
            continue
        for name, mod in block.named_modules():
            found = experts_module(mod)
            if found is None or not experts_count(found[1]):
                continue
            router, top_k = router_of(mod), top_k_of(mod)
            where = f"{root}.{name}" if name else root
            seen.add(type(block).__name__)
            lines.append(
                f"MoE {type(mod).__name__} in {where}: {experts_count(found[1])} experts"
                + (f", top-{top_k}" if top_k else "")
                + (f", router {type(router).__name__} (replicated under TP)" if router is not None else "")
            )
    return lines


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting model.layers.2 before model.layers.10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))
