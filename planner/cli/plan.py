"""Plan a model for a cluster: search the parallel layout, write plan.json, a timeline and the scripts.

Usage:
    planner plan --help

    # The default tiny GPT on 4 local CPU processes
    planner plan sample_models/gpt.py --gpu cpu --gpus-per-node 4 --global-batch-size 8

    # GPT-3 175B on 16 DGX H100 nodes, pipeline schedule fixed
    planner plan sample_models/gpt.py -a preset=gpt3-175b --gpu dgx-h100 --nodes 16 \
        --global-batch-size 1536 --schedule interleaved-1f1b --out gpt3_plan

    # Machine-readable output (the files are still written)
    planner plan sample_models/llama.py -a preset=llama3-8b --gpu h100 --nodes 2 --global-batch-size 256 --json
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from planner.cli._options import (
    AsyncTpOpt,
    BuildFnOpt,
    ConfigOpt,
    CpOpt,
    DataOpt,
    DpOpt,
    DType,
    DTypeOpt,
    EpOpt,
    FlavorOpt,
    ForceOpt,
    GlobalBatchOpt,
    GpuOpt,
    GpusPerNodeOpt,
    HfConfigOpt,
    InitFromOpt,
    InputsFnOpt,
    JsonOpt,
    LossFnOpt,
    LrOpt,
    MeasureOpt,
    MemoryReserveOpt,
    MicroBatchOpt,
    ModelArgOpt,
    ModelFileArg,
    NodesOpt,
    NoOverlapOpt,
    OutOpt,
    PpOpt,
    QuietOpt,
    RecomputeBlocksOpt,
    RecomputeOpt,
    RevisionOpt,
    ScheduleOpt,
    SeedOpt,
    SequenceParallelOpt,
    StepsOpt,
    TimeLimitOpt,
    TimestampOpt,
    TopKOpt,
    TpOpt,
    VirtualStagesOpt,
    ZeroStageOpt,
    compiled_source_files,
    is_quiet,
    plan_request,
    stderr_console,
    stdout_console,
)
from planner.cli.emit import PLAN_FILE, Files, write_outputs

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from contextlib import AbstractContextManager

    from planner.codegen.worker import CheckWorker
    from planner.hardware.spec import ClusterSpec
    from planner.model.graph import ModelGraph, ModelSource
    from planner.model.load import LoadedModel
    from planner.model.reads import Reads
    from planner.pipeline import PlanRequest
    from planner.plan import Plan
    from planner.search.search import SearchResult

PLAN_EXAMPLES = [
    "planner plan sample_models/gpt.py --gpu cpu --gpus-per-node 4 --global-batch-size 8",
    "planner plan sample_models/gpt.py -a preset=gpt3-175b --gpu dgx-h100 --nodes 16 --global-batch-size 1536",
    "planner plan sample_models/gpt.py --gpu a100-sxm4-80gb --nodes 2 --global-batch-size 64 --tp 4 --pp 2",
]

log = logging.getLogger(__name__)

TIMELINE_FILE = "timeline.svg"
TRACE_FILE = "timeline.trace.json"  # the same iteration for Perfetto / chrome://tracing

LoadTimeoutOpt = Annotated[
    float,
    typer.Option(
        min=0.0, rich_help_panel="Model",
        help="Seconds that importing, building and tracing the model file may take before it is stopped as a "
        "hang; 0 for no limit.",
    ),
]


def plan(
    ctx: typer.Context,
    model_file: ModelFileArg,
    gpu: GpuOpt,
    global_batch_size: GlobalBatchOpt,
    model_arg: ModelArgOpt = None,
    config: ConfigOpt = None,
    hf_config: HfConfigOpt = None,
    revision: RevisionOpt = None,
    flavor: FlavorOpt = None,
    nodes: NodesOpt = 1,
    gpus_per_node: GpusPerNodeOpt = None,
    memory_reserve: MemoryReserveOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    dp: DpOpt = None,
    ep: EpOpt = None,
    cp: CpOpt = None,
    virtual_stages: VirtualStagesOpt = None,
    micro_batch_size: MicroBatchOpt = None,
    schedule: ScheduleOpt = None,
    zero_stage: ZeroStageOpt = None,
    recompute: RecomputeOpt = None,
    recompute_blocks: RecomputeBlocksOpt = None,
    sequence_parallel: SequenceParallelOpt = None,
    async_tp: AsyncTpOpt = None,
    dtype: DTypeOpt = DType.bf16,
    build_fn: BuildFnOpt = "build_model",
    inputs_fn: InputsFnOpt = "example_inputs",
    loss_fn: LossFnOpt = None,
    data: DataOpt = None,
    measure: MeasureOpt = None,
    top_k: TopKOpt = 5,
    time_limit: TimeLimitOpt = None,
    no_overlap: NoOverlapOpt = False,
    seed: SeedOpt = 0,
    lr: LrOpt = 1e-4,
    steps: StepsOpt = 10,
    init_from: InitFromOpt = None,
    out: OutOpt = Path("plan_out"),
    force: ForceOpt = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
    timestamp: TimestampOpt = False,
    load_timeout: LoadTimeoutOpt = 300.0,
) -> None:
    """Search the best parallel layout and write it out: plan.json, timeline.svg, train.py and launchers.

    Everything is rendered before the first file is written, each file atomically; the same inputs give
    byte-identical files (unless --timestamp). A different plan.json already in --out is kept unless
    --force. With --json the plan document goes to stdout instead of the report; the files are still
    written.
    """
    check_training_options(lr)
    # Where the files go is settled before any of the model's code runs (it may chdir; planner.model.guard
    # undoes that too).
    out_dir = Path(os.path.abspath(out))
    request = plan_request(
        model_file, model_arg, gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node,
        global_batch_size=global_batch_size, dp=dp, tp=tp, pp=pp, virtual_stages=virtual_stages,
        micro_batch_size=micro_batch_size, schedule=schedule, zero_stage=zero_stage, recompute=recompute,
        sequence_parallel=sequence_parallel, dtype=dtype, build_fn=build_fn, inputs_fn=inputs_fn, loss_fn=loss_fn,
        data=data, measure=measure, memory_reserve=memory_reserve, hf_config=hf_config, flavor=flavor, ep=ep, cp=cp,
        recompute_blocks=recompute_blocks,
        revision=revision, async_tp=async_tp,
        top_k=top_k, time_limit=time_limit, no_overlap=no_overlap, seed=seed, lr=lr, steps=steps,
    )
    quiet = is_quiet(ctx, quiet)
    worker: CheckWorker | None = None

    def start_worker(cluster: ClusterSpec, source: ModelSource) -> Callable[[Plan], None] | None:
        """The check gets ready beside the analysis and the search, and checks the search's bests so far."""
        nonlocal worker
        from planner.codegen.worker import CheckWorker

        pinned_tp = request.pins.get("tp")
        worker = CheckWorker.start(request.model_path, source, request.seed, pinned_tp, cluster.gpu.memory_bytes)
        return worker.ahead if worker is not None else None

    from planner.model.reads import Reads

    reads = Reads()  # what the model's code read: inputs the output set must not replace

    def outputs(result_plan: Plan, result: SearchResult) -> tuple[Plan, dict[str, tuple[str, bool]]]:
        """The plan as written and every file of the output set, rendered in memory."""
        if init_from is not None:
            from planner.codegen.check import with_init_from

            result_plan = with_init_from(result_plan, init_from)
        if timestamp:
            from datetime import datetime, timezone

            created = datetime.now(timezone.utc).isoformat(timespec="seconds")
            result_plan = result_plan.model_copy(update={"created_at": created})
        source_files = compiled_source_files(model_file, request.model_path)
        if source_files:  # hf:/module: sources: the compiled model file travels with the plan
            from planner.model.sources import SOURCE_FILE

            model = result_plan.model.model_copy(update={"path": str(out_dir / SOURCE_FILE)})
            result_plan = result_plan.model_copy(update={"model": model})
        return result_plan, {**source_files, **render_outputs(result_plan, result, reads.files)}

    # The outputs of the plan being checked, rendered while the check worker runs its check: used where that
    # plan passes (a refused plan's are dropped, and a rendering that fails is done again after, to raise).
    ahead: list[tuple[Plan, SearchResult, tuple[Plan, dict[str, tuple[str, bool]]]]] = []

    def rendering_ahead(plan: Plan, result: SearchResult) -> None:
        try:
            ahead[:] = [(plan, result, outputs(plan, result))]
            log.debug("plan-time check: outputs rendered while the worker checks")
        except Exception as e:  # noqa: BLE001 - rendered again once the check is done, where it raises
            log.debug("outputs not rendered during the check (%s: %s)", type(e).__name__, e)
    try:
        result_plan, graph, result = run_search(
            request, show_progress=not quiet, load_timeout=load_timeout, before_analysis=start_worker, reads=reads
        )
        from planner.model.guard import DEFAULT_TIME_LIMIT_S, user_code

        # A plan the script cannot run exits 2 here, before anything is written (or gives way to the next
        # runner-up that runs). The check runs the model's code again, so under the same guard (exits, hangs,
        # prints kept off stdout) as the tracing.
        limit = DEFAULT_TIME_LIMIT_S if load_timeout is None else (load_timeout or None)
        with user_code(request.model_path, "Checking that the plan runs", limit):
            result_plan, result = best_that_runs(request, result_plan, graph, result, worker, rendering_ahead)
    finally:
        if worker is not None:
            worker.close()
    if ahead and ahead[0][0] is result_plan and ahead[0][1] is result:
        result_plan, files = ahead[0][2]
    else:
        result_plan, files = outputs(result_plan, result)
    inputs = [Path(request.model_path), *map(Path, sorted(reads.files))]
    if hf_config is not None:
        inputs += [hf_config, hf_config / "config.json"]
    write_outputs(out_dir, files, force, inputs=inputs)
    if json:
        sys.stdout.write(files[PLAN_FILE][0])
    elif not quiet:
        from planner.report.tables import plan_report

        console = stdout_console()
        console.print(plan_report(result_plan, graph.total_params, out / TIMELINE_FILE, width=console.width))
        console.print(f"Wrote {out / PLAN_FILE}, {TIMELINE_FILE} and the scripts; run {out / 'launch.sh'}.")


