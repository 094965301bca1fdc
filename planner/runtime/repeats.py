"""Each distinct block run once in a meta or fake run (`blocks_once`): what the plan-time check and the launch's
meta forward (`unit_reads`) use so that a model of 80 alike decoder layers runs one of them, not 80. Its own
module so that check and unit_reads both import it without importing each other."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from .stages import ModelStage


def describe(obj: Any) -> Any:
    """What a piece's module or attribute is, as far as running it on meta can tell (type, config, shapes)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.requires_grad, obj.device.type)
    if isinstance(obj, nn.Module):
        params = obj.named_parameters()
        tensors: list[tuple[Any, ...]] = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in params]
        tensors += [(n, tuple(t.shape), t.dtype) for n, t in obj.named_buffers()]
        return ("module", type(obj), repr(obj), tuple(tensors), obj.training)
    return (type(obj), repr(obj))


class _Unkeyable(Exception):
    """A call's input or output that `blocks_once` cannot describe or hand out again: the unit runs."""


def _call_key(v: Any) -> Any:
    """An exact description of a unit's call argument as far as a meta run can see it: tensors by metadata, plain
    values by value, containers by their items. Anything else (a cache object, a tensor subclass) is unkeyable."""
    kind = type(v)
    if kind is torch.Tensor or kind is nn.Parameter or kind is FakeTensor:
        return ("tensor", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device.type, v.requires_grad)
    if v is None or kind in (int, bool, str, torch.dtype, torch.device):
        return (kind, v)
    if kind is float:
        return (kind, repr(v))
    if kind in (tuple, list):
        return (kind, tuple(_call_key(x) for x in v))
    if kind is dict:
        return (kind, tuple((k, _call_key(x)) for k, x in v.items()))
    raise _Unkeyable


def _handed_out(v: Any) -> Any:
    """A unit's recorded output handed to a repeat: each tensor cloned (a fresh tensor whose gradient flows to the
    recorded one; the model may write into what a block returns, which must not write into the first block's
    saved output), plain values and containers as they are; anything else is unkeyable."""
    kind = type(v)
    if kind is torch.Tensor or kind is FakeTensor:
        return v.clone()
    if v is None or kind in (int, bool, str, float):
        return v
    if kind in (tuple, list):
        return kind(_handed_out(x) for x in v)
    if kind is dict:
        return {k: _handed_out(x) for k, x in v.items()}
    raise _Unkeyable


def _tp_hook(hook: Any) -> bool:
    """Whether a forward hook is one of torch's `distribute_module` (parallelize_module's input and output
    transforms of a TP-sharded Linear: they redistribute the tensors they get and record nothing), so a block the
    check shards for TP is still run once for all its repeats."""
    code = getattr(hook, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith("torch/distributed/tensor/_api.py")


def unit_kinds(stage: ModelStage) -> dict[int, Any]:
    """What tells the stage's units apart, by id (`blocks_once`): alike units are repeats of the first."""
    from .tracers import describe_block

    described: dict[int, Any] = {}
    for u in stage.units():
        try:  # what the analysis' tracing tells blocks apart by (attributes, hooks too), and the training state
            described[id(u)] = (describe(u), describe_block(u, None, neutral=_tp_hook))
        except Exception:  # noqa: BLE001 - a block with a hook, or one that cannot be described: it runs
            described[id(u)] = id(u)
    return described


def repeated_units(stage: ModelStage, kinds: dict[int, Any]) -> frozenset[str]:
    """The names of the stage's units that repeat an earlier one of the same kind (`unit_kinds`), but those
    holding a weight tied to another module (mBART's decoder embedding is its shared one): its sharding must
    follow its partner's."""
    names = {id(m): n for n, m in stage.model.named_modules()}
    holders: dict[int, int] = {}
    for _, p in stage.model.named_parameters(remove_duplicate=False):
        holders[id(p)] = holders.get(id(p), 0) + 1
    seen: set[Any] = set()
    out = set()
    for u in stage.units():
        key = kinds[id(u)]
        tied = any(holders.get(id(p), 0) > 1 for p in u.parameters())
        if key in seen and id(u) in names and not tied:
            out.add(names[id(u)])
        seen.add(key)
    return frozenset(out)


@contextlib.contextmanager
def blocks_once(stage: ModelStage, kinds: dict[int, Any] | None = None) -> Iterator[None]:
    """Within the block, each of the stage's units (its checkpoint/FSDP units: the model's blocks) runs once per
    distinct (module, call arguments' metadata); a repeat (the 79 later decoder layers of Llama-3-70B, given
    the same shapes) returns clones of the first's outputs, so forward, recomputation and backward run through
    one block of each kind, as `_run_stages` runs a pipeline's pieces. On meta a unit computes shapes only, and
    two units described alike (`describe`, and the analysis' `describe_block`: attributes too, but an index)
    compute the same shapes from inputs of the same metadata. For meta and fake runs only: a run on real values
    must run every block. `kinds`: the units told apart before the run changed them (`unit_kinds`: the TP check
    shards only the first of each kind, `repeated_units`), else now."""
    units = stage.units()
    counts: dict[Any, int] = {}
    described = kinds if kinds is not None else unit_kinds(stage)
    for key in described.values():
        counts[key] = counts.get(key, 0) + 1
    outputs: dict[Any, Any] = {}
    patched: list[tuple[nn.Module, bool, Any]] = []
    for unit in units:
        if counts[described[id(unit)]] < 2:
            continue  # one of a kind: nothing to reuse

        def forward(*args: Any, _unit: nn.Module = unit, _inner: Any = unit.forward, **kwargs: Any) -> Any:
            try:
                key = (described[id(_unit)], _call_key(args), _call_key(kwargs))
            except _Unkeyable:
                return _inner(*args, **kwargs)
            if key in outputs:
                return _handed_out(outputs[key])
            out = _inner(*args, **kwargs)
            try:
                _handed_out(out)  # only what can be handed out again is recorded
            except _Unkeyable:
                return out
            outputs[key] = out
            return out

        had = "forward" in unit.__dict__  # an instance forward of its own (checkpoint_in_place's), put back after
        patched.append((unit, had, unit.__dict__.get("forward")))
        unit.forward = forward
    try:
        yield
    finally:
        for unit, had, inner in patched:
            if had:
                unit.forward = inner
            else:
                del unit.forward
