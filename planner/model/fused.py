"""The fused kernels' stand-ins (planner.model.kernels), loaded only for a model with a Mamba mixer.

Loading them defines their custom ops, which costs an import's time; a model without a mixer never meets them
(their ops appear only where a mixer runs as them), so it never loads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from torch import nn

from planner.runtime.scans import is_ssm_mixer


def kernels() -> ModuleType:
    """planner.model.kernels (defining its custom ops reads the source of every module loaded: 30-40 ms)."""
    import planner.model.kernels as module

    return module


@contextlib.contextmanager
def fused_kernels(model: nn.Module) -> Iterator[int]:
    """planner.model.kernels.fused_kernels for a model with a Mamba mixer; nothing (0 mixers) for any other."""
    if not any(is_ssm_mixer(m) for m in model.modules()):
        yield 0
        return
    with kernels().fused_kernels(model) as count:
        yield count


def fused_mixer(m: Any) -> Callable[..., Any] | None:
    """planner.model.kernels.fused_mixer, loading the kernels only for a module that is a Mamba mixer."""
    if not is_ssm_mixer(m):
        return None
    stand_in: Callable[..., Any] | None = kernels().fused_mixer(m)
    return stand_in
