"""Loading a model file that follows the model-file contract (DESIGN.md), on the meta device.

Loading runs the user's code (it is their model). The model is built under ``torch.device("meta")`` so that
a 175B-parameter model costs no memory; only ``example_inputs(1)`` is materialised, on the CPU.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from planner.errors import ModelLoadError
from planner.model.graph import ModelSource
from planner.model.guard import DEFAULT_TIME_LIMIT_S, user_code, where_in
from planner.model.reads import Reads, recording

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class LoadedModel:
    """The imported model file's callables, with the source description they came from."""

    source: ModelSource
    module: ModuleType
    build: Callable[..., Any]
    example_inputs: Callable[..., Any]
    loss_fn: Callable[..., Any] | None
    time_limit: float | None = DEFAULT_TIME_LIMIT_S  # seconds for each guarded call into the user's code
    input_ids: dict[int, int] = field(default_factory=dict)  # id(meta input tensor) -> its index
    input_refs: list[tuple[Any, ...]] = field(default_factory=list)  # keeps those tensors alive so ids stay unique
    reads: Reads = field(default_factory=Reads)  # what the import read (planner.model.reads): the cache's inputs
    settings: dict[str, Any] = field(default_factory=dict)  # Hugging Face training settings the build applied


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _user_frame(exc: BaseException, path: Path) -> str:
    """'file, line N: code' of the deepest traceback frame in the user's file (or its folder), or ''."""
    return where_in(exc, path)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_model_file(
    path: str | Path,
    model_args: dict[str, Any] | None = None,
    build_fn: str = "build_model",
    inputs_fn: str = "example_inputs",
    loss_fn: str | None = None,
    dtype: str = "bf16",
    batch_fn: str | None = None,
    time_limit: float | None = DEFAULT_TIME_LIMIT_S,
) -> LoadedModel:
    """Import a model file and check it defines the contract's functions and accepts the model args.

    time_limit: seconds the import (and later each build / example-inputs call) may take; None for none.
    """
    import torch  # noqa: F401 - imported before the time limit starts: it is the planner's cost, not the model's
    p = Path(path).expanduser()
    if p.is_dir():
        raise ModelLoadError(
            f"Model file {str(path)!r} is a directory. Pass the path of the Python file inside it that defines "
            "build_model(**kwargs) and example_inputs(batch_size, **kwargs), e.g. sample_models/gpt.py."
        )
    if p.exists() and not p.is_file():
        raise ModelLoadError(
            f"Model file {str(path)!r} is not a regular file (a FIFO, a device or a socket): the planner reads the "
            "model's Python source from it. Pass the path of the .py file that defines build_model(**kwargs) and "
            "example_inputs(batch_size, **kwargs)."
        )
    if not p.is_file():
        raise ModelLoadError(
            f"Model file {str(path)!r} does not exist. Pass the path of a Python file that defines "
            "build_model(**kwargs) and example_inputs(batch_size, **kwargs), e.g. sample_models/gpt.py."
        )
    p = p.resolve()
    if p.suffix != ".py":
        raise ModelLoadError(f"Model file {p} is not a Python (.py) file. Pass the .py file that defines build_model.")
    if dtype not in DTYPE_BYTES:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}.")
    digest = file_digest(p)
    name = f"planner_user_model_{digest[:16]}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"Cannot import {p} as a Python module. Check that it is a readable .py file.")
    module = importlib.util.module_from_spec(spec)
    # Sibling imports in the user's file (from .layers / import layers) resolve from its folder.
    sys.path.insert(0, str(p.parent))
    try:
        sys.modules[name] = module
        with recording(p.parent) as reads, user_code(p, f"Importing {p}", time_limit):
            spec.loader.exec_module(module)
    except ModelLoadError:
        sys.modules.pop(name, None)
        raise
    except Exception as e:  # noqa: BLE001 - any error in user code becomes a load error
        sys.modules.pop(name, None)
        where = _user_frame(e, p)
        raise ModelLoadError(
            f"Importing {p} failed with {type(e).__name__}: {e}"
            + (f" (at {where})" if where else "")
            + ". Fix the model file so that `python -c \"import runpy; runpy.run_path('FILE')\"` succeeds."
        ) from e
    finally:
        if sys.path and sys.path[0] == str(p.parent):
            sys.path.pop(0)

    def _get(fn_name: str, required: bool) -> Callable[..., Any] | None:
        fn = getattr(module, fn_name, None)
        if fn is None:
            if not required:
                return None
            defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
            raise ModelLoadError(
                f"{p.name} does not define {fn_name}(). The model-file contract needs build_model(**kwargs) -> "
                "nn.Module and example_inputs(batch_size, **kwargs) -> tuple of tensors; "
                f"functions found: {', '.join(defined) or 'none'}. Add the function or name yours with "
                "--build-fn / --inputs-fn."
            )
        if not callable(fn):
            raise ModelLoadError(f"{p.name}: {fn_name} is not a function. Define it with `def {fn_name}(...)`.")
        found: Callable[..., Any] = fn
        return found

    def _need(fn_name: str) -> Callable[..., Any]:
        fn = _get(fn_name, True)
        assert fn is not None  # _get raised for a required function it did not find
        return fn

    build = _need(build_fn)
    inputs = _need(inputs_fn)
    loss = _need(loss_fn) if loss_fn else _get("loss_fn", False)
    batch = _need(batch_fn) if batch_fn else getattr(module, "get_batch", None)
    source = ModelSource(
        path=str(p),
        file_sha256=digest,
        build_fn=build_fn,
        inputs_fn=inputs_fn,
        loss_fn=(loss_fn or ("loss_fn" if loss is not None else None)),
        batch_fn=(batch_fn or "get_batch") if callable(batch) else None,
        model_args=dict(sorted((model_args or {}).items())),
        dtype=dtype,
    )
    _check_model_args(p, source.model_args, [(build_fn, build, 0), (inputs_fn, inputs, 1)])
    if callable(batch):
        _check_data_fn(p, source.batch_fn or "get_batch", batch, source.model_args)
    reads.files.add(str(p))
    return LoadedModel(
        source=source, module=module, build=build, example_inputs=inputs, loss_fn=loss, time_limit=time_limit,
        reads=reads,
    )