def check_training_options(lr: float) -> None:
    """The generated script's optimizer settings, checked now rather than when the job starts on the cluster."""
    import math

    from planner.errors import ConfigError

    if not math.isfinite(lr) or lr <= 0:
        raise ConfigError(
            f"--lr {lr:g} is not a usable learning rate: AdamW needs a finite number above 0 (torch refuses a "
            "negative one, and nan or inf would turn every weight into nan). Pass e.g. --lr 1e-4."
        )


def best_that_runs(
    request: PlanRequest,
    plan: Plan,
    graph: ModelGraph,
    result: SearchResult,
    worker: CheckWorker | None = None,
    meanwhile: Callable[[Plan, SearchResult], None] | None = None,
) -> tuple[Plan, SearchResult]:
    """The best ranked plan that passes the plan-time check. A plan the script cannot run for its layout (a
    TP degree a vocabulary or head count cannot take, a pipeline on a device the traced graph cannot run on)
    gives way to the next runner-up, and is listed under the rejected regions with the check's reason; when
    none of the ranked plans runs, the first failure is raised (exit 2, nothing written), naming how many
    were tried. A failure of the model itself (its loss, its code on the meta device) is raised at once: no
    other layout fixes it. `worker`: the check's process, where one was started (else it runs here);
    `meanwhile`: called with a plan and its search result while the worker checks that plan."""
    from planner.errors import LayoutRefusedError
    from planner.pipeline import without_best

    first: LayoutRefusedError | None = None
    tried = 0
    while True:
        try:
            check_plan(plan, worker, None if meanwhile is None else functools.partial(meanwhile, plan, result))
            return plan, result
        except LayoutRefusedError as e:
            first = first or e
            tried += 1
            reason = "fails the plan-time check: " + str(e).removeprefix("The plan cannot run: ")
            nxt = without_best(request, graph, result, reason)
            if nxt is None:
                if tried > 1:
                    raise LayoutRefusedError(f"{first} (The {tried - 1} runner-up plans fail the check too.)") from None
                raise first from None
            plan, result = nxt


