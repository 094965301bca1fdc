"""The plan-time check: in one process, without a process group, build the model on the meta device, cut it
into the plan's stages, check that the TP decisions apply, and run forward, loss and backward of one
micro-batch stage by stage, so that a plan that cannot run fails before anything is written, not on the
cluster. The checks are the ones the training run makes (the same functions), plus running the stages."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from .errors import RefusedLayout, RunError
from .layout import Layout, ModelFile, Stage, Training
from .loss import default_loss
from .memo import MetaMemo
from .meta import dtensor_on_meta, meta_without_dynamo
from .model import build_model, input_count, load_model_file, make_batch, materialise, micro_batch
from .recompute import apply_ac
from .repeats import blocks_once, describe, repeated_units, unit_kinds
from .stages import (
    SP_MODULE_PREFIX,
    AsWritten,
    GraphCopy,
    ModelStage,
    Piece,
    StageModule,
    Traced,
    cut_into_pieces,
    piece_attrs,
    shared_weights,
    trace,
    trace_for_plan,
    uses_graph,
    with_structure,
)
from .tp_graph import localise_tp_sizes
from .tp_rules import check_tp
from .unit_reads import reads_outside
from .vocab import VocabParallelLoss, loss_context, with_loss_parallel

SMALL = 50_000_000  # parameters: a model this small is rerun on the CPU when the meta device cannot run it


class Cancelled(BaseException):  # noqa: N818 - not an error: no `except Exception` of the check's may catch it
    """A check stopped by its caller at one of its checkpoints (`CheckCase.cancel`): it says nothing of the plan."""


@dataclass(frozen=True)
class CheckCase:
    """What every step of one check reads: the plan's layout, the model file and training settings, the user's
    module, one micro-batch (`example`, of which the model takes the first `n_inputs`) and the loss. `cancel`:
    the caller's say, asked at each checkpoint between the check's steps; once it holds, the check stops
    (raises Cancelled). The check worker stops the check of a plan sent ahead once a newer plan comes."""

    layout: Layout
    spec: ModelFile
    training: Training
    user: Any
    example: tuple[torch.Tensor, ...]
    n_inputs: int
    loss_fn: Callable[..., torch.Tensor]
    cancel: Callable[[], bool] | None = None

    def checkpoint(self) -> None:
        if self.cancel is not None and self.cancel():
            raise Cancelled

    def loss_backward(
        self, model: nn.Module, inputs: tuple[torch.Tensor, ...], compute_dtype: torch.dtype | None = None,
        units: list[nn.Module] | None = None,
    ) -> set[int]:
        """Forward of the model's leading inputs, the loss on its output and all `inputs` (the example, on the
        device the model is on), and backward. With `compute_dtype` (parameters cast to it), the model's
        floating-point inputs are cast to it too, as FSDP2's mixed precision casts a sharded module's inputs
        (MixedPrecisionPolicy.cast_forward_inputs): Whisper's mel features reach its first convolution in bf16
        on the cluster; the loss still gets them as they are. Returns the indices of the `units` whose weights
        the forward read outside their own forward (`unit_reads.reads_outside`; none without `units`)."""
        forward = tuple(
            t.to(compute_dtype) if compute_dtype is not None and t.is_floating_point() else t
            for t in inputs[: self.n_inputs]
        )
        with loss_context(self.layout):
            with reads_outside(units or []) as outside:
                out = model(*forward)
            loss = self.loss_fn(out, *inputs)
            _check_loss(loss)
            loss.backward()
        return outside


@contextlib.contextmanager
def _failing_as(what: str) -> Iterator[None]:
    try:
        yield
    except RunError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's code is reported with where it happened
        raise _run_error(what, e) from e


# autograd's refusal of an in-place op on a tensor-parallel Linear's output (DTensor.to_local's view)
_TP_OUTPUT_IN_PLACE = "Output 0 of _ToTorchTensor is a view and is being modified inplace"


def _run_error(what: str, e: Exception) -> RunError:
    first = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
    if _TP_OUTPUT_IN_PLACE in str(e):
        return RunError(
            f"{what} fails on one micro-batch: the model changes a tensor-parallel Linear's output in place"
            f"{_model_frame(e)} (e.g. `out += residual`). torch's tensor parallelism returns that output as a view "
            "of its sharded result, and autograd does not let a view made so be modified in place. Write it out "
            "of place (`out = out + residual`), or re-plan with --tp 1."
        )
    return RunError(
        f"{what} fails on one micro-batch ({type(e).__name__}: {first}). Fix the model file, or re-plan "
        "with other pins (e.g. another --pp, or --tp 1)."
    )


def _model_frame(e: BaseException) -> str:
    """' at FILE:LINE' of the innermost frame of `e` outside torch and the planner (the model's code), or ''."""
    import traceback

    skip = (os.sep + "torch" + os.sep, os.sep + "planner" + os.sep, os.sep + "planner_runtime" + os.sep)
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if not any(part in frame.filename for part in skip) and not frame.filename.startswith("<"):
            return f" at {frame.filename}:{frame.lineno}"
    return ""


class Prepared:
    """The start of a check of any plan of one model, made ahead (the check worker makes it while the search
    runs): the model file loaded, the model built on meta and, once `trace_ahead` ran, traced for a
    micro-batch of one. Taken by the first check of a traced pipeline (`uses_graph`) of the same model file and
    seed (it changes the model: TP shards it), whole or not at all."""

    def __init__(self, spec: ModelFile, seed: int) -> None:
        self.spec, self.seed = spec, seed
        self.user = load_model_file(spec.path)
        self.meta_model = build_model(self.user, spec, seed, everything_on_meta=True)
        # Above SMALL: what `probe_meta` and `build_spare` work ahead for (a smaller model's check may go to the CPU)
        self.large = sum(p.numel() for p in self.meta_model.parameters()) > SMALL
        self.traced: Traced | None = None
        self._taken = False
        # The model file loaded again and its model built on meta, ahead, for the next check of the model as
        # written (`build_spare`, `take_spare`).
        self.spare: tuple[Any, nn.Module] | None = None
        # Whether the model as written fails on the meta device (`probe_meta`): a check then runs it on fake
        # tensors at once (`_run_model`), as it would after the meta run failed.
        self.fails_on_meta = False

    def probe_meta(self, cancel: Callable[[], bool], modules: Sequence[str]) -> None:
        """Run the model's forward, loss and backward on meta as a check first runs it (`_run_model`), for a
        micro-batch of one, on a model of its own, `modules` its units (the planner's: its repeated blocks and
        the modules around them), each kind run once; where that fails (Hugging Face models call .item(),
        which the meta device cannot answer), note it (`fails_on_meta`). Only for a model above SMALL (a
        smaller one's failure sends its check to the CPU, not to fake tensors). It stops at the next module
        call once `cancel()` holds (Cancelled). The check worker runs it while no plan waits."""
        if not self.large:
            return
        model = build_model(self.user, self.spec, self.seed, everything_on_meta=True)
        names = list(modules)

        def stop(*_: Any) -> None:
            if cancel():
                raise Cancelled

        for module in model.modules():
            module.register_forward_pre_hook(stop)
        layout = Layout(pp=1, dp=1, tp=1, micro_batch_size=1, num_micro_batches=1, stages=(Stage(0, tuple(names)),))
        example = make_batch(self.user, self.spec, layout, self.seed, 0, 0)
        loss_fn = getattr(self.user, self.spec.loss_fn) if self.spec.loss_fn else default_loss
        case = CheckCase(
            layout, self.spec, Training(seed=self.seed), self.user, example, input_count(model, len(example)), loss_fn
        )
        stage = ModelStage(model, names)
        try:
            with MetaMemo(), blocks_once(stage):
                case.loss_backward(model, tuple(t.to("meta") for t in case.example), units=stage.units())
        except Exception:  # noqa: BLE001 - what a check of this model meets first on meta
            self.fails_on_meta = True

    def trace_ahead(self, experts_of: Callable[[nn.Module], frozenset[str]] | None = None) -> None:
        """Trace the built model for a micro-batch of one, as a traced pipeline's check would (a failure is left
        to that check, which traces again and reports it). `experts_of`: the MoE experts modules of the model,
        which a traced pipeline's graph keeps as calls (the plan's `experts`): traced so, the trace stands for
        the check's, and is quick (transformers' experts loop over every expert when traced through: seconds
        for Qwen3's 48 x 128)."""
        if self._taken or self.traced is not None:
            return
        example = micro_batch(self.user, self.spec, 1, self.seed, 0, 0)
        inputs = tuple(t.to("meta") for t in example[: input_count(self.meta_model, len(example))])
        with contextlib.suppress(Exception):
            leaves = experts_of(self.meta_model) if experts_of is not None else frozenset()
            self.traced = Traced(
                self.meta_model, inputs, leaves, trace(self.meta_model, inputs, leaves=leaves, repeats=True)
            )

    def build_spare(self) -> None:
        """Load the model file again and build its model on meta for the next check of the model as written (a plan
        without a traced pipeline), as that check would (a fresh module: a file counting its layers in a global
        builds the same); the check takes both (`take_spare`) instead of making its own: the check worker makes
        them while no plan waits (DeepSeek-V3 0.05 s, Whisper 0.04 s of a check on its critical path). Only for a
        model above SMALL: a smaller one's check may run it on the CPU, whose random draws follow the build."""
        if self.spare is None and self.large:
            user = load_model_file(self.spec.path)
            self.spare = (user, build_model(user, self.spec, self.seed, everything_on_meta=True))

    def take_spare(self, spec: ModelFile, seed: int) -> tuple[Any, nn.Module] | None:
        """The model file's module and model `build_spare` made, once, for a check of this model file and seed;
        else None."""
        if self.spare is None or not self._serves(spec, seed):
            return None
        spare, self.spare = self.spare, None
        return spare

    def fails_for(self, spec: ModelFile, seed: int) -> bool:
        """Whether `probe_meta` found this model file and seed to fail on meta."""
        return self.fails_on_meta and self._serves(spec, seed)

    def take(self, spec: ModelFile, seed: int) -> Prepared | None:
        if self._taken or not self._serves(spec, seed):
            return None
        self._taken = True
        return self

    def _serves(self, spec: ModelFile, seed: int) -> bool:
        """Whether a check of this model file and seed is one this preparation was made for."""
        return (spec, seed) == (self.spec, self.seed)


def check_plan_runs(
    layout: Layout,
    spec: ModelFile,
    training: Training,
    device_type: str = "cuda",
    prepared: Prepared | None = None,
    cancel: Callable[[], bool] | None = None,
) -> str:
    """Raise RunError naming the stage, module or rule if the plan cannot run on `device_type` (the run's
    device: "cuda", or "cpu" for a CPU plan); else return how it would run ("module": the model as written,
    or the tracing method of the pipeline's graph). `prepared`: the model loaded, built and traced ahead, used
    where it is this model's (`Prepared.take`). `cancel`: see CheckCase (Cancelled once it holds)."""
    meta_without_dynamo()  # the check runs on meta: no torch._dynamo import for its elementwise kernels
    # (made for a traced pipeline: the model as written is built afresh, as its trace called its forward)
    ready = prepared.take(spec, training.seed) if prepared is not None and uses_graph(layout) else None
    # (the model as written: the module loaded and the model built ahead, where the worker made them)
    spare = prepared.take_spare(spec, training.seed) if prepared is not None and not uses_graph(layout) else None
    if ready is not None:
        user = ready.user
    elif spare is not None:
        user = spare[0]
    else:
        user = load_model_file(spec.path)
    loss_fn: Callable[..., torch.Tensor] = getattr(user, spec.loss_fn) if spec.loss_fn else default_loss
    # The run's loss parallelism (vocab.py): the TP shard's LM head keeps its logits split by vocabulary.
    layout = with_loss_parallel(layout, getattr(user, spec.loss_fn) if spec.loss_fn else None)
    if layout.loss_parallel:
        loss_fn = VocabParallelLoss(loss_fn)
    example = make_batch(user, spec, layout, training.seed, 0, 0)
    if ready is not None:
        meta_model = ready.meta_model
    elif spare is not None:
        meta_model = spare[1]
    else:
        meta_model = build_model(user, spec, training.seed, everything_on_meta=True)
    case = CheckCase(layout, spec, training, user, example, input_count(meta_model, len(example)), loss_fn, cancel)
    if layout.tp_enabled:
        check_tp([meta_model], layout)
    traced = None
    if uses_graph(layout):
        case.checkpoint()
        with _failing_as("Tracing the model"):
            try:
                traced = trace_for_plan(
                    user, spec, layout, training.seed, example, device_type=device_type, meta_model=meta_model,
                    ahead=ready.traced if ready is not None else None, repeats=True,
                )
            except AsWritten:
                traced = None  # the run takes the model as written (its head attributes divided by tp)
    if traced is None:
        small = sum(p.numel() for p in meta_model.parameters()) <= SMALL
        if layout.tp_enabled and not small:
            # A large model under TP: the run runs tp rank 0's shard (checkpointed as the run checkpoints it), and
            # no data-parallel wrapping is checked at this size (_run_data_parallel), so the shard's run is the
            # check. The model as written runs only where the shard fails: a model that fails as written raises
            # its own error (the plan cannot run), else the layout is refused (a runner-up may run).
            try:
                _run_tp_shard(case, small=False)
            except RefusedLayout:
                _run_model(case, meta_model)
                raise
            return "module"
        fails = not small and prepared is not None and prepared.fails_for(spec, training.seed)
        outside = _run_model(case, meta_model, fails)
        if layout.tp_enabled:
            _run_tp_shard(case, small=small)
        case.checkpoint()
        _run_data_parallel(case, outside, meta_model)
        return "module"
    gm, values, method = traced
    refused: RefusedLayout | None = None
    if layout.tp_enabled:
        # The stages as the run shards them. Where that runs, so do the stages as written (the same code, each
        # op on a shard); where it fails, the stages as written tell a failing model (raised at once) from a
        # layout the model cannot take (the next runner-up may run).
        # (Zero-bubble's split backward is checked on the stages as written, below.)
        # Zero-bubble's stages as written take a copy of the graph made before the TP rewrite changes it.
        clean = GraphCopy(traced) if layout.schedule == "zero-bubble" and method in ("fx", "fx-meta") else None
        try:
            ran = _run_tp_stages(case, gm, values, meta_model)
        except RefusedLayout as e:
            refused, ran = e, False
        if ran and layout.schedule != "zero-bubble":
            return method
        # The shard changed the model, and the TP rewrite the graph: the stages as written start afresh (rarely:
        # a refused layout, or zero-bubble's split backward), on the model built again and its graph as traced.
        meta_model = build_model(user, spec, training.seed, everything_on_meta=True)
        if clean is not None:
            gm, values, method = clean.over(meta_model, frozenset(layout.experts))
        else:
            with _failing_as("Tracing the model"):
                gm, values, method = trace_for_plan(
                    user, spec, layout, training.seed, example, device_type=device_type, meta_model=meta_model,
                    repeats=True,
                )
    with _failing_as("Tracing the model"):
        pieces = cut_into_pieces(gm, values, layout)
    case.checkpoint()
    _copy_tied(layout, gm, pieces, meta_model)
    with MetaMemo():  # each distinct op runs its meta kernel once: repeated blocks cost one
        stage_inputs = _run_stages(case, gm, pieces, meta_model)
    if refused is not None:
        raise refused
    if layout.schedule == "zero-bubble":
        try:
            with MetaMemo():  # as the stages' run: a repeated op's meta kernel runs once
                _split_backward(case, gm, pieces, meta_model, stage_inputs)
        except RunError as e:
            raise RefusedLayout(str(e)) from e
    return method


def warm_up(tp: bool = False) -> None:
    """Do ahead what the first check in a process pays once, whatever the plan: import torch's symbolic shapes
    (sympy: the meta kernels' dtype rules import it) and run a small forward, loss and backward on meta (the
    meta kernels' first calls); with `tp`, also import the TP runtime (DTensor, the fake process group) and
    run the block sharded for tp 2 (DTensor's sharding rules), which only a plan with tp > 1 needs. The check
    worker (planner.codegen.worker) calls it while the search runs; it changes no state that a check reads."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401 - imported by the first meta kernel otherwise

    meta_without_dynamo()
    with MetaMemo():
        block = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to("meta")
        x = torch.empty(2, 4, 8, device="meta", requires_grad=True)
        block(x).float().softmax(-1).sum().backward()
    if not tp:
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from . import parallel  # noqa: F401 - the run's TP code, which the check imports for a TP plan

    with _fake_tp_mesh(2) as mesh:
        if mesh is None:
            return
        parallelize_module(block, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
        block(torch.empty(2, 4, 8, device="meta")).sum().backward()


def _copy_tied(layout: Layout, gm: fx.GraphModule, pieces: list[Piece], meta_model: nn.Module) -> None:
    """On every pp rank where two stages use one tied weight, give the later ones their copies as the run
    does (tied.own_copies), on meta stages built from the model as the run builds its own."""
    shared = shared_weights(gm, pieces)
    meta = torch.device("meta")
    for rank in range(layout.pp):
        local = layout.stages_on(rank)
        if not any(len([s for s in users if s in local]) > 1 for users in shared.values()):
            continue
        stages = []
        for i in local:
            mine = [p for p in pieces if p.stage == i]
            graphs = []
            for p in mine:
                graphs.append(fx.GraphModule(piece_attrs(p, meta_model, gm, meta), p.graph))
            stages.append(StageModule(graphs, [p.owner for p in mine]))
        from .tied import own_copies  # imports DTensor (its gradient sum): only where a rank holds two users

        with _failing_as(f"Giving the stages of pp rank {rank} their copies of the tied weights"):
            own_copies(shared, meta_model, stages, local)


def _stage_label(i: int, modules: Sequence[str]) -> str:
    """How errors name a stage: its index and first modules."""
    return f"Stage {i} ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''})"


def _run_stages(
    case: CheckCase,
    gm: fx.GraphModule,
    pieces: list[Piece],
    meta_model: nn.Module,
    prepare: Callable[[StageModule], None] | None = None,
    label: str = "",
) -> list[Any]:
    """Forward of one micro-batch stage by stage on meta, as the pipeline's stages would run it (each stage
    checkpointed as planned), then the loss and backward; returns what each stage received. ``prepare``: applied
    to each piece before its checkpointing, as parallelize() applies TP first (``label`` then says so in
    errors)."""
    layout, example = case.layout, case.example
    meta = torch.device("meta")
    values: Any = tuple(t.to(meta) for t in example[: case.n_inputs])
    stage_inputs: list[Any] = []  # what each stage received (zero-bubble's split backward is checked below)
    # A piece (one module's run of nodes) whose graph and modules are those of an earlier piece, given inputs
    # of the same shapes, computes outputs of the same shapes on meta: it reuses that piece's outputs (so the
    # backward runs through the earlier one) instead of running again. 96 identical blocks run one block.
    outputs: dict[Any, Any] = {}
    for i, stage in enumerate(layout.stages):
        case.checkpoint()
        mine = [p for p in pieces if p.stage == i]
        what = _stage_label(i, stage.modules) + label
        stage_inputs.append(values)
        with _failing_as(what):
            for p in mine:  # in order, each taking what the one before returns: what StageModule.forward does
                attrs = piece_attrs(p, meta_model, gm, meta)
                key = (piece_key(p.graph, p.owner, attrs), value_key(values))
                if key not in outputs:
                    # A piece that runs is built as the run builds its stage's pieces, and checkpointed as planned.
                    piece = StageModule([fx.GraphModule(attrs, p.graph)], [p.owner])
                    if prepare is not None:
                        prepare(piece)
                    with_recompute(piece, stage.recompute, layout.schedule, stage.full)
                    outputs[key] = piece(*values)
                values = outputs[key]
        if i < len(layout.stages) - 1 and not (
            isinstance(values, tuple) and all(isinstance(v, torch.Tensor) for v in values)
        ):
            raise RefusedLayout(
                f"{what} would send {type(values).__name__} to the next stage; a pipeline sends tensors."
            )
    inputs = tuple(t.to(meta) for t in example)
    with _failing_as(f"The loss ({case.spec.loss_fn or 'default_loss'}) on the last stage's output{label}"):
        with loss_context(layout):
            loss = with_structure(case.loss_fn, pieces[-1].out_spec)(values, *inputs)
            _check_loss(loss)
            loss.backward()
    return stage_inputs


def _split_backward(
    case: CheckCase, gm: fx.GraphModule, pieces: list[Piece], meta_model: nn.Module, stage_inputs: list[Any]
) -> None:
    """Zero-bubble splits each stage's backward (but the first's) in two: the input gradients first, then, later,
    the weight gradients, one autograd call per group of weights. Where two groups share saved tensors (T5's
    relative position bias, computed once and used by every attention layer of the stage), the first call
    frees them and the second fails at the first step on the cluster. Each distinct stage is run here through
    torch's own two calls (torch.distributed.pipelining._backward), on detached inputs as a pipeline stage
    gets them: a stage that cannot be split is a refused layout (another schedule runs it)."""
    stage_backward_input, stage_backward_weight = _split_backward_functions()
    layout = case.layout
    meta = torch.device("meta")
    last = len(layout.stages) - 1
    seen: set[Any] = set()
    for i, stage in enumerate(layout.stages):
        case.checkpoint()
        if i == 0:
            continue  # the first stage runs one full backward (torch: its inputs need no gradient)
        mine = [p for p in pieces if p.stage == i]
        graphs, keys = [], []
        for p in mine:
            attrs = piece_attrs(p, meta_model, gm, meta)
            keys.append(piece_key(p.graph, p.owner, attrs))
            graphs.append(fx.GraphModule(attrs, p.graph))
        key = (tuple(keys), value_key(stage_inputs[i]), i == last)
        if key in seen:
            continue
        seen.add(key)
        what = _stage_label(i, stage.modules)
        with _failing_as(f"{what}, its backward split as zero-bubble splits it (input, then weight gradients)"):
            module = StageModule(graphs, [p.owner for p in mine], sends=i < last, receives=True, copy_views=True)
            with_recompute(module, stage.recompute, layout.schedule, stage.full)
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            for _, param in named:
                param.grad = None
            outputs, grads, args = _stage_run(case, module, stage_inputs[i], i == last, pieces)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            try:
                _, groups = stage_backward_input(outputs, grads, tensors, module.parameters())
                stage_backward_weight(module.parameters(), groups)
            except RuntimeError as e:  # torch wraps the input step's error in one that lists the tensors
                cause = e.__cause__
                raise (cause if isinstance(cause, Exception) else e) from None
            # A weight that no stage input reaches (T5's decoder embedding of token ids in a later stage) can be
            # in no group of the weight step: T5 pp2 x dp2 then ended its step with that weight's gradient
            # missing on one rank, and the tied-weight sum waited for it. Refused where torch's two calls leave a
            # weight the stage's output reaches without a gradient. (BART's decoder embedding gets its gradient
            # in that layout on the cluster though it does not here: a refusal that a runner-up replaces.)
            missing = [(n, p) for n, p in named if p.grad is None]
            if missing:
                outputs, grads, _ = _stage_run(case, module, stage_inputs[i], i == last, pieces)
                reach = torch.autograd.grad(outputs, [p for _, p in missing], grads, allow_unused=True)
                lost = [n.split(".", 2)[-1] for (n, _), g in zip(missing, reach, strict=True) if g is not None]
                if lost:
                    raise RunError(
                        f"{what}: zero-bubble's weight step would compute no gradient for {', '.join(lost[:3])} "
                        "(torch's split backward finds a stage's weights from its inputs, and no input of this "
                        "stage reaches them: an embedding of token ids inside a later stage). Re-plan with "
                        "another schedule or stage split."
                    )


def _split_backward_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's stage_backward_input and stage_backward_weight (torch/distributed/pipelining/_backward.py), the
    functions zero-bubble's schedule calls. Importing them through their package runs its __init__, which
    imports the schedules and with them torch._dynamo (0.4 s); where that has not happened, the module's own
    file (and the one it imports, _debug.py) is run under a private package name instead: the same code."""
    import importlib
    import importlib.util
    import sys

    import torch.distributed

    if "torch.distributed.pipelining" in sys.modules:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        return stage_backward_input, stage_backward_weight
    name = "_planner_torch_pipelining"
    if name not in sys.modules:
        folder = Path(torch.distributed.__file__).parent / "pipelining"
        spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        assert spec is not None
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    backward = importlib.import_module(f"{name}._backward")
    return backward.stage_backward_input, backward.stage_backward_weight


