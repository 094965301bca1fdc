"""The user's model file: importing it, building the model without allocating it, materialising a rank's
share of the weights with initial values that depend only on (seed, module name), and the batches."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import RunError
from .layout import Layout, ModelFile
from .weights import Checkpoint, load_weights


def load_model_file(path: str) -> Any:
    """Import the user's model file as a module (its directory joins sys.path for its own imports)."""
    file = Path(path)
    if not file.is_file():
        raise RunError(f"Model file {file} not found: re-plan, or edit MODEL_FILE at the top of train.py.")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if spec is None or spec.loader is None:
        raise RunError(f"Cannot import {file} as a Python module: pass a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (explicitly or through **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def input_count(model: nn.Module, available: int) -> int:
    """How many leading inputs of a micro-batch the model's forward takes (all of them go to the loss)."""
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


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from `seed` and `parts`: the same on every rank and for every layout."""
    digest = hashlib.sha256("/".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_batch(
    user: Any, spec: ModelFile, layout: Layout, seed: int, step: int, index: int
) -> tuple[torch.Tensor, ...]:
    """Micro-batch `index` (0 .. DP * NUM_MICRO_BATCHES - 1, over the global batch) of step `step`.

    It depends only on (seed, step, index), so every layout trains on the same data: dp rank r takes
    micro-batches r * NUM_MICRO_BATCHES ... (r + 1) * NUM_MICRO_BATCHES - 1.
    """
    return micro_batch(user, spec, layout.micro_batch_size, seed, step, index)


def micro_batch(
    user: Any, spec: ModelFile, micro_batch_size: int, seed: int, step: int, index: int
) -> tuple[torch.Tensor, ...]:
    """`make_batch` for a micro-batch size rather than a layout."""
    mb_seed = derived_seed(seed, "batch", step, index)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mb_seed)
        if spec.batch_fn is not None:
            fn = getattr(user, spec.batch_fn)
            kwargs = dict(spec.model_args)
            if accepts(fn, "micro_batch"):
                kwargs["micro_batch"] = index
            batch = fn(step, micro_batch_size, **kwargs)
        else:
            fn = getattr(user, spec.inputs_fn)
            kwargs = {**spec.model_args, "seed": mb_seed} if accepts(fn, "seed") else dict(spec.model_args)
            batch = fn(micro_batch_size, **kwargs)
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every parameter on the meta device while buffers keep their real values.

    reset_parameters() re-creates parameters but not buffers (causal masks, rotary tables), so buffers are
    computed for real while parameters cost nothing until materialise() allocates this rank's share.
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# torch.nn.init's in-place initialisers. On a meta tensor they write nothing, but running them costs: each
# goes through torch._refs, whose random ops import torch._dynamo (seconds) on first use.
INITIALISERS = (
    "constant_", "dirac_", "eye_", "kaiming_normal_", "kaiming_uniform_", "normal_", "ones_", "orthogonal_",
    "sparse_", "trunc_normal_", "uniform_", "xavier_normal_", "xavier_uniform_", "zeros_",
)
_FAN_CHECKED = ("kaiming_normal_", "kaiming_uniform_", "xavier_normal_", "xavier_uniform_")


@contextlib.contextmanager
def no_init_on_meta() -> Iterator[None]:
    """Within the block, torch.nn.init's initialisers return a meta tensor untouched (there is nothing to
    write), keeping the shape checks that fail for real (fan-in of a 1-d tensor); any other tensor is
    initialised as usual. Code that bound an initialiser before the block (from torch.nn.init import
    normal_) is not affected: it runs, just slower."""
    init = nn.init
    originals = {name: getattr(init, name) for name in INITIALISERS if hasattr(init, name)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def initialiser(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                if name in _FAN_CHECKED:
                    init._calculate_fan_in_and_fan_out(tensor)
                return tensor
            return fn(tensor, *args, **kwargs)

        initialiser.__wrapped__ = fn  # type: ignore[attr-defined]
        return initialiser

    for name, fn in originals.items():
        setattr(init, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(init, name, fn)


def build_model(user: Any, spec: ModelFile, seed: int, everything_on_meta: bool) -> nn.Module:
    """The user's model: all on meta (for tracing), or parameters on meta and buffers real (for weights).
    Initialisers do not run on meta tensors (no_init_on_meta): materialise() initialises the weights."""
    torch.manual_seed(seed)  # a constructor that draws random numbers draws the same ones on every rank
    build = getattr(user, spec.build_fn)
    with torch.device("meta") if everything_on_meta else parameters_on_meta(), no_init_on_meta():
        model = build(**spec.model_args)
    if not isinstance(model, nn.Module):
        raise RunError(f"{spec.build_fn}() returned {type(model).__name__}, not a torch.nn.Module: return the model.")
    hf_training_settings(model)
    return model.train()


# Attention implementations of transformers that the planner traces on meta and the script runs on any device.
HF_TRACEABLE_ATTENTION = ("sdpa", "eager")


def hf_training_settings(model: nn.Module) -> dict[str, Any]:
    """Set what training needs on every transformers PreTrainedModel inside `model`, however the model file
    built it (a default config ships use_cache=True): no KV cache and so no returned past, and an attention
    implementation that traces (sdpa, or eager where the class has no sdpa path, as the hf: source sets; an
    implementation chosen as sdpa or eager is kept). The settings set, for the plan to report; {} when the
    model holds no PreTrainedModel. The planner's analysis and the generated script both build through here."""
    settings: dict[str, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if not hf_owner(module) or config is None:
            continue
        config.use_cache = False
        attention = getattr(config, "_attn_implementation", None)
        if attention not in HF_TRACEABLE_ATTENTION:
            attention = "eager" if getattr(module, "_supports_sdpa", True) is False else "sdpa"
            config._attn_implementation = attention
        settings = {"use_cache": False, "attn_implementation": attention}
    return settings


def default_init(name: str, p: torch.Tensor) -> None:
    """The GPT-2 default for a parameter whose module has no reset_parameters(): N(0, 0.02) for matrices,
    ones for 1-d weights/scales/gains, zeros for other vectors (biases)."""
    if p.dim() >= 2:
        nn.init.normal_(p, std=0.02)
    elif name.endswith(("weight", "scale", "gain")):
        nn.init.ones_(p)
    else:
        nn.init.zeros_(p)


def materialise(
    model: nn.Module, module_names: set[str], device: torch.device, seed: int, weights: Checkpoint | None = None
) -> None:
    """Allocate and initialise the parameters of `module_names` on `device`; the rest stays on meta.

    Each module's reset_parameters() runs under a seed derived from (seed, its qualified name), so a
    weight's initial value is the same whichever rank holds it, for every layout. Parents run before their
    children while the children are still on meta, so a parent's reset never sees (or draws numbers for)
    children, and each child's own reset_parameters() has the last word over its weights. Parameters of a
    module without reset_parameters() get default_init().

    A weight held by several modules (tied: GPT-2's wte and lm_head) takes the value its first holder (in
    named_modules order) gives it, and later holders' resets leave it alone: every rank holding a copy (the
    first and the last pipeline stage) then starts from the same values, and every holder of it holds that
    one tensor.
    """
    cuda = [device] if device.type == "cuda" else []
    first_holder: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            first_holder.setdefault(id(p), name)
    wanted = set(module_names)
    for name, module in model.named_modules():
        if name in module_names:
            wanted.update(first_holder[id(p)] for p in module.parameters(recurse=False))
    allocated: dict[int, nn.Parameter] = {}  # id of the meta parameter -> its tensor (tied weights share one)
    replaced: dict[int, nn.Parameter] = {}  # id of the meta parameter -> the meta parameter
    for name, module in model.named_modules():
        if name not in wanted:
            continue
        params = dict(module.named_parameters(recurse=False))
        buffers = dict(module.named_buffers(recurse=False))
        if not params and not buffers:
            continue
        # Like to_empty(recurse=False), but buffers keep the values their constructor computed.
        for pname, p in params.items():
            if id(p) not in allocated:
                empty = torch.empty_like(p, device=device)
                allocated[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
                replaced[id(p)] = p  # kept alive, so that its id names it until the end
            module._parameters[pname] = allocated[id(p)]
        for bname, b in buffers.items():
            module._buffers[bname] = b.to(device)
        tied = {
            pname: module._parameters[pname].detach().clone() for pname, p in params.items()
            if first_holder[id(p)] != name
        }
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(derived_seed(seed, "init", name))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                for pname, p in module.named_parameters(recurse=False):
                    if pname not in tied:
                        default_init(pname, p)
            for pname, value in tied.items():
                module._parameters[pname].copy_(value)
    # A tied weight's holders outside `module_names` (T5's encoder.embed_tokens, on the rank holding lm_head)
    # hold the allocated tensor too, as in the model as built: one parameter under each of its names.
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and replaced.get(id(p)) is p:
                module._parameters[pname] = allocated[id(p)]
    if weights is not None:
        load_weights(model, weights, wanted)  # (after the inits above: a buffer the checkpoint lacks keeps its own)
    else:
        own_initialisation(model, wanted, device, seed)


def hf_owner(module: nn.Module) -> bool:
    """Whether `module` is a transformers PreTrainedModel (by its classes' names: the runtime never imports
    transformers; nanoGPT's GPT also has a config and an `_init_weights`, not transformers' contract)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


def own_initialisation(
    model: nn.Module, wanted: set[str], device: torch.device, seed: int, lora: bool = True
) -> None:
    """Run the model's own initialisation over the modules `wanted` hold, after their constructor's defaults,
    as the model's authors do: transformers' `_init_weights` (each module by its nearest PreTrainedModel, the
    children before their parent, as PreTrainedModel.initialize_weights's smart_apply), else a top-level
    `init_weights()` (torchtitan's, given `buffer_device`). Meta parameters (other ranks') are skipped, and
    every initialiser call on a parameter draws from a seed derived from (seed, the parameter's name)
    (seeded_per_parameter) and any other draw of a module's `_init_weights` from one of (seed, the module's
    name), so each value is the same whichever rank holds it, for every layout."""
    cuda = [device] if device.type == "cuda" else []
    # (a LoRA layer holds no weights of its own, and a traced stage calls its adapters, not it: a layer counts
    # where any of its modules is wanted)
    holding = {p for n in wanted for p in _prefixes(n)}
    adapted = [
        m for n, m in model.named_modules() if n in holding and callable(getattr(m, "reset_lora_parameters", None))
    ]
    if lora and adapted:
        # peft's LoRA layers: their adapters as peft initialises them by default (A Kaiming-uniform, B zero,
        # so the adapted model starts as the base model), after the base model's own initialisation below.
        with seeded_per_parameter(model, seed, cuda), torch.no_grad():
            own_initialisation(model, wanted, device, seed, lora=False)
            for layer in adapted:
                for adapter in getattr(layer, "lora_A", {}):
                    layer.reset_lora_parameters(adapter, True)
        return
    if hf_owner(model):
        owners: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            parent = owners.get(name.rpartition(".")[0], model) if name else model
            owners[name] = module if hf_owner(module) else parent
        # The modules wanted and their ancestors (a parent's init may set its children's weights: GPT-2's
        # attention scales its c_proj), children first.
        keep = {""} | {n for n in wanted for n in _prefixes(n)}
        order = [(n, m) for n, m in model.named_modules() if n in keep][::-1]
        with seeded_per_parameter(model, seed, cuda), torch.no_grad():
            for name, module in order:
                # Numbers an `_init_weights` draws outside the initialisers (Mamba's dt_proj bias:
                # torch.rand, then the inverse softplus) come from a seed of (seed, the module's name),
                # not from wherever the global generator stands after the modules this rank inits before it.
                with torch.random.fork_rng(devices=cuda):
                    torch.manual_seed(derived_seed(seed, "own-init", name))
                    owners[name]._init_weights(module)  # type: ignore[operator]
        return
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights) and _callable_without_arguments(init_weights):
        kwargs = {"buffer_device": device} if accepts(init_weights, "buffer_device") else {}
        with seeded_per_parameter(model, seed, cuda), torch.no_grad():
            init_weights(**kwargs)


def _prefixes(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]


def _callable_without_arguments(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


@contextlib.contextmanager
def seeded_per_parameter(model: nn.Module, seed: int, cuda: list[torch.device]) -> Iterator[None]:
    """Within the block, torch.nn.init's initialisers (and transformers.initialization's table of them, where
    transformers is loaded) leave meta tensors alone and draw a parameter's numbers from a seed derived from
    (seed, the parameter's first name): the value does not depend on which other parameters exist or in what
    order they are initialised. Other tensors (slices, buffers) are initialised as usual."""
    names = {id(p): name for name, p in model.named_parameters()}
    init = nn.init
    tables: list[dict[str, Any]] = [vars(init)]
    hf_init = sys.modules.get("transformers.initialization")
    if hf_init is not None and isinstance(getattr(hf_init, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf_init.TORCH_INIT_FUNCTIONS)
    saved = [{k: table[k] for k in INITIALISERS if k in table} for table in tables]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def initialiser(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                return tensor
            name = names.get(id(tensor))
            if name is None:
                return fn(tensor, *args, **kwargs)
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(derived_seed(seed, "param", name))
                return fn(tensor, *args, **kwargs)

        initialiser.__wrapped__ = fn  # type: ignore[attr-defined]
        return initialiser

    for table, originals in zip(tables, saved, strict=True):
        for k, fn in originals.items():
            table[k] = wrap(fn)
    try:
        yield
    finally:
        for table, originals in zip(tables, saved, strict=True):
            table.update(originals)