def check_plan(plan: Plan, worker: CheckWorker | None = None, meanwhile: Callable[[], None] | None = None) -> None:
    """The plan-time check, skipped when the same check (this plan, model files, runtime) passed before; run by
    `worker` where it answers, else in this process. `meanwhile`: called once while the worker checks, where
    its answer has not come yet."""
    import hashlib

    import planner.codegen
    from planner.codegen.check import check_plan_runs
    from planner.model.cache import analysis_key, cache_enabled, check_passed, reads_digest, record_check_pass
    from planner.runtime.digest import digest_of, runtime_files

    def run_check() -> None:
        if worker is None or worker.check(plan, meanwhile) is None:
            check_plan_runs(plan)

    analysis = analysis_key(plan.model) if cache_enabled() else None
    reads = reads_digest(analysis, Path(plan.model.path).parent) if analysis is not None else None
    if analysis is None or reads is None:  # no cache, or the files the model's code read are not all known
        run_check()
        return
    codegen = Path(planner.codegen.__file__).parent  # the plan -> layout conversion
    parts = [
        analysis,
        reads,
        digest_of(runtime_files()),
        digest_of({f.name: f.read_bytes() for f in sorted(codegen.glob("*.py"))}),
        plan.model_dump_json(exclude={"created_at"}),
    ]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    if not check_passed(key):
        run_check()
        record_check_pass(key)