def _stage_run(
    case: CheckCase, module: StageModule, received: Any, is_last: bool, pieces: list[Piece]
) -> tuple[Any, list[torch.Tensor] | None, tuple[Any, ...]]:
    """A pipeline stage's forward on meta, on detached inputs as it receives them: its outputs that need a
    gradient (the loss, on the last stage), their gradients (none for the loss) and its inputs."""
    args = tuple(
        v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v for v in received
    )
    out = module(*args)
    if is_last:
        inputs = tuple(t.to("meta") for t in case.example)
        return (with_structure(case.loss_fn, pieces[-1].out_spec)(out, *inputs),), None, args
    outputs = tuple(t for t in out if isinstance(t, torch.Tensor) and t.requires_grad)
    return outputs, [torch.ones_like(t) for t in outputs], args


def with_recompute(
    stage: ModelStage | StageModule, recompute: str, schedule: str, full: tuple[str, ...] = ()
) -> None:
    """Checkpoint the stage's units as the run does (recompute.apply_ac; `full`: the modules recomputed fully
    whatever `recompute`), so that a model that breaks under activation checkpointing fails here, not on the
    cluster."""
    if recompute != "none" or full:
        what = f"{recompute}, {len(full)} module(s) fully" if full else recompute
        with _failing_as(f"Activation checkpointing ({what})"):
            apply_ac(stage, recompute, schedule, full)