def _check_model_args(path: Path, args: dict[str, Any], fns: list[tuple[str, Callable[..., Any], int]]) -> None:
    """Refuse a --model-arg that a function without **kwargs does not take (a typo would plan the default).

    fns: (name, function, leading positional parameters the planner passes itself, e.g. batch_size).
    """
    for fn_name, fn, skip in fns:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            continue  # a builtin or C function: nothing to check against
        if any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params):
            continue
        names = [
            q.name for q in params[skip:]
            if q.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        unknown = sorted(k for k in args if k not in names)
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ModelLoadError(
                f"--model-arg {key!r} is not a parameter of {fn_name}() in {path.name} (it takes: "
                f"{', '.join(names) or 'no keyword arguments'}).{hint} Fix the key, or give {fn_name} a **kwargs "
                "parameter if it should accept and ignore other arguments."
            )


def _check_data_fn(path: Path, name: str, fn: Callable[..., Any], args: dict[str, Any]) -> None:
    """The data function takes (step, micro_batch_size, **model_args), as the generated train.py calls it."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check against
    try:
        signature.bind(0, 1, **args)
    except TypeError as e:
        raise ModelLoadError(
            f"The data function {name}{signature} in {path.name} cannot be called as {name}(step, "
            f"micro_batch_size, **model_args), which is how train.py calls it for each batch ({e}). Give it that "
            "signature (add **kwargs to accept the model arguments), or name another function with --data."
        ) from None


def _call_user(
    fn: Callable[..., Any], what: str, path: str, args: tuple[Any, ...], kwargs: dict[str, Any],
    time_limit: float | None = DEFAULT_TIME_LIMIT_S,
) -> Any:
    """fn(*args, **kwargs) under the guard: an exit, signal or hang as well as an exception is a ModelLoadError."""
    try:
        with user_code(path, what, time_limit):
            return fn(*args, **kwargs)
    except ModelLoadError:
        raise
    except TypeError as e:
        raise ModelLoadError(
            f"{what} rejected its arguments: {e}. Check the --model-arg names against the function's parameters "
            f"in {path} (both build_model and example_inputs receive every --model-arg, so give them **kwargs)."
        ) from e
    except Exception as e:  # noqa: BLE001
        where = _user_frame(e, Path(path))
        raise ModelLoadError(
            f"{what} raised {type(e).__name__}: {e}"
            + (f" (at {where})" if where else "")
            + ". Fix the model file or the --model-arg values."
        ) from e


def build_meta_model(loaded: LoadedModel) -> torch.nn.Module:
    """Build the model on the meta device in the training dtype: no weight is allocated.

    Each module that needs floating inputs (Linear, convolutions, norms) checks, the first time it runs, that
    it is not fed an integer tensor: on meta that computes silently, on a GPU the script would fail.
    """
    import torch

    from planner.runtime.model import hf_training_settings, no_init_on_meta

    # No initialiser runs on a meta tensor: it would write nothing, and what it runs costs seconds to import.
    with torch.device("meta"), no_init_on_meta():
        model = _call_user(
            loaded.build, f"{loaded.source.build_fn}()", loaded.source.path, (), loaded.source.model_args,
            loaded.time_limit,
        )
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(
            f"{loaded.source.build_fn}() returned {type(model).__name__}, not a torch.nn.Module. Return the model."
        )
    _check_traceable(model, loaded.source.build_fn)
    loaded.settings = hf_training_settings(model)  # as the generated script's build applies them
    model = model.to(torch_dtype(loaded.source.dtype))
    _check_input_dtypes(model, loaded)
    return model


def _check_traceable(model: torch.nn.Module, build_fn: str) -> None:
    """A model the planner can take apart: not TorchScript, no parameter left uninitialised (lazy modules)."""
    import torch
    from torch.nn.modules.lazy import LazyModuleMixin

    if isinstance(model, torch.jit.ScriptModule):
        raise ModelLoadError(
            f"{build_fn}() returned a TorchScript module ({type(model).__name__}). The planner traces, splits and "
            "shards the model's Python modules, which torch.jit.script compiles away. Return the nn.Module "
            "itself (script it in the training script if you need to)."
        )
    lazy = [name or type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]  # type: ignore[misc]
    if lazy:
        raise ModelLoadError(
            f"{build_fn}() returned a model with lazy modules whose shapes are not known yet ({', '.join(lazy[:3])}"
            f"{' ...' if len(lazy) > 3 else ''}): their parameters exist only after a first forward pass, so "
            "nothing can be counted or placed. Give them their input sizes (nn.Linear(in, out) for nn.LazyLinear), "
            "or run the model once on example inputs inside build_model."
        )


def _float_input_modules() -> tuple[type, ...]:
    from torch import nn

    kinds: list[type] = [nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.LayerNorm, nn.GroupNorm,
                         nn.modules.batchnorm._NormBase, nn.MultiheadAttention]
    if hasattr(nn, "RMSNorm"):
        kinds.append(nn.RMSNorm)
    return tuple(kinds)


def _check_input_dtypes(model: torch.nn.Module, loaded: LoadedModel) -> None:
    """One-shot forward pre-hooks: an integer tensor reaching a float-only module is a ModelLoadError."""
    import torch

    kinds = _float_input_modules()
    handles: dict[str, Any] = {}

    def hook(name: str) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def check(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = next((a for a in args if isinstance(a, (torch.Tensor, torch.fx.Proxy))), None)
            if x is None or isinstance(x, torch.fx.Proxy):
                return  # symbolic tracing: no dtype yet; the meta run after it is checked
            if name in handles:
                handles.pop(name).remove()  # one check per module: no cost on later (e.g. profiled) calls
            if not (x.is_floating_point() or x.is_complex()):
                # The id map knows the meta inputs the planner passes; the trace keeps them alive.
                index = loaded.input_ids.get(id(x))
                what = (f"input {index} of {loaded.source.inputs_fn}()" if index is not None
                        else "a tensor computed from the inputs")
                raise ModelLoadError(
                    f"{what} ({str(x.dtype).removeprefix('torch.')}, shape {list(x.shape)}) is fed to "
                    f"{name or 'the model'} ({type(module).__name__}), which needs floating-point input: the "
                    "generated script would fail there on the GPU. Return float tensors from "
                    f"{loaded.source.inputs_fn}() for that input (or pass token ids through an nn.Embedding "
                    "first)."
                )

        check.planner_trace_neutral = True  # type: ignore[attr-defined]  # returns at once on proxies (tracers.py)
        return check

    for name, module in model.named_modules():
        if any(isinstance(module, kind) for kind in kinds):  # (isinstance with the tuple narrows to object)
            handles[name] = module.register_forward_pre_hook(hook(name))


def example_batch(loaded: LoadedModel, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Call example_inputs(batch_size) and check it returns a non-empty tuple of tensors."""
    import torch

    out = _call_user(
        loaded.example_inputs,
        f"{loaded.source.inputs_fn}({batch_size})",
        loaded.source.path,
        (batch_size,),
        loaded.source.model_args,
        loaded.time_limit,
    )
    if isinstance(out, torch.Tensor):
        out = (out,)
    if not isinstance(out, (tuple, list)) or not out or not all(isinstance(t, torch.Tensor) for t in out):
        raise ModelLoadError(
            f"{loaded.source.inputs_fn}() must return a tensor or a tuple of tensors (one micro-batch); "
            f"it returned {type(out).__name__}."
        )
    return tuple(out)


def meta_inputs(loaded: LoadedModel, batch_size: int = 1) -> tuple[torch.Tensor, ...]:
    """example_inputs on the meta device; floating inputs cast to the training dtype."""

    dt = torch_dtype(loaded.source.dtype)
    out = tuple(
        t.to(device="meta", dtype=dt) if t.is_floating_point() else t.to(device="meta")
        for t in example_batch(loaded, batch_size)
    )
    # Remembered by identity so that the dtype check can name the input (the tuple outlives the check).
    loaded.input_ids.update({id(t): i for i, t in enumerate(out)})
    loaded.input_refs.append(out)
    return out