def run_search(
    request: PlanRequest,
    show_progress: bool,
    load_timeout: float | None = None,
    before_analysis: Callable[[ClusterSpec, ModelSource], Callable[[Plan], None] | None] | None = None,
    reads: Reads | None = None,
) -> tuple[Plan, ModelGraph, SearchResult]:
    """plan_model with a spinner and a progress bar on stderr when it is a terminal (nothing otherwise).

    Importing, building and tracing the model file (the user's code) run under one guard and one time limit.
    `before_analysis` is called with the cluster and the model's source once the model file is loaded, before
    it is analysed, outside the guard and with no progress display running (it may fork: no other thread
    then); what it returns, where not None, is called with the plan of each best so far during the search
    (plan_model's `ahead`). `reads`, where given, collects the files the model's import read.
    """
    import time

    from planner.hardware.load import load_cluster
    from planner.model.guard import DEFAULT_TIME_LIMIT_S, user_code
    from planner.pipeline import analyse, load_request_model, plan_model

    limit = DEFAULT_TIME_LIMIT_S if load_timeout is None else (load_timeout or None)
    deadline: list[float] = []  # set when the model's code first runs: the planner's own start-up is not its time
    name = Path(request.model_path).name

    def guarded(what: str) -> AbstractContextManager[None]:  # the time left of the one limit
        if limit is not None and not deadline:
            deadline.append(time.monotonic() + limit)
        left = None if limit is None else max(1e-3, deadline[0] - time.monotonic())
        return user_code(request.model_path, what, left)

    def load() -> LoadedModel:
        import torch  # noqa: F401 - before the clock starts: torch's import is not the model's time

        with guarded(f"Loading {name}"):
            return load_request_model(request)

    ahead: Callable[[Plan], None] | None = None

    def loaded(model: LoadedModel) -> LoadedModel:
        nonlocal ahead
        if reads is not None:
            reads.update(model.reads)
        if before_analysis is not None:
            ahead = before_analysis(cluster, model.source)
        return model

    def analysed(model: LoadedModel) -> ModelGraph:
        from planner.model.reads import recording

        with recording(Path(request.model_path).parent) as during, guarded(f"Tracing {name}"):
            graph = analyse(request, model=model)
        if reads is not None:
            reads.update(during)
        return graph

    # A wrong --gpu is reported at once, before the (slower) tracing of the model.
    cluster = load_cluster(request.gpu, request.nodes, request.gpus_per_node)
    console = stderr_console() if show_progress else None  # --quiet: rich is not even imported
    if console is None or not console.is_terminal:
        graph = analysed(loaded(load()))  # (sets `ahead`)
        return plan_model(request, graph, ahead=ahead)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        progress.add_task(f"Loading {name}", total=None)
        model = load()
    model = loaded(model)  # the display's thread has ended: before_analysis may fork
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"Tracing {name}", total=None)
        graph = analysed(model)
        progress.update(task, description="Solving stage partitions (ILP per candidate)")

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return plan_model(request, graph, progress=advance, ahead=ahead)


def render_outputs(
    plan: Plan, result: SearchResult, reads: Iterable[str] = (), model: tuple[str, Files] | None = None
) -> dict[str, tuple[str, bool]]:
    """Every file `planner plan` writes, rendered in memory: {name: (text, executable)}. `reads`: the files the
    model read while planned (copied with it); `model`: a plan folder's copy to carry instead."""
    from planner.codegen.modelcopy import copied_model
    from planner.codegen.render import render
    from planner.report.tables import degrees, stage_labels
    from planner.report.timeline import timeline_svg
    from planner.report.trace import chrome_trace
    from planner.search.search import simulate_evaluated

    c = plan.cluster
    title = f"{plan.model_class} on {c.nodes} x {c.gpus_per_node} {c.gpu}: {degrees(plan.parallel)}"
    files = dict(render(plan, PLAN_FILE, model if model is not None else copied_model(plan.model.path, reads)))
    sim, labels = simulate_evaluated(result.best), stage_labels(plan)
    files[TIMELINE_FILE] = (timeline_svg(sim, title, labels), False)
    files[TRACE_FILE] = (chrome_trace(sim, title, labels), False)
    files[PLAN_FILE] = (plan.to_json(), False)
    return files
