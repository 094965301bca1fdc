"""Tied weights across pipeline stages (GPT-2's wte and lm_head): each stage using the weight keeps a copy
(with the same initial values, see model.materialise), and the copies' gradients are summed over the ranks
of those stages before the optimizer step, as Megatron-LM's embedding group does. The copies then receive
equal updates and stay equal."""

from __future__ import annotations

from collections.abc import Sequence

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
    grid = mesh.mesh.permute(*[layout.mesh_dims.index(d) for d in ("pp", "dp", "tp")])  # [pp, dp, tp]
    me, mine = dist.get_rank(), None
    for d in range(layout.dp):
        for t in range(layout.tp):
            members = [int(grid[r, d, t]) for r in pp_ranks]
            group = dist.new_group(members)
            if me in members:
                mine = group
    return mine


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
    ) -> None:
        # (group, [(module, attribute) holding this rank's copy], whether this rank's stage is the first user)
        self.groups: list[tuple[dist.ProcessGroup | None, list[tuple[nn.Module, str]], bool]] = []
        for name, users in sorted(shared.items()):
            ranks = sorted({layout.stages[s].pp_rank for s in users})
            mine = [s for s in users if s in local]
            if len(mine) > 1:
                raise RunError(
                    f"The weight {name} is used by stages {users}, of which {mine} run on the same pp rank: their "
                    "copies cannot be kept apart there. Re-plan with another schedule or stage split."
                )
            group = pp_subgroup(mesh, layout, ranks) if len(ranks) > 1 else None
            if not mine:
                continue
            target = model.get_parameter(name)
            stage = stages[local.index(mine[0])]
            slots = [(m, a) for m in stage.modules() for a, p in m._parameters.items() if p is target]
            self.groups.append((group, slots, mine[0] == users[0]))

    def later_copies(self) -> set[int]:
        """Ids of the copies held by a stage other than the weight's first user (the norm counts one copy)."""
        return {id(getattr(m, a)) for _, slots, first in self.groups if not first for m, a in slots}

    def sum_gradients(self) -> None:
        for group, slots, _ in self.groups:
            if group is None:
                continue
            for p in {id(getattr(m, a)): getattr(m, a) for m, a in slots}.values():
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(grad, group=group)
