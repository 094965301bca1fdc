"""Tracing a meta-device model into a torch.fx graph: symbolic tracing first, then symbolic tracing with meta
values, torch.export as the last fallback.

Symbolic tracing keeps the module calls (good for partitioning by module name) but cannot follow
Python control flow on shapes or values; the symbolic trace with meta values (planner.runtime.tracers)
follows branches on shapes, dtypes and devices, specialising the graph to the example inputs' shapes;
torch.export (non-strict) specialises shapes too and follows more (fake tensors), at about a millisecond
per op. Either way the result is a GraphModule whose nodes carry
``nn_module_stack`` metadata, which is what grouping into units relies on.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from planner.errors import ModelLoadError, PlannerError, TraceError
from planner.model.load import _user_frame

if TYPE_CHECKING:
    import torch.fx
    import torch.nn as nn

log = logging.getLogger(__name__)

# Each kind of repeated block traced once and replayed for the others (planner.runtime.tracers.RepeatedBlocks):
# the same graph, node for node, at a fraction of the time (Llama-3-70B's 80 layers). False traces every block
# (tests compare the two).
REPLAY_REPEATED_BLOCKS = True
# Of those, the repeats of the model's blocks (its units) kept as one call each: the analysis counts and shards
# the first of each kind and reads only a unit's inputs and outputs from the graph (tracers._Recording.fold).
# False replays them node for node (tests compare the analyses).
FOLD_REPEATED_BLOCKS = True


@dataclass
class Traced:
    gm: torch.fx.GraphModule
    method: Literal["fx", "fx-meta", "export"]
    fx_error: str | None = None
    checked: Any = None  # what trace_model's `check` returned


def symbolic_trace(model: nn.Module, fold: frozenset[str] = frozenset()) -> torch.fx.GraphModule:
    """torch.fx.symbolic_trace with a tensor-name cache; `fold`: blocks whose repeats are kept as one call each
    (`trace_model`).

    The stock tracer looks up every tensor attribute it meets (a rotary table read in each block) by
    walking all of the model's buffers, which is quadratic in depth: minutes for an 80-layer model.
    """
    from planner.runtime.tracers import BufferTracer  # the generated script traces with the same tracer

    tracer = BufferTracer(repeats=REPLAY_REPEATED_BLOCKS, fold=fold)
    graph = tracer.trace(model)
    with lazy_graph_modules():  # the analysis splits the graph and never runs the whole of it: no code to compile
        return _make_graph_module(tracer.root, graph, model.__class__.__name__)


def _make_graph_module(root: nn.Module, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """A GraphModule, lazy inside lazy_graph_modules() where torch has them."""
    import torch.fx

    try:
        from torch.fx._lazy_graph_module import _make_graph_module as make
    except ImportError:
        return torch.fx.GraphModule(root, graph, name)
    return make(root, graph, name)


def lazy_graph_modules() -> contextlib.AbstractContextManager[None]:
    """Graph modules made inside compile their Python code on first use, not when made (torch's lazy graph
    modules): split_module makes one per unit (and compiles each twice) where only the distinct units run, and
    torch.export recompiles the whole graph after several of its passes. GPT-3 175B's split: 0.15 s -> 0.04 s;
    Llama-3-70B's export: ~0.4 s less. The same code either way (where torch lacks the switch, at once)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def _shape_check(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> object:
    """Run the traced graph on meta inputs: a symbolic trace can succeed yet bake in a wrong shape path."""
    from torch.fx.passes.shape_prop import ShapeProp

    return ShapeProp(gm).propagate(*inputs)


