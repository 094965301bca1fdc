"""Tied weights across pipeline stages (GPT-2's wte and lm_head, T5's and BART's shared embedding): each
stage using the weight keeps a copy (with the same initial values, see model.materialise), and the copies'
gradients are summed before the optimizer step, over the stages of a rank and then over the ranks of those
stages, as Megatron-LM's embedding group does. The copies then receive equal updates and stay equal.

Two stages of one pp rank (interleaved 1F1B, zero-bubble) that use the weight each get their own copy
(`own_copies`), as stages on different ranks have: each stage is a module of its own for the pipeline
schedule (which divides each stage's gradients by the micro-batch count), for TP and for FSDP, so one
Parameter held by two of them would be scaled twice and sharded twice."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .errors import RunError
from .layout import Layout


def pp_subgroup(mesh: DeviceMesh, layout: Layout, pp_ranks: list[int]) -> dist.ProcessGroup | None:
    """The group of the given pp ranks that shares this rank's dp and tp coordinates (None if this rank's
    pp rank is not among them). Every rank must call it, with the same arguments, in the same order."""
    if len(pp_ranks) == layout.pp:
        return mesh["pp"].get_group()
    dims = ("pp", "dp", "cp", "tp") if "cp" in layout.mesh_dims else ("pp", "dp", "tp")
    grid = mesh.mesh.permute(*[layout.mesh_dims.index(d) for d in dims]).reshape(layout.pp, -1)  # [pp, dp x (cp x) tp]
    me, mine = dist.get_rank(), None
    for column in range(grid.shape[1]):
        members = [int(grid[r, column]) for r in pp_ranks]
        group = dist.new_group(members)
        if me in members:
            mine = group
    return mine


Copies = dict[int, dict[int, nn.Parameter]]  # local stage -> id of the model's weight -> that stage's copy


def own_copies(
    shared: dict[str, list[int]], model: nn.Module, stages: Sequence[nn.Module], local: list[int]
) -> Copies:
    """Give every local stage but the first that uses a tied weight its own copy of it (same values), before
    the stages are parallelised; returns the copies by stage. A module of the model that holds the weight (an
    embedding, a head) is replaced in the later stage by a copy of it holding the weight's copy and sharing
    everything else (parameters, buffers) with the model: each of those is used by that stage alone."""
    copies: Copies = {}
    for name, users in sorted(shared.items()):
        mine = [s for s in users if s in local]
        weight = model.get_parameter(name)
        for s in mine[1:]:
            with torch.no_grad():
                twin = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            copies.setdefault(s, {})[id(weight)] = twin
    if not copies:
        return copies
    originals = {id(m) for m in model.modules()}
    for s, mine_copies in copies.items():
        # deepcopy's memo: the model's other tensors are kept as they are, the weights become their copies
        memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
        memo.update(mine_copies)
        _swap(stages[local.index(s)], mine_copies, originals, memo)
    return copies


def _swap(parent: nn.Module, copies: dict[int, nn.Parameter], originals: set[int], memo: dict[int, object]) -> None:
    """Under `parent` (modules the stage built, which hold the model's modules), put each weight's copy where
    the weight was, and a copy of each of the model's modules that holds one (shared among the stage's
    pieces through `memo`) where that module was."""
    for attr, p in list(parent._parameters.items()):
        if p is not None and id(p) in copies:
            parent._parameters[attr] = copies[id(p)]
    for attr, child in list(parent._modules.items()):
        if child is None:
            continue
        if id(child) not in originals:
            _swap(child, copies, originals, memo)
        elif any(id(p) in copies for p in child.parameters()):
            parent._modules[attr] = copy.deepcopy(child, memo)


class TiedWeights:
    """This rank's copies of weights shared by several stages, and their gradient sum."""

    def __init__(
        self,
        shared: dict[str, list[int]],
        layout: Layout,
        mesh: DeviceMesh,
        model: nn.Module,
        stages: Sequence[nn.Module],
        local: list[int],
        copies: Copies | None = None,
    ) -> None:
        # (group, [([(module, attribute) holding a local stage's copy], whether that stage is the first user)])
        self.groups: list[tuple[dist.ProcessGroup | None, list[tuple[list[tuple[nn.Module, str]], bool]]]] = []
        copies = copies or {}
        for name, users in sorted(shared.items()):
            ranks = sorted({layout.stages[s].pp_rank for s in users})
            mine = [s for s in users if s in local]
            group = pp_subgroup(mesh, layout, ranks) if len(ranks) > 1 else None
            if not mine:
                continue
            weight = model.get_parameter(name)
            holders = []
            for s in mine:
                target = copies.get(s, {}).get(id(weight), weight)
                stage = stages[local.index(s)]
                slots = [(m, a) for m in stage.modules() for a, p in m._parameters.items() if p is target]
                if not slots:
                    raise RunError(f"internal error: stage {s} holds no copy of the tied weight {name}")
                holders.append((slots, s == users[0]))
            self.groups.append((group, holders))

    def later_copies(self) -> set[int]:
        """Ids of the copies held by a stage other than the weight's first user (the norm counts one copy)."""
        first = {id(getattr(m, a)) for _, holders in self.groups for slots, f in holders if f for m, a in slots}
        later = {id(getattr(m, a)) for _, holders in self.groups for slots, f in holders if not f for m, a in slots}
        return later - first

    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum over every copy: this rank's, then over the group's ranks."""
        for group, holders in self.groups:
            params = {id(getattr(m, a)): getattr(m, a) for slots, _ in holders for m, a in slots}.values()
            if group is None and len(params) < 2:
                continue
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            total = grads[0]
            for g in grads[1:]:
                total.add_(g)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads[1:]:
                g.copy_(total)
