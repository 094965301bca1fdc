"""The cost report of a model on a cluster, without writing anything (plan's search, no files).

Usage:
    planner dry-run --help

    # What would the planner choose for GPT-3 175B on 16 DGX H100 nodes?
    planner dry-run sample_models/gpt.py -a preset=gpt3-175b --gpu dgx-h100 --nodes 16 --global-batch-size 1536

    # The cost of one fixed configuration
    planner dry-run sample_models/gpt.py --gpu cpu --gpus-per-node 4 --global-batch-size 8 --dp 2 --pp 2 \
        --schedule gpipe --micro-batch-size 1
"""

from __future__ import annotations

import sys

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
    GlobalBatchOpt,
    GpuOpt,
    GpusPerNodeOpt,
    HfConfigOpt,
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
    TopKOpt,
    TpOpt,
    VirtualStagesOpt,
    ZeroStageOpt,
    is_quiet,
    plan_request,
    stdout_console,
)
from planner.cli.plan import run_search

DRY_RUN_EXAMPLES = [
    "planner dry-run sample_models/gpt.py -a preset=gpt3-175b --gpu dgx-h100 --nodes 16 --global-batch-size 1536",
    "planner dry-run sample_models/gpt.py --gpu cpu --gpus-per-node 4 --global-batch-size 8 --dp 2 --pp 2",
]


def dry_run(
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
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Print the cost report of the best layout (or of the pinned one) without writing any file.

    Takes the options of `planner plan` except the output ones; --json prints the plan document that
    `planner plan` would write. Pin every dimension to cost a single configuration.
    """
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
    result_plan, graph, _ = run_search(request, show_progress=not quiet)
    if json:
        sys.stdout.write(result_plan.to_json())
    elif not quiet:
        from planner.report.tables import plan_report

        console = stdout_console()
        console.print(plan_report(result_plan, graph.total_params, width=console.width))