def trace_model(
    model: nn.Module,
    inputs: tuple[Any, ...],
    model_path: str,
    check: Callable[[torch.fx.GraphModule], Any] | None = None,
    fold: frozenset[str] = frozenset(),
) -> Traced:
    """Trace ``model`` called on ``inputs`` (meta tensors). Raises TraceError naming the offending line.

    ``check(gm)`` runs the traced graph on the meta inputs (by default all of it; the unit analysis
    passes a cheaper check that runs each distinct block once) and its result is kept in ``Traced.checked``.
    ``fold``: the blocks (the analysis' units) whose repeats of an earlier block, called alike, are one
    call_module node each rather than its nodes again (FOLD_REPEATED_BLOCKS; not torch.export's graph).
    """
    check = check or (lambda gm: _shape_check(gm, inputs))
    fold = fold if FOLD_REPEATED_BLOCKS else frozenset()
    import torch
    import torch.fx

    from planner.runtime.stages import without_stack_traces

    fx_error: str | None = None
    try:
        gm = symbolic_trace(model, fold)
        return Traced(gm=gm, method="fx", checked=check(gm))
    except ModelLoadError:
        raise  # the model breaks the contract (e.g. int inputs into a Linear): no tracer will fix that
    except Exception as e:  # noqa: BLE001 - any failure sends us to the fallback
        where = _user_frame(e, Path(model_path))
        fx_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" + (f" at {where}" if where else "")
        log.info("symbolic tracing failed (%s); tracing with meta values", fx_error)
    try:
        # Python reading shapes (transformers' mask and rotary code): the symbolic trace with meta values
        # answers it, at fx's speed, where torch.export takes ~1 ms per op (planner.runtime.tracers).
        from planner.runtime.tracers import meta_trace

        graph = meta_trace(model, tuple(inputs), repeats=REPLAY_REPEATED_BLOCKS, fold=fold)
        with lazy_graph_modules():
            gm = _make_graph_module(model, graph, model.__class__.__name__)
        return Traced(gm=gm, method="fx-meta", fx_error=fx_error, checked=check(gm))
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.export follows more (values on fake tensors)
        log.info("tracing with meta values failed (%s: %s); falling back to torch.export", type(e).__name__, e)
    try:
        # torch.export logs partial graphs and symbolic-shape warnings when it fails; our error says it all.
        quiet = [
            logging.getLogger(n)
            for n in (
                "torch._dynamo",
                "torch.fx.experimental.symbolic_shapes",
                "torch._export",
                "torch.export",
                "torch._subclasses",
            )
        ]
        levels = [lg.level for lg in quiet]
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        # torch.export logs its own ERROR with a traceback on failure (before our message): silence all logging
        # for the call, not only the loggers above.
        disabled = logging.root.manager.disable
        logging.disable(logging.CRITICAL)
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
                without_stack_traces(),
                lazy_graph_modules(),
            ):
                ep = torch.export.export(model, tuple(inputs), strict=False)
        finally:
            logging.disable(disabled)
            for lg, level in zip(quiet, levels):
                lg.setLevel(level)
        gm = ep.module()
        return Traced(gm=gm, method="export", fx_error=fx_error, checked=check(gm))
    except PlannerError:
        # The planner's own check of the traced graph (no submodules called, ...) or a contract error: that is
        # the real cause, not the tracer's ability to follow control flow.
        raise
    except Exception as e:  # noqa: BLE001
        own = _model_error(model, inputs, model_path)
        if own is not None:
            raise own from e
        where = _user_frame(e, Path(model_path))
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TraceError(
            "Neither torch.fx symbolic tracing nor torch.export could follow the model"
            + (f": the failing line is {where}" if where else "")
            + f" ({type(e).__name__}: {first[:300]}). Typical causes are Python branches on tensor values "
            "(`if x.sum() > 0:`) or calls the tracer cannot see through. Replace data-dependent control flow "
            "with tensor ops (torch.where) or move it out of forward()."
            + (f" Symbolic tracing had failed with {fx_error}." if fx_error else "")
        ) from e


def training_error(
    model: nn.Module, inputs: tuple[Any, ...], model_path: str, unit: Sequence[str], error: Exception
) -> Exception:
    """What to raise where counting a traced unit forward and backward failed with `error`: the model's own code
    failing under autograd (`torch.add(out, x, out=out)` on a tensor that requires grad), quoted with the model's
    line where running it as written on the example inputs with gradients fails too; else `error` itself (the
    model runs, the planner's count does not: a bug to report)."""
    import torch

    try:
        with torch.enable_grad():
            out = model(*inputs)
            leaves = torch.utils._pytree.tree_leaves(out)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    except PlannerError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own error, quoted
        return TraceError(
            f"The model cannot train: forward and backward on its example inputs fail in {', '.join(unit[:3])} "
            f"{_quoted(e, model_path)} Fix the model so that a forward and backward pass runs with gradients (an op "
            "with out= or one that changes a leaf in place cannot)."
        )
    return error


def _quoted(e: Exception, model_path: str) -> str:
    """The model's own error as a message quotes it: `(Type at file, line N): the first line of its message`."""
    where = _user_frame(e, Path(model_path))
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"({type(e).__name__}" + (f" at {where}" if where else "") + f"): {first[:300]}"


def _model_error(model: nn.Module, inputs: tuple[Any, ...], model_path: str) -> TraceError | None:
    """The model's own error, when running it as written on the example inputs (meta tensors, no tracer) raises:
    then the tracers failed because the model does, and the message quotes the model rather than guessing at
    control flow. None when the model runs (the tracers' limits are the cause)."""
    import torch

    try:
        with torch.no_grad():
            model(*inputs)
    except PlannerError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own error, quoted
        shapes = ", ".join(str(list(t.shape)) for t in inputs if isinstance(t, torch.Tensor))
        return TraceError(
            f"The model raises when run as written on its example inputs (shapes {shapes}), before any tracer is "
            f"involved {_quoted(e, model_path)} Fix the model or example_inputs() so that "
            "model(*example_inputs(batch)) runs in training mode."
        )
    return None
