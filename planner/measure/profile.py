"""Measuring each distinct partition unit's forward and backward time on the local device.

The model is built on the meta device and split into units exactly as the unit analysis does
(`planner.model.units`); then, one distinct unit at a time, only that unit's modules are allocated on the
device (``to_empty`` + ``reset_parameters()``), fed inputs of the shapes the split graph captured, timed
forward and backward (gradient of ones), and sent back to meta. The full model is never allocated, and
repeated identical blocks are measured once. Results are cached on disk, keyed by a digest of everything
that changes them, so profiling the same model on the same machine twice runs nothing the second time.

On a GPU the unit runs in the model's training dtype and is timed with CUDA events; on a CPU it runs in
fp32 (bf16 matmuls are slow or unsupported on many CPUs) and is timed with ``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.cost.model import Profile, UnitTimes, roofline_times
from planner.errors import ConfigError, SpecError
from planner.hardware.spec import ClusterSpec
from planner.io import atomic_write_text
from planner.model.graph import ModelGraph, ModelSource, TrainDType, Unit
from planner.model.load import (
    DTYPE_BYTES,
    LoadedModel,
    build_meta_model,
    example_batch,
    meta_inputs,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch
    import torch.fx
    import torch.nn as nn

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
CACHE_DIR_ENV = "PLANNER_CACHE_DIR"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UnitProfile(_Model):
    """Measured times of one distinct unit (by signature) at one micro-batch size."""

    signature: str = Field(description="the unit's signature in the ModelGraph (batch 1, training dtype)")
    micro_batch_size: int
    units: list[str] = Field(description="names of every unit with this signature; the first was run")
    fwd_s: float = Field(description="median forward seconds per micro-batch")
    bwd_s: float = Field(description="median backward seconds per micro-batch (gradient of ones)")
    fwd_samples_s: list[float] = Field(description="each timed forward, in order")
    bwd_samples_s: list[float] = Field(description="each timed backward, in order")
    peak_memory_bytes: int | None = Field(
        None, description="torch.cuda.max_memory_allocated over the unit's runs; None on CPU (not tracked)"
    )


class ProfileResult(_Model):
    """Everything one profiling run measured, with the inputs that identify it (the cache key's parts)."""

    schema_version: int = SCHEMA_VERSION
    key: str = Field(description="sha256 digest of the inputs; the cache file's name")
    model: ModelSource
    device: Literal["cpu", "cuda"]
    device_name: str = Field(description="GPU name, or the CPU model with its core and thread counts")
    dtype: TrainDType = Field(description="dtype the units ran in: the training dtype on GPU, fp32 on CPU")
    torch_version: str
    micro_batch_sizes: list[int]
    repeats: int
    warmup: int
    units: list[UnitProfile]
    elapsed_s: float = Field(description="wall time of the measuring run (tracing included)")
    from_cache: bool = Field(False, description="True when this result was read from the cache")


@dataclass
class UnitTimings:
    """Raw timings of one unit: one entry per timed repetition."""

    fwd: list[float]
    bwd: list[float]
    peak_memory_bytes: int | None


# ------------------------------------------------------------------------------------------- public API


def profile_model(
    loaded: LoadedModel,
    micro_batch_sizes: tuple[int, ...] | list[int] = (1,),
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ProfileResult:
    """Measure forward and backward time of each distinct unit of a model on the local device.

    A cached result for the same inputs (see `profile_key`) is returned without running anything.
    ``progress(done, total)`` is called after each measured unit.
    """
    import torch

    mbs_list = _check_args(micro_batch_sizes, device, repeats, warmup)
    dtype: TrainDType = loaded.source.dtype if device == "cuda" else "fp32"
    name = local_device_name(device)
    key = profile_key(loaded.source, name, dtype, mbs_list, repeats, warmup)
    path = profile_cache_dir(cache_dir) / f"{key}.json"
    cached = _read_cache(path, key)
    if cached is not None:
        log.info("profile cache hit: %s", path)
        return cached

    start = time.perf_counter()
    units: list[UnitProfile] = []
    # Seeded, with the caller's random state restored afterwards: the library keeps no global state.
    # An explicit index, so that tensors' devices (cuda:0) compare equal to it.
    target = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    with torch.random.fork_rng(devices=[target] if device == "cuda" else []):
        torch.manual_seed(0)
        graph_sigs = _graph_signatures(loaded)
        model = build_meta_model(loaded).to(torch_dtype(dtype)).train()
        plans = [(mbs, _split_for(loaded, model, mbs, dtype)) for mbs in mbs_list]
        total = sum(len(_distinct(split, graph_sigs)) for _, split in plans)
        done = 0
        for mbs, split in plans:
            for sig, indices in _distinct(split, graph_sigs).items():
                first = indices[0]
                timings = _profile_unit(model, split, first, target, repeats, warmup)
                units.append(
                    UnitProfile(
                        signature=sig, micro_batch_size=mbs, units=[split.names[i] for i in indices],
                        fwd_s=statistics.median(timings.fwd), bwd_s=statistics.median(timings.bwd),
                        fwd_samples_s=timings.fwd, bwd_samples_s=timings.bwd,
                        peak_memory_bytes=timings.peak_memory_bytes,
                    )
                )
                done += 1
                if progress is not None:
                    progress(done, total)
    result = ProfileResult(
        key=key, model=loaded.source, device=device, device_name=name, dtype=dtype,
        torch_version=torch.__version__, micro_batch_sizes=mbs_list, repeats=repeats, warmup=warmup,
        units=units, elapsed_s=time.perf_counter() - start,
    )
    atomic_write_text(path, result.model_dump_json(indent=1))
    return result


def to_cost_profile(result: ProfileResult, graph: ModelGraph, cluster: ClusterSpec | None = None) -> Profile:
    """The search's Profile: measured times keyed by (unit signature, micro-batch size, tp=1).

    ``efficiency_scale`` is the median over measured units of measured / roofline-estimated time on the
    local device's spec (``cluster``, by default the spec named after the device: ``cpu`` on a CPU), so
    that estimates for units or configurations not measured carry the same achieved fraction of peak.
    """
    spec = cluster or local_cluster(result)
    by_sig = {(u.signature, u.micro_batch_size): u for u in result.units}
    # A graph traced by another planner version may sign units differently: fall back to unit names.
    by_name = {(n, u.micro_batch_size): u for u in result.units for n in u.units}
    times: dict[tuple[str, int, int], UnitTimes] = {}
    ratios: list[float] = []
    for unit in graph.units:
        for mbs in result.micro_batch_sizes:
            hit = by_sig.get((unit.signature, mbs)) or by_name.get((unit.name, mbs))
            key = (unit.signature, mbs, 1)
            if hit is None or key in times:
                continue
            times[key] = UnitTimes(fwd=hit.fwd_s, bwd=hit.bwd_s, source="measured")
            local = _in_dtype(unit, graph.dtype_bytes, DTYPE_BYTES[result.dtype])
            est_fwd, est_bwd, _ = roofline_times(local, mbs, 1, False, spec, result.dtype)
            if est_fwd + est_bwd > 0:
                ratios.append((hit.fwd_s + hit.bwd_s) / (est_fwd + est_bwd))
    return Profile(
        device=result.device_name, times=times, efficiency_scale=statistics.median(ratios) if ratios else 1.0
    )


def profile_key(
    source: ModelSource, device_name: str, dtype: str, micro_batch_sizes: list[int], repeats: int, warmup: int
) -> str:
    """sha256 of everything a measurement depends on: the model file's bytes and arguments, the device,
    the dtype, the micro-batch sizes, the repetition counts and the torch version."""
    import torch

    blob = json.dumps(
        {
            "schema": SCHEMA_VERSION,
            "file_sha256": source.file_sha256,
            "build_fn": source.build_fn,
            "inputs_fn": source.inputs_fn,
            "model_args": source.model_args,
            "device": device_name,
            "dtype": dtype,
            "micro_batch_sizes": list(micro_batch_sizes),
            "repeats": repeats,
            "warmup": warmup,
            "torch": torch.__version__,
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def profile_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Where profiles are cached: ``cache_dir``, else $PLANNER_CACHE_DIR/profiles, else
    ~/.cache/planner/profiles."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get(CACHE_DIR_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "planner") / "profiles"


def local_device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name with its core count and torch's thread count (timings on
    a CPU depend on how many threads run them)."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    model = model or platform.processor() or platform.machine() or "cpu"
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def local_cluster(result: ProfileResult) -> ClusterSpec:
    """The hardware spec of the device a profile ran on: ``cpu`` for a CPU, else a spec named like the GPU."""
    from planner.hardware.load import load_cluster

    if result.device == "cpu":
        return load_cluster("cpu", 1)
    name = result.device_name
    tries = [name, name.removeprefix("NVIDIA ").removeprefix("AMD "), *name.replace("NVIDIA ", "").split()]
    for cand in tries:
        with contextlib.suppress(SpecError):
            return load_cluster(cand, 1)
    raise SpecError(
        f"No hardware spec matches the profiled GPU {name!r}. Pass cluster=load_cluster('<gpu>', 1) to "
        "to_cost_profile, or add an alias for this GPU to its YAML file under hardware_specs/."
    )


# ---------------------------------------------------------------------------------------------- caching


def _read_cache(path: Path, key: str) -> ProfileResult | None:
    if not path.is_file():
        return None
    try:
        result = ProfileResult.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError) as e:
        log.warning("ignoring unreadable profile cache file %s (%s); measuring again", path, e)
        return None
    if result.key != key or result.schema_version != SCHEMA_VERSION:
        return None
    return result.model_copy(update={"from_cache": True})


def _check_args(micro_batch_sizes: tuple[int, ...] | list[int], device: str, repeats: int, warmup: int) -> list[int]:
    import torch

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"Unknown profiling device {device!r}; use 'cpu' or 'cuda'.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("Profiling on 'cuda' needs a GPU that torch can see; none is available. Use device='cpu'.")
    sizes = sorted({int(m) for m in micro_batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"Micro-batch sizes must be positive integers, got {list(micro_batch_sizes)}.")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"Profiling needs repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")
    return sizes


# ------------------------------------------------------------------------------------ tracing and split


@dataclass
class _Split:
    """A model traced and split into units at one batch size, with each unit's captured (meta) inputs."""

    parts: torch.fx.GraphModule  # submod_<i> per unit
    groups: list[list[str]]
    names: list[str]
    captured: dict[int, tuple[Any, ...]]
    signatures: dict[int, str]
    real_inputs: tuple[torch.Tensor, ...]  # example_inputs(batch) on the CPU, for unit inputs that are model inputs


def _split_model(
    loaded: LoadedModel, model: nn.Module, inputs: tuple[torch.Tensor, ...], real: tuple[torch.Tensor, ...]
) -> _Split:
    """Trace and split as `analyse_model` does, running each distinct unit once on meta."""
    from torch.fx.passes.split_module import split_module

    from planner.model.grouping import (
        discover_structure,
        group_units,
        model_input_count,
        run_units_once,
        structure_key,
        unit_name,
    )
    from planner.model.trace import trace_model

    n_in = model_input_count(model, len(inputs))
    structure = discover_structure(model)
    roots, blocks = structure.roots, structure.blocks

    def split_and_run(gm: torch.fx.GraphModule) -> _Split:
        groups, node_unit = group_units(gm, roots, blocks, structure.stateless)
        parts = split_module(gm, model, lambda n: node_unit[n], keep_original_order=True)
        keys = {i: structure_key(model, g, blocks) for i, g in enumerate(groups)}
        _, captured, sigs = run_units_once(parts, inputs[:n_in], keys)
        return _Split(parts, groups, [unit_name(g) for g in groups], captured, sigs, real[:n_in])

    # Traced.checked is what `check` returned: split_and_run's _Split.
    return cast(_Split, trace_model(model, inputs[:n_in], loaded.source.path, check=split_and_run).checked)


def _graph_signatures(loaded: LoadedModel) -> dict[str, str]:
    """Unit name -> signature as the ModelGraph has them (batch 1, training dtype)."""
    split = _split_model(loaded, build_meta_model(loaded), meta_inputs(loaded, 1), ())
    return {split.names[i]: sig for i, sig in split.signatures.items()}


def _split_for(loaded: LoadedModel, model: nn.Module, mbs: int, dtype: str) -> _Split:
    """The model split at micro-batch size ``mbs`` with inputs in the measuring dtype."""
    real = example_batch(loaded, mbs)
    dt = torch_dtype(dtype)
    inputs = tuple(t.to(device="meta", dtype=dt) if t.is_floating_point() else t.to(device="meta") for t in real)
    return _split_model(loaded, model, inputs, real)


def _distinct(split: _Split, graph_sigs: dict[str, str]) -> dict[str, list[int]]:
    """Graph signature -> indices of the units that share it, in execution order."""
    out: dict[str, list[int]] = {}
    for i in sorted(split.signatures):
        sig = graph_sigs.get(split.names[i], split.signatures[i])
        out.setdefault(sig, []).append(i)
    return out


# --------------------------------------------------------------------------------- running one unit


def _profile_unit(
    model: nn.Module, split: _Split, index: int, device: torch.device, repeats: int, warmup: int
) -> UnitTimings:
    """Allocate unit ``index`` on the device, time it, and send it back to meta."""
    import torch

    sub = getattr(split.parts, f"submod_{index}")
    with _materialised(model, sub, split.groups[index], device) as bound:
        args = _real_args(model, split, index, device, bound)
        timings = measure_unit(sub, args, device, repeats, warmup)
        del args
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timings


@contextlib.contextmanager
def _materialised(
    model: nn.Module, sub: torch.fx.GraphModule, group: list[str], device: torch.device
) -> Iterator[int]:
    """Allocate the unit's own modules (``to_empty`` + ``reset_parameters()``, parents first) and bind the
    tensors the split submodule holds directly (get_attr parameters and buffers) to them. Yields the
    exclusive upper bound for integer tensors (the smallest embedding table, else 1: only 0 is a safe
    index of unknown use). Everything goes back to meta on exit."""
    import torch
    import torch.nn as nn

    owned = [(n, m) for r in group for n, m in model.get_submodule(r).named_modules(prefix=r)]
    try:
        bound = _index_bound([m for _, m in owned] + list(sub.modules()), sub)
        with torch.no_grad():
            for _, m in owned:
                m.to_empty(device=device, recurse=False)
                for b in m.buffers(recurse=False):
                    _fill_buffer(b, bound)
            for _, m in owned:
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
                else:
                    for pname, p in m.named_parameters(recurse=False):
                        _init_param(pname, p)
            # The split submodule holds get_attr tensors in containers of its own: point them at the model's
            # freshly allocated ones, or allocate them here when the model's are not the unit's.
            for qual, t in [*sub.named_parameters(remove_duplicate=False), *sub.named_buffers(remove_duplicate=False)]:
                if t.device.type != "meta":
                    continue
                src = _lookup(model, qual)
                if src is None or src.device.type == "meta" or src.shape != t.shape:
                    src = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        _init_param(qual, src)
                    else:
                        _fill_buffer(src, bound)
                _assign(sub, qual, src, isinstance(t, nn.Parameter))
        yield bound
    finally:
        sub.to_empty(device="meta")
        for _, m in owned:
            m.to_empty(device="meta", recurse=False)


def _index_bound(modules: list[nn.Module], sub: torch.fx.GraphModule) -> int:
    """Smallest number of rows of an embedding table the unit uses (nn.Embedding, or aten.embedding on a
    get_attr weight in an exported graph), else 1."""
    import torch
    import torch.nn as nn

    sizes = [m.num_embeddings for m in modules if isinstance(m, nn.Embedding)]
    for node in sub.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (torch.ops.aten.embedding.default, torch.nn.functional.embedding):
            weight = node.args[0] if node.target is torch.ops.aten.embedding.default else node.args[1]
            if getattr(weight, "op", None) == "get_attr":
                t = _lookup(sub, str(weight.target))
                if t is not None:
                    sizes.append(int(t.shape[0]))
    return max(1, min(sizes)) if sizes else 1


def _lookup(module: nn.Module, qual: str) -> torch.Tensor | None:
    """The parameter or buffer at a qualified name, or None."""
    *path, field = qual.split(".")
    try:
        owner = module.get_submodule(".".join(path)) if path else module
    except AttributeError:
        return None
    t = owner._parameters.get(field)
    return t if t is not None else owner._buffers.get(field)


def _assign(module: nn.Module, qual: str, tensor: torch.Tensor, parameter: bool) -> None:
    import torch.nn as nn

    *path, field = qual.split(".")
    owner = module.get_submodule(".".join(path)) if path else module
    if parameter:
        owner._parameters[field] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
    else:
        owner._buffers[field] = tensor


def _init_param(name: str, p: torch.Tensor) -> None:
    """The GPT-2 default for a parameter whose module has no reset_parameters() (as the generated train.py
    does): N(0, 0.02) for matrices, ones for 1-d weights and scales, zeros for other vectors."""
    from planner.runtime.model import default_init

    default_init(name, p)


def _fill_buffer(b: torch.Tensor, bound: int) -> None:
    """Plausible values for a buffer whose constructor ran on meta: a module's reset_parameters() (run
    afterwards) recomputes its own; integers must stay valid indices; square boolean masks are causal."""
    import torch

    if b.is_floating_point() or b.is_complex():
        b.normal_()
    elif b.dtype == torch.bool:
        if b.dim() >= 2 and b.shape[-1] == b.shape[-2]:
            b.copy_(torch.ones(b.shape[-2:], dtype=torch.bool, device=b.device).tril().expand_as(b))
        else:
            b.fill_(True)
    else:
        b.random_(0, bound)


def _real_args(
    model: nn.Module, split: _Split, index: int, device: torch.device, bound: int
) -> tuple[Any, ...]:
    """Device tensors standing in for the captured inputs of unit ``index``.

    Model inputs are the real example batch. Parameters and buffers the parent graph fetches (get_attr)
    and passes in are the model's own, just allocated, when the unit owns them (so their gradients are
    computed, as in training), else fresh ones initialised alike. Other floating inputs are activations
    (randn, requiring grad); integer inputs are random indices below ``bound``.
    """
    import torch
    import torch.nn as nn
    from torch.utils._pytree import tree_map

    call = next(n for n in split.parts.graph.nodes if n.op == "call_module" and n.target == f"submod_{index}")
    placeholders = [n for n in split.parts.graph.nodes if n.op == "placeholder"]
    out: list[Any] = []
    for node, val in zip(call.args, split.captured[index]):
        op = getattr(node, "op", None)
        if op == "placeholder" and placeholders.index(node) < len(split.real_inputs):
            real = split.real_inputs[placeholders.index(node)]
            out.append(real.to(device=device, dtype=val.dtype))
            continue
        if op == "get_attr" and isinstance(val, torch.Tensor):
            src = _lookup(model, str(node.target))
            if src is not None and src.device == device and src.shape == val.shape:
                out.append(src)
                continue
            with torch.no_grad():
                t = torch.empty_like(val, device=device)
                if isinstance(val, nn.Parameter):
                    _init_param(str(node.target), t)
                else:
                    _fill_buffer(t, bound)
            out.append(nn.Parameter(t, requires_grad=val.requires_grad) if isinstance(val, nn.Parameter) else t)
            continue

        def make(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.is_floating_point():
                return torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_(True)
            if t.is_complex():
                return torch.randn(t.shape, dtype=t.dtype, device=device)
            if t.dtype == torch.bool:
                return torch.ones(t.shape, dtype=torch.bool, device=device)
            return torch.randint(0, bound, t.shape, dtype=t.dtype, device=device)

        out.append(tree_map(make, val))
    return tuple(out)


def measure_unit(
    fn: Callable[..., Any], args: tuple[Any, ...], device: torch.device, repeats: int, warmup: int
) -> UnitTimings:
    """Time fn(*args) forward and backward (gradient of ones on every output that requires grad).

    ``warmup`` untimed repetitions first (allocator, kernel selection), then ``repeats`` timed ones.
    Parameter gradients accumulate across repetitions, as across the micro-batches of an iteration.
    On CUDA each phase is bracketed by events and the peak of allocated memory is recorded; on a CPU,
    ops run synchronously and perf_counter brackets them.
    """
    import torch
    import torch.nn as nn

    from planner.model.counting import flatten_tensors

    cuda = device.type == "cuda"
    # Activation inputs' gradients are dropped each time; parameters' accumulate (see above).
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, nn.Parameter)]
    fwd: list[float] = []
    bwd: list[float] = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for rep in range(warmup + repeats):
        for leaf in leaves:
            leaf.grad = None
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            events[0].record()
            out = fn(*args)
            events[1].record()
            outs = [o for o in flatten_tensors(out) if o.requires_grad]
            grads = [torch.ones_like(o) for o in outs]
            events[2].record()
            if outs:
                torch.autograd.backward(outs, grad_tensors=grads)
            events[3].record()
            torch.cuda.synchronize(device)
            t_fwd = events[0].elapsed_time(events[1]) / 1e3
            t_bwd = events[2].elapsed_time(events[3]) / 1e3
        else:
            t0 = time.perf_counter()
            out = fn(*args)
            t_fwd = time.perf_counter() - t0
            outs = [o for o in flatten_tensors(out) if o.requires_grad]
            grads = [torch.ones_like(o) for o in outs]
            t0 = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, grad_tensors=grads)
            t_bwd = time.perf_counter() - t0 if outs else 0.0
        del out, outs, grads
        if rep >= warmup:
            fwd.append(t_fwd)
            bwd.append(t_bwd)
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    return UnitTimings(fwd=fwd, bwd=bwd, peak_memory_bytes=peak)


def _in_dtype(unit: Unit, from_bytes: int, to_bytes: int) -> Unit:
    """The unit with its memory-bound bytes re-counted for another element size (the graph is counted in
    the training dtype; a CPU profile runs fp32)."""
    if from_bytes == to_bytes:
        return unit
    f = to_bytes / from_bytes
    update = {
        "memory_bound_bytes": unit.memory_bound_bytes * f,
        "bwd_memory_bound_bytes": unit.bwd_memory_bound_bytes * f,
    }
    return unit.model_copy(update=update)
