"""Loading a model file that follows the model-file contract (DESIGN.md), on the meta device.

Loading runs the user's code (it is their model). The model is built under ``torch.device("meta")`` so that
a 175B-parameter model costs no memory; only ``example_inputs(1)`` is materialised, on the CPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from planner.errors import ModelLoadError
from planner.model.graph import ModelSource

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class LoadedModel:
    """The imported model file's callables, with the source description they came from."""

    source: ModelSource
    module: ModuleType
    build: Callable[..., Any]
    example_inputs: Callable[..., Any]
    loss_fn: Callable[..., Any] | None


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _user_frame(exc: BaseException, path: Path) -> str:
    """'line N: code' of the deepest frame of the traceback that lies in the user's file, or ''."""
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path:
            where = f"{path.name}, line {frame.lineno}: {(frame.line or '').strip()}"
    return where


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
) -> LoadedModel:
    """Import a model file and check it defines the contract's functions."""
    p = Path(path).expanduser()
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
        spec.loader.exec_module(module)
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
        return fn

    build = _get(build_fn, True)
    inputs = _get(inputs_fn, True)
    loss = _get(loss_fn, True) if loss_fn else _get("loss_fn", False)
    batch = _get(batch_fn, True) if batch_fn else getattr(module, "get_batch", None)
    source = ModelSource(
        path=str(p),
        file_sha256=digest,
        build_fn=build_fn,
        inputs_fn=inputs_fn,
        loss_fn=(loss_fn or ("loss_fn" if loss is not None else None)),
        batch_fn=(batch_fn or "get_batch") if callable(batch) else None,
        model_args=dict(sorted((model_args or {}).items())),
        dtype=dtype,  # type: ignore[arg-type]
    )
    return LoadedModel(source=source, module=module, build=build, example_inputs=inputs, loss_fn=loss)


def _call_user(fn: Callable[..., Any], what: str, path: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
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


def build_meta_model(loaded: LoadedModel):
    """Build the model on the meta device in the training dtype: no weight is allocated, and no initialiser
    runs on a meta tensor (it would write nothing, and importing what it runs on costs seconds)."""
    import torch

    from planner.runtime.model import no_init_on_meta

    with torch.device("meta"), no_init_on_meta():
        model = _call_user(loaded.build, f"{loaded.source.build_fn}()", loaded.source.path, **loaded.source.model_args)
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(
            f"{loaded.source.build_fn}() returned {type(model).__name__}, not a torch.nn.Module. Return the model."
        )
    return model.to(torch_dtype(loaded.source.dtype))


def example_batch(loaded: LoadedModel, batch_size: int) -> tuple:
    """Call example_inputs(batch_size) and check it returns a non-empty tuple of tensors."""
    import torch

    out = _call_user(
        loaded.example_inputs,
        f"{loaded.source.inputs_fn}({batch_size})",
        loaded.source.path,
        batch_size,
        **loaded.source.model_args,
    )
    if isinstance(out, torch.Tensor):
        out = (out,)
    if not isinstance(out, (tuple, list)) or not out or not all(isinstance(t, torch.Tensor) for t in out):
        raise ModelLoadError(
            f"{loaded.source.inputs_fn}() must return a tensor or a tuple of tensors (one micro-batch); "
            f"it returned {type(out).__name__}."
        )
    return tuple(out)


def meta_inputs(loaded: LoadedModel, batch_size: int = 1) -> tuple:
    """example_inputs on the meta device; floating inputs cast to the training dtype."""

    dt = torch_dtype(loaded.source.dtype)
    return tuple(
        t.to(device="meta", dtype=dt) if t.is_floating_point() else t.to(device="meta")
        for t in example_batch(loaded, batch_size)
    )
