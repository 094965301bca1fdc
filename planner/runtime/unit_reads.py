"""Which FSDP units of the model as written have a weight the model reads outside the unit's own forward.

FSDP2 gathers a unit's weights just before its forward and, under ZeRO-3, frees them right after: a weight the
model then reads elsewhere is the unit's shard, a DTensor, in an op with plain tensors ("mixed torch.Tensor and
DTensor"). Whisper's decoder does that, computing its logits as `x @ token_embedding.weight.T` after its blocks.
Such a unit is not wrapped on its own; its weights belong to the enclosing (stage) unit, gathered for the whole
forward, as torchtitan shards a tied embedding and output head together as one unit. The reads are found by
running the model's forward once on the meta device, noting each op's parameter arguments and which units' forwards
are running."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .layout import ModelFile


class _ParamReads(TorchFunctionMode):
    """Records the units owning a parameter that an op takes while none of their forwards runs."""

    def __init__(self, owner: dict[int, list[int]], running: list[int]) -> None:
        super().__init__()
        self.owner, self.running = owner, running
        self.outside: set[int] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # (a parameter is an op's argument itself, or an item of a list of them, torch.cat's: no pytree walk,
        # which would cost more than the meta kernels it runs beside)
        for arg in (*args, *(kwargs or {}).values()):
            for leaf in arg if type(arg) in (list, tuple) else (arg,):
                if type(leaf) is nn.Parameter:
                    self.outside.update(u for u in self.owner.get(id(leaf), ()) if not self.running[u])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def reads_outside(units: list[nn.Module]) -> Iterator[set[int]]:
    """Within the block (a forward of the model holding `units`), collect the indices of the units whose
    parameters some op takes while that unit's forward is not running; the set is filled when the block ends."""
    owner: dict[int, list[int]] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owner.setdefault(id(p), []).append(i)
    running = [0] * len(units)
    handles = []
    for i, unit in enumerate(units):

        def enter(_module: nn.Module, _args: Any, _i: int = i) -> None:
            running[_i] += 1

        def leave(_module: nn.Module, _args: Any, _out: Any, _i: int = i) -> None:
            running[_i] -= 1

        handles.append(unit.register_forward_pre_hook(enter))
        handles.append(unit.register_forward_hook(leave, always_call=True))
    found: set[int] = set()
    mode = _ParamReads(owner, running)
    try:
        with mode:
            yield found
    finally:
        for h in handles:
            h.remove()
        found |= mode.outside


def units_read_outside(
    model: nn.Module, units: list[nn.Module], inputs: tuple[torch.Tensor, ...], meta_kernels: Any = None
) -> list[str]:
    """The names (in `model`, on the meta device) of the `units` whose parameters the model's forward on `inputs`
    (meta tensors) reads outside the unit's forward. `meta_kernels`: a context manager the forward runs in
    (the runtime's MetaMemo: repeated blocks cost one), or none."""
    names = {id(m): n for n, m in model.named_modules()}
    with torch.no_grad(), meta_kernels or contextlib.nullcontext(), reads_outside(units) as found:
        model(*inputs)
    return [names[id(units[i])] for i in sorted(found)]


def model_reads_outside(
    user: Any, spec: ModelFile, modules: list[str], seed: int, example: tuple[torch.Tensor, ...]
) -> list[str] | None:
    """`units_read_outside` for the model as written (`ModelStage` of the plan's `modules`), built afresh on meta
    and run on the example micro-batch: on meta, else (a model that branches on values unless traced) on fake
    tensors, as the plan-time check runs it (and records the same reads, `check._run_model`). None where neither
    runs (the check then ran it on the CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .memo import MetaMemo
    from .model import build_model, input_count
    from .repeats import blocks_once
    from .stages import ModelStage

    for fake in (False, True):
        model = build_model(user, spec, seed, everything_on_meta=True)
        stage = ModelStage(model, modules)
        inputs = tuple(t.to("meta") for t in example[: input_count(model, len(example))])
        try:
            # Each distinct block runs once (a repeat's hooks still run; what it reads is what the first read).
            with blocks_once(stage):
                if not fake:
                    return units_read_outside(model, stage.units(), inputs, MetaMemo())
                with FakeTensorMode(allow_non_fake_inputs=True):
                    return units_read_outside(model, stage.units(), inputs)
        except Exception:  # noqa: BLE001 - the model's own error: the run (or the fake-tensor try) meets it
            continue
    return None