def _relative(name: str, owner: str | None) -> str:
    """`name` relative to the piece's owner module (blocks.7.attn.qkv in blocks.7: @.attn.qkv)."""
    if owner is not None and (name == owner or name.startswith(owner + ".")):
        return "@" + name[len(owner) :]
    if name.startswith(SP_MODULE_PREFIX) and name[len(SP_MODULE_PREFIX) :].isdigit():
        return SP_MODULE_PREFIX  # a sequence-parallel conversion: which one is told by what it is (_describe)
    return name


def piece_key(graph: fx.Graph, owner: str | None, attrs: dict[str, Any]) -> tuple[Any, ...]:
    """A piece's graph up to its owner's name: ops, targets relative to the owner, arguments (other nodes by
    position), and what each module or attribute it fetches is. Two pieces with the same key and inputs of
    the same shapes compute the same shapes."""
    index = {n: k for k, n in enumerate(graph.nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        return (type(a), repr(a))

    nodes = []
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            target: Any = (_relative(str(n.target), owner), describe(attrs[n.target]))
        elif n.op in ("placeholder", "output"):
            target = n.op  # a placeholder's name is the value's, which differs from stage to stage
        else:
            target = n.target if isinstance(n.target, str) else (getattr(n.target, "__module__", None), n.target)
        nodes.append((n.op, target, arg(n.args), arg(n.kwargs)))
    return tuple(nodes)


def value_key(values: Any) -> Any:
    """The shapes, dtypes, strides and structure of a stage's inputs."""
    if isinstance(values, torch.Tensor):
        return ("tensor", tuple(values.shape), tuple(values.stride()), values.dtype, values.requires_grad)
    if isinstance(values, (tuple, list)):
        return (type(values).__name__, tuple(value_key(v) for v in values))
    return (type(values), repr(values))


def _run_model(case: CheckCase, meta_model: nn.Module, fails_on_meta: bool = False) -> list[str]:
    """Forward, loss and backward of the model as written: on meta, or on the CPU for a small model that the
    meta device cannot run (data-dependent code). Its units are checkpointed as the run checkpoints them. Returns
    the names of its units whose weights the forward reads outside their own forward (`unit_reads`), which the
    run leaves to the stage's FSDP unit. `fails_on_meta`: the model, above SMALL, is known to fail on meta
    (`Prepared.probe_meta`): it runs on fake tensors at once, and where that fails too, as if not known, on a
    model built again (the meta run's error is the one reported)."""
    layout, training = case.layout, case.training
    recompute, full = layout.stages[0].recompute, layout.stages[0].full
    stage = ModelStage(meta_model, list(layout.stages[0].modules))
    with_recompute(stage, recompute, layout.schedule, full)
    if fails_on_meta:
        outside = _runs_on_fake_tensors(case, stage)
        if outside is not None:
            return outside
        return _run_model(case, build_model(case.user, case.spec, training.seed, everything_on_meta=True))
    try:
        # Each distinct op runs its meta kernel once, each distinct block once: repeated blocks cost one.
        with MetaMemo(), blocks_once(stage):
            return _unit_names(meta_model, stage, case.loss_backward(
                meta_model, tuple(t.to("meta") for t in case.example), units=stage.units()
            ))
    except RunError:
        raise
    except Exception as e:  # noqa: BLE001 - retried for real below when small enough
        if sum(p.numel() for p in meta_model.parameters()) > SMALL:
            outside = _runs_on_fake_tensors(case, stage)
            if outside is not None:
                return outside
            first = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
            raise RunError(
                f"The model ({type(meta_model).__name__}) with its loss fails on the meta device "
                f"({type(e).__name__}: {first}), where the planner checks large models. Make forward() free "
                "of data-dependent Python (.item(), branches on values), or fix the model file."
            ) from e
    model = build_model(case.user, case.spec, training.seed, everything_on_meta=False)
    materialise(model, {n for n, _ in model.named_modules()}, torch.device("cpu"), training.seed)
    stage = ModelStage(model, list(layout.stages[0].modules))
    with_recompute(stage, recompute, layout.schedule, full)
    with _failing_as(f"The model ({type(model).__name__}) with its loss"):
        return _unit_names(model, stage, case.loss_backward(model, case.example, units=stage.units()))


def _unit_names(model: nn.Module, stage: ModelStage, indices: set[int]) -> list[str]:
    """The module names in `model` of the stage's units at `indices`, in the units' order."""
    names = {id(m): n for n, m in model.named_modules()}
    units = stage.units()
    return [names[id(units[i])] for i in sorted(indices)]


@contextlib.contextmanager
def _fake_tp_mesh(tp: int) -> Iterator[Any]:
    """A DeviceMesh of `tp` ranks over torch's "fake" process group (collectives do nothing; torchtitan's dry
    runs use it), this process rank 0; None inside someone's process group (left alone: the check then runs
    the TP rules only). The group is destroyed afterwards, pass or fail."""
    with _fake_mesh((tp,), ("tp",)) as mesh:
        yield mesh


@contextlib.contextmanager
def _fake_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[Any]:
    """`_fake_tp_mesh` for any mesh shape and dimension names."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield None
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        with dtensor_on_meta():  # DTensor's shape propagation on meta: no torch._dynamo import (meta.py)
            yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def _run_data_parallel(case: CheckCase, outside: list[str], meta_model: nn.Module) -> None:
    """Forward, loss and backward of the model as written, wrapped as the run wraps it: the run's own
    parallelize() (TP, activation checkpointing, then FSDP2's fully_shard per unit and for the stage, or
    replicate for ZeRO 0) over a fake process group of rank 0's mesh, on fake CPU tensors, so that what fails
    only once the model is wrapped fails here with the error the launch would hit: a refused layout (another
    ZeRO stage may run). Those failures come from weights FSDP cannot keep in their unit: a scalar (0-dim)
    parameter, which FSDP cannot shard (CLIP's logit_scale: the run keeps it whole, `replicated_scalars`), and,
    under ZeRO 1-3, a unit's weight the model reads outside the unit's forward (`outside`, found by the plain
    run), where ZeRO-3 has freed it (Whisper's token embedding, read again as its logits' matrix: the run leaves
    such units to the stage's unit, `unit_reads`). A model with neither runs wrapped as it runs
    plain, and is not wrapped here: planning imports neither FSDP nor torch._dynamo (tests/test_speed_imports).
    Where the model as written does not run on fake tensors either, this check cannot tell, and says nothing.
    Models above SMALL parameters are not wrapped (the cost), nor are layouts with expert or context
    parallelism, which the run sets up around parallelize()."""
    layout, training = case.layout, case.training
    if layout.ep_enabled or layout.cp_enabled:
        return
    if layout.zero_stage == 0:
        outside = []  # replicate wraps the stage alone
    if not outside and not any(p.dim() == 0 for p in meta_model.parameters()):
        return
    if sum(p.numel() for p in meta_model.parameters()) > SMALL:
        # FSDP on fake tensors at full size costs 20 s and more (Whisper large-v3); the wrapping decisions are
        # the run's own, and the run of a small model of the same code is what this check adds.
        return
    modules = list(layout.stages[0].modules)
    model = build_model(case.user, case.spec, training.seed, everything_on_meta=True)
    stage = ModelStage(model, modules)
    stage.read_outside = outside
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .parallel import parallelize

    layout = dataclasses.replace(layout, async_tp=False)  # compiled CUDA kernels: nothing to check on the CPU
    zero = f"ZeRO-{layout.zero_stage}" if layout.zero_stage else "ZeRO 0, replicate"
    what = f"The model wrapped for data parallelism as the script wraps it (dp {layout.dp}, {zero})"
    with _fake_mesh((1, layout.dp, layout.tp), ("pp", "dp", "tp")) as mesh:
        if mesh is None:
            return
        try:
            try:
                parallelize(
                    stage, mesh, layout, layout.stages[0].recompute, torch.device("cpu"), {}, training.dtype,
                    full=layout.stages[0].full,
                )
                with _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
                    # (FSDP2's advice on a unit returning a view: the run warns of it, a plan is no place for it)
                    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
                    stage.to_empty(device="cpu")
                    with blocks_once(stage):  # each distinct block runs once (and FSDP gathers it once)
                        case.loss_backward(stage, case.example)
            except RunError:
                raise
            except Exception as e:  # noqa: BLE001 - a failing model, or a wrapping the model cannot take
                unwrapped = build_model(case.user, case.spec, training.seed, everything_on_meta=True)
                if _runs_on_fake_tensors(case, ModelStage(unwrapped, modules)) is None:
                    return  # the model as written fails on fake tensors too: this check cannot tell
                raise _run_error(what, e) from e
        except RunError as e:
            raise RefusedLayout(str(e)) from e


def _run_tp_stages(case: CheckCase, gm: fx.GraphModule, values: dict[fx.Node, Any], model: nn.Module) -> bool:
    """The pipeline's stages as tp rank 0 runs them: the graph rewritten for sequence parallelism where the
    plan has it, cut again, each piece of the meta `model` (changed: its modules are sharded) sharded by the
    run's apply_tp over a fake process group, then forward, loss and backward on meta (each distinct piece
    once). A rewrite or shard that cannot run is a refused layout, with the error the launch would hit.
    Returns False where it does not run (inside someone's process group, where the TP rules are checked)."""
    from .parallel import apply_tp, sequence_parallel, with_tied_styles

    layout = case.layout
    with _fake_tp_mesh(layout.tp) as mesh:
        if mesh is None:
            return False
        try:
            with _failing_as(f"Tensor parallelism for tp {layout.tp}"):
                layout = with_tied_styles(layout, gm)
                localise_tp_sizes(gm, values, layout.tp_plan.styles, layout.tp, layout.tp_plan.fused)
            with _failing_as(f"Sequence parallelism for tp {layout.tp}"):
                sp_styles = sequence_parallel(gm, values, case.example, mesh, layout) if layout.sp_enabled else {}
                case.checkpoint()
                pieces = cut_into_pieces(gm, values, layout)
            _copy_tied(layout, gm, pieces, model)  # before the shard, as the run copies tied weights first
            _run_stages(
                dataclasses.replace(case, layout=layout), gm, pieces, model,
                prepare=lambda piece: apply_tp(piece, mesh, layout, sp_styles),
                label=f", sharded for tp {layout.tp} (rank 0's shard, TP_PLAN applied)",
            )
        except RunError as e:
            raise RefusedLayout(str(e)) from e
    return True


def _run_tp_shard(case: CheckCase, small: bool) -> None:
    """Forward, loss and backward of tp rank 0's shard of the model as written: the run's own apply_tp
    (parallelize_module, fused chunks, head attributes, Conv1D) over a fake process group of tp ranks.
    Shapes that the sharding leaves inconsistent (a projection sliced at fixed offsets, a head count that
    does not follow) fail here with the error the run would hit at launch. It runs on fake meta tensors in
    the run's compute dtype, as the large-model check does; a `small` model (at most SMALL parameters) that
    fails there (code whose meta path differs from the CPU's, as transformers' grouped-mm experts) runs its
    shard on the CPU instead."""
    what = f"The model sharded for tp {case.layout.tp} (rank 0's shard, TP_PLAN applied)"
    with _fake_tp_mesh(case.layout.tp) as mesh:
        if mesh is None:
            return
        try:
            try:
                _tp_shard_step(case, mesh, on_cpu=False)
            except RunError:
                raise
            except Exception as e:  # noqa: BLE001 - retried on the CPU below when small enough
                if not small:
                    raise _run_error(what, e) from e
                with _failing_as(what):
                    _tp_shard_step(case, mesh, on_cpu=True)
        except RunError as e:
            raise RefusedLayout(str(e)) from e


def _tp_shard_step(case: CheckCase, mesh: Any, on_cpu: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .parallel import apply_tp

    layout, training = case.layout, case.training
    model = build_model(case.user, case.spec, training.seed, everything_on_meta=not on_cpu)
    if on_cpu:
        materialise(model, {n for n, _ in model.named_modules()}, torch.device("cpu"), training.seed)
    stage = ModelStage(model, list(layout.stages[0].modules))
    if on_cpu:
        apply_tp(stage, mesh, layout, {})
        case.loss_backward(model, case.example)
        return
    # On fake tensors each kind of block runs once (blocks_once): only the first of each kind is sharded, the
    # others never run (parallelize_module of Llama-3-70B's 560 projections took 0.3 s of the check)
    kinds = unit_kinds(stage)
    apply_tp(stage, mesh, layout, {}, skip=repeated_units(stage, kinds))
    # then activation checkpointing, as the run's parallelize() does (checkpointed in place: the units keep ids)
    with_recompute(stage, layout.stages[0].recompute, layout.schedule, layout.stages[0].full)
    compute_dtype = COMPUTE_DTYPES.get(training.dtype)
    if compute_dtype is not None:
        _cast_parameters(model, compute_dtype)
    with _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True), blocks_once(stage, kinds):
        case.loss_backward(model, tuple(t.to("meta") for t in case.example), compute_dtype)


def _uncached(mode: Any) -> Any:
    """`mode` (a FakeTensorMode) without torch's cache of fake op results. Under MetaMemo (the check's own memo,
    which answers a repeated op before the fake mode sees it), and with each distinct block run once, a check
    meets few ops twice: the cache's entries cost more to make than its hits save (DeepSeek-V3's first check
    0.69 -> 0.52 s, Whisper's 0.50 -> 0.42 s), and a check's run is new shapes to it (another micro-batch, another
    model). The results are the same (the cache only stores what the op computes)."""
    mode.cache_enabled = False
    return mode


def _runs_on_fake_tensors(case: CheckCase, stage: ModelStage) -> list[str] | None:
    """Whether forward, loss and backward run under FakeTensorMode (None where not; else the units read outside
    their forward, as `_run_model` returns them): a large model whose forward branches on
    values where it sees real tensors but skips that branch while tracing (Hugging Face's packed-sequence
    check calls .item() unless `is_tracing`) fails on plain meta tensors yet runs on the cluster. Fake tensors
    are what torch.export traces with, so this is the meta run with the model's own tracing paths.

    The run's compute dtype (bf16/fp16 on GPUs, COMPUTE_DTYPES): the parameters are cast to it first, as the
    run's mixed precision casts them (FSDP2's param_dtype; buffers stay fp32). The meta device takes a model's
    GPU paths, and some exist only in that dtype (torch._grouped_mm, which transformers' MoE experts call,
    takes bf16 alone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta_model = stage.model
    compute_dtype = COMPUTE_DTYPES.get(case.training.dtype)
    if compute_dtype is not None:
        _cast_parameters(meta_model, compute_dtype)
    try:
        with _quiet_fake_tensors(), _uncached(FakeTensorMode(allow_non_fake_inputs=True)), MetaMemo(), blocks_once(
            stage
        ):
            found = case.loss_backward(
                meta_model, tuple(t.to("meta") for t in case.example), compute_dtype, units=stage.units()
            )
    except RunError:
        raise
    except Exception:  # noqa: BLE001 - the meta run's error is the one reported
        return None
    finally:
        meta_model.zero_grad(set_to_none=True)  # no fake gradients left on the meta model
    return _unit_names(meta_model, stage, found)


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """FakeTensorMode logs each failing kernel with a traceback; the check reports the error itself."""
    import logging

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quiet.setLevel(level)


# The dtype a GPU run computes in (runtime.parallel.apply_data_parallel's param_dtype), by Training.dtype.
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace the model's floating-point parameters by copies in `dtype` (a weight shared by two modules
    stays one parameter); buffers keep their dtype, as under FSDP2's mixed precision."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = cast[id(p)]


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise RunError(
            f"The loss must be a floating-point scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + ": return one number per micro-batch from loss_fn."
        )
