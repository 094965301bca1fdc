"""The planner's data flow in one place: model file -> ModelGraph -> search -> Plan (DESIGN.md).

Each step is a plain function of typed inputs; this module only wires them and turns the search's
result into the Plan schema, with simulated iteration times for the winner and the runners-up.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from planner import __version__
from planner.cost.memory import memory_report
from planner.cost.model import CostOptions, Profile, full_block_units, rank_tail, rank_tail_parts, stages_by_rank
from planner.cost.simulate import SimResult
from planner.cost.terms import comm_reserve_bytes, cp_kv_exchange_time, moe_alltoall_time
from planner.errors import ConfigError, PlannerError
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph, TPPlan
from planner.plan import (
    Alternative,
    ClusterSummary,
    CommBreakdown,
    MemoryBreakdown,
    ParallelConfig,
    Plan,
    Predicted,
    Rejection,
    SearchStats,
    StagePlan,
    TrainingConfig,
)
from planner.runtime.layout import runs_traced_graph
from planner.search.search import Evaluated, SearchResult, region_of, search, simulate_evaluated
from planner.search.space import Pins

if TYPE_CHECKING:
    from planner.model.load import LoadedModel


class PlanRequest(BaseModel):
    """Everything `planner plan` is asked: the model, the cluster, the batch and the pins."""

    model_config = ConfigDict(extra="forbid")

    model_path: str
    model_args: dict[str, Any] = Field(default_factory=dict)
    build_fn: str = "build_model"
    inputs_fn: str = "example_inputs"
    loss_fn: str | None = None
    batch_fn: str | None = Field(None, description="data function in the model file (default get_batch)")
    dtype: str = "bf16"
    gpu: str
    nodes: int = 1
    gpus_per_node: int | None = None
    global_batch_size: int
    pins: dict[str, Any] = Field(default_factory=dict)
    top_k: int = 5
    time_limit: float | None = Field(None, description="seconds per ILP (wall clock: results then depend on load)")
    max_nodes: int | None = Field(5000, description="branch-and-bound nodes per ILP (deterministic); None: no limit")
    overlap_dp_comm: bool = True
    memory_reserve_gib: float | None = Field(None, description="per-GPU memory reserve; None: the spec's")
    measure: bool | None = Field(
        None, description="profile units on the local device; None: when it is a CUDA GPU matching the target"
    )
    seed: int = 0
    lr: float = 1e-4
    steps: int = 10


def inputs_digest(graph: ModelGraph, cluster: ClusterSpec, request: PlanRequest) -> str:
    blob = json.dumps(
        {
            "model": graph.source.model_dump(mode="json", exclude={"path"}),
            "cluster": cluster.model_dump(mode="json"),
            "request": request.model_dump(mode="json", exclude={"model_path"}),
            "planner": __version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def predicted_for(
    ev: Evaluated, graph: ModelGraph, cluster: ClusterSpec, options: CostOptions, global_batch: int
) -> tuple[Predicted, SimResult]:
    """Predicted figures of an evaluated candidate: simulated pipeline time plus the DP/optimizer tail."""
    sim = simulate_evaluated(ev)
    tail = rank_tail(ev.stages, ev.cand, options, cluster, graph.source.dtype)
    iteration = sim.iteration_time + tail
    world = cluster.world_size
    flops = (graph.fwd_flops_per_sample + graph.bwd_flops_per_sample) * global_batch
    per_gpu = flops / iteration / world
    peak = cluster.gpu.peak_flops(graph.source.dtype)
    samples = global_batch / iteration
    tp_comm = sum(s.tp_comm for s in ev.stages) * ev.cand.num_micro_batches / max(1, ev.cand.pp)
    dp_total = max((sum(s.dp_sync for s in ev.stages if s.rank == r) for r in range(ev.cand.pp)), default=0.0)
    nccl = comm_reserve_bytes(cluster.within_reserve().nccl_bytes_per_group, ev.cand)
    predicted = Predicted(
        iteration_time_s=iteration,
        samples_per_s=samples,
        tokens_per_s=samples * graph.tokens_per_sample if graph.tokens_per_sample else None,
        model_tflops_per_gpu=per_gpu / 1e12,
        hardware_tflops_per_gpu=_hardware_flops(ev, graph, global_batch) / iteration / world / 1e12,
        mfu=per_gpu / peak,
        peak_memory_bytes=int(max(ev.rank_memory.values())),
        memory_capacity_bytes=cluster.gpu.memory_bytes,
        # the reserve this plan keeps free: the fixed part and its own process groups' NCCL buffers
        memory_reserve_bytes=cluster.fixed_reserve_bytes + int(nccl),
        attention_backend=cluster.gpu.attention_backend if any(u.uses_flash_attention for u in graph.units) else "none",
        bubble_fraction=sim.bubble_fraction,
        comm=CommBreakdown(
            tensor_parallel_s=tp_comm,
            pipeline_p2p_s=2 * sum(s.p2p for s in ev.stages) * (1 if ev.cand.pp > 1 else 0),
            data_parallel_s=dp_total,
            data_parallel_exposed_s=max(0.0, tail - _optimizer_only(ev, cluster, graph, options)),
            expert_parallel_s=_expert_comm(ev, graph, cluster),
            context_parallel_s=_context_comm(ev, graph, cluster),
        ),
        source="measured" if all(s.source == "measured" for s in ev.stages) else "estimated",
    )
    return predicted, sim


def _expert_comm(ev: Evaluated, graph: ModelGraph, cluster: ClusterSpec) -> float:
    """Seconds per iteration of MoE all-to-all on a pp rank (forward and backward, every micro-batch)."""
    per_mb = sum(
        2.0 * moe_alltoall_time(graph.units[u].moe_dispatch_bytes, ev.cand, cluster)
        for s in ev.stages
        for u in s.units
        if graph.units[u].experts
    )
    return float(per_mb * ev.cand.num_micro_batches / max(1, ev.cand.pp))


def _context_comm(ev: Evaluated, graph: ModelGraph, cluster: ClusterSpec) -> float:
    """Seconds per iteration of context parallelism's key/value exchange on a pp rank (all-gather forward,
    reduce-scatter backward, every micro-batch); 0 without it."""
    if ev.cand.cp <= 1:
        return 0.0
    per_mb = sum(
        2.0 * cp_kv_exchange_time(graph.units[u].sdpa_kv_bytes, ev.cand, cluster) for s in ev.stages for u in s.units
    )
    return float(per_mb * ev.cand.num_micro_batches / max(1, ev.cand.pp))


def _kept_experts(ev: Evaluated, graph: ModelGraph) -> dict[str, int]:
    """The MoE experts modules the script shards (ep > 1) or keeps as module calls in a traced graph (a
    pipeline, or sequence parallelism: the experts then run their own code on the rank's device, not the
    path the model took when traced on meta), with their expert counts; else none."""
    c = ev.cand
    heads = bool(graph.tp.head_attrs)
    if c.ep == 1 and not runs_traced_graph(c.pp, c.tp, c.sequence_parallel, heads):
        return {}
    return {name: n for u in graph.units for name, n in u.experts.items()}


def _optimizer_only(ev: Evaluated, cluster: ClusterSpec, graph: ModelGraph, options: CostOptions) -> float:
    """The slowest rank's optimizer step (the tail without its exposed gradient sync)."""
    return max(
        rank_tail_parts(mine, ev.cand, options, cluster, graph.source.dtype)[1]
        for mine in stages_by_rank(ev.stages, ev.cand.pp)
    )


def _hardware_flops(ev: Evaluated, graph: ModelGraph, global_batch: int) -> float:
    """FLOPs the GPUs execute per iteration, recomputation included (what Megatron-LM reports)."""
    extra = 0.0
    for s in ev.stages:
        full = set(full_block_units(graph, s.units, s.full_blocks)) if s.full_blocks else set()
        for u in s.units:
            unit = graph.units[u]
            if s.recompute == "full" or u in full:
                extra += unit.fwd_flops
            elif s.recompute == "selective" and unit.attention_core_bytes > 0:
                extra += unit.attention_flops
            elif s.recompute == "op":  # all but the kept matmuls and the attention kernels
                extra += max(0.0, unit.fwd_flops - unit.op_sac_kept_matmul_flops - unit.attention_flops)
    return (graph.fwd_flops_per_sample + graph.bwd_flops_per_sample + extra) * global_batch


def _parallel(ev: Evaluated, global_batch: int) -> ParallelConfig:
    c = ev.cand
    return ParallelConfig(
        dp=c.dp,
        tp=c.tp,
        pp=c.pp,
        virtual_stages=c.virtual_stages,
        micro_batch_size=c.micro_batch_size,
        num_micro_batches=c.num_micro_batches,
        global_batch_size=global_batch,
        schedule=c.schedule,
        zero_stage=c.zero_stage,
        sequence_parallel=c.sequence_parallel,
        ep=c.ep,
        cp=c.cp,
        mesh_dims=["pp", "dp", "cp", "tp"] if c.cp > 1 else ["pp", "dp", "tp"],
        tp_overlap=c.tp_overlap,
    )


def build_plan(
    graph: ModelGraph, cluster: ClusterSpec, request: PlanRequest, result: SearchResult, options: CostOptions
) -> Plan:
    best = result.best
    predicted, _ = predicted_for(best, graph, cluster, options, request.global_batch_size)
    stages = []
    for s in best.stages:
        units = [graph.units[u] for u in s.units]
        report = memory_report(s, options)
        mem = MemoryBreakdown(
            weights=int(report.weights),
            gradients=int(report.gradients),
            optimizer=int(report.optimizer),
            activations=int(report.activations),
            comm_buffers=int(report.comm_buffers),
            workspace=int(report.workspace),
        )
        stages.append(
            StagePlan(
                index=s.index,
                pp_rank=s.rank,
                units=[u.name for u in units],
                modules=[m for u in units for m in u.modules],
                recompute=s.recompute,
                recompute_full_blocks=s.full_blocks,
                recompute_full_modules=[
                    m for u in full_block_units(graph, s.units, s.full_blocks) for m in graph.units[u].modules
                ],
                forward_time_s=s.fwd,
                backward_time_s=s.bwd,
                p2p_time_s=s.p2p,
                compute_time_s=s.compute,
                memory_bytes=mem.total,
                memory=mem,
                source=s.source,
            )
        )
    alternatives = []
    for ev in result.ranked[1:]:
        pred, _ = predicted_for(ev, graph, cluster, options, request.global_batch_size)
        slower = pred.iteration_time_s / predicted.iteration_time_s - 1
        alternatives.append(
            Alternative(
                parallel=_parallel(ev, request.global_batch_size),
                recompute=ev.recompute,
                recompute_full_blocks=list(ev.full_blocks),
                predicted=pred,
                note=f"{slower * 100:+.1f}% iteration time vs the chosen plan",
            )
        )
    rejected = [Rejection(region=region, reason=why, count=n) for (region, why), n in sorted(result.rejected.items())]
    src = graph.source
    return Plan(
        planner_version=__version__,
        inputs_digest=inputs_digest(graph, cluster, request),
        model=src,
        model_class=graph.model_class,
        total_params=graph.total_params,
        trace_method=graph.trace_method,
        tokens_per_sample=graph.tokens_per_sample,
        cluster=ClusterSummary(
            name=cluster.name, gpu=cluster.gpu.name, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node
        ),
        parallel=_parallel(best, request.global_batch_size),
        # One sharding decision: what the cost model divided by tp (Unit.tp_*) is what the script shards.
        tp=graph.tp if best.cand.tp > 1 else TPPlan(),
        structure=graph.structure,
        experts=_kept_experts(best, graph),
        source_spec=graph.source_spec,
        source_settings=graph.source_settings,
        stages=stages,
        predicted=predicted,
        alternatives=alternatives,
        rejected=rejected,
        training=TrainingConfig(
            seed=request.seed,
            lr=request.lr,
            steps=request.steps,
            dtype="fp32" if cluster.gpu.name == "cpu" else src.dtype,
        ),
        search=SearchStats(
            candidates=result.candidates,
            pruned_by_bound=result.pruned_by_bound,
            ilps_solved=result.ilps_solved,
            status=result.status,
            gap=result.gap,
            reported_gap=result.reported_gap,
        ),
    )


def pins_from(request: PlanRequest) -> Pins:
    try:
        return Pins(**request.pins)
    except TypeError as e:
        raise ConfigError(f"Unknown pin: {e}.") from None


def load_request_model(request: PlanRequest) -> LoadedModel:
    """Import the request's model file with its function names, arguments and dtype."""
    from planner.model.load import load_model_file

    return load_model_file(
        request.model_path,
        request.model_args,
        request.build_fn,
        request.inputs_fn,
        request.loss_fn,
        request.dtype,
        request.batch_fn,
    )


def analyse(request: PlanRequest, cache: bool | None = None, model: LoadedModel | None = None) -> ModelGraph:
    """The model's graph: from the analysis cache when the same model was analysed before (same file, files
    beside it, arguments, dtype, planner and torch), else built, traced and analysed, then cached.
    ``cache=None``: unless PLANNER_NO_CACHE is set (planner.model.cache). ``model``: the request's model file
    as `load_request_model` loaded it, where the caller has it."""
    from pathlib import Path

    from planner.model.cache import analysis_key, cache_enabled, read_cached, write_cached

    if model is None:
        model = load_request_model(request)
    if cache is None:
        cache = cache_enabled()
    key = analysis_key(model.source) if cache else ""
    if cache:
        graph = read_cached(key, Path(model.source.path).parent)
        if graph is not None and graph.source.model_copy(update={"path": model.source.path}) == model.source:
            return graph.model_copy(update={"source": model.source})  # the same file elsewhere
    from planner.model.analysis import analyse_model
    from planner.model.reads import Reads, recording

    reads = Reads()
    reads.update(model.reads)
    with recording(Path(model.source.path).parent) as during:
        graph = analyse_model(model)
    reads.update(during)
    if cache:
        write_cached(key, graph, reads, Path(model.source.path).parent)
    return graph


def _should_measure(request: PlanRequest, cluster: ClusterSpec) -> bool:
    """Measure when asked, or by default when the local CUDA GPU is the target GPU."""
    if request.measure is not None:
        return request.measure
    import torch

    if not torch.cuda.is_available():
        return False
    from planner.hardware.load import load_cluster
    from planner.measure.profile import local_device_name

    try:
        local = load_cluster(local_device_name("cuda").replace("NVIDIA ", ""), 1)
    except PlannerError:
        return False
    return local.gpu.name == cluster.gpu.name


def measure_locally(request: PlanRequest, graph: ModelGraph, cluster: ClusterSpec) -> Profile:
    """Profile each distinct unit on this machine for the micro-batch sizes the search may pick (<= 8)."""
    import torch

    from planner.measure.profile import profile_model, to_cost_profile

    loaded = load_request_model(request)
    sizes = [b for b in range(1, 9) if request.global_batch_size % b == 0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return to_cost_profile(profile_model(loaded, sizes, device), graph, cluster)


def plan_model(
    request: PlanRequest,
    graph: ModelGraph | None = None,
    profile: Profile | None = None,
    progress: Callable[[int, int], None] | None = None,
    ahead: Callable[[Plan], None] | None = None,
) -> tuple[Plan, ModelGraph, SearchResult]:
    """Plan a model file for a cluster: trace and analyse (unless given), search, build the Plan. `ahead`:
    called during the search with the plan of each configuration that becomes the best so far (the plan as
    the result's would be built were the search to end there: its runners-up and search figures aside)."""
    from planner.hardware.load import load_cluster
    from planner.processes import model_loaded

    model_loaded()  # where the analysis came from the cache: the search makes garbage
    if request.global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be at least 1, got {request.global_batch_size}.")
    cluster = load_cluster(request.gpu, request.nodes, request.gpus_per_node).with_memory_reserve(
        request.memory_reserve_gib
    )
    if graph is None:
        graph = analyse(request)
    options = CostOptions.for_cluster(cluster, request.overlap_dp_comm)
    if profile is None and _should_measure(request, cluster):
        profile = measure_locally(request, graph, cluster)
    on_best = None
    if ahead is not None:
        known = graph

        def on_best(ev: Evaluated) -> None:
            so_far = SearchResult(
                best=ev, ranked=[ev], rejected=Counter(), candidates=0, pruned_by_bound=0, ilps_solved=0, seconds=0.0
            )
            ahead(build_plan(known, cluster, request, so_far, options))

    result = search(
        graph,
        cluster.within_reserve(),  # plans keep the reserve free; the plan reports the physical capacity
        request.global_batch_size,
        pins_from(request),
        options,
        profile,
        request.top_k,
        request.time_limit,
        progress,
        request.max_nodes,
        on_best=on_best,
        block_recompute=True,
        on_guess=on_best,
    )
    return build_plan(graph, cluster, request, result, options), graph, result


def without_best(
    request: PlanRequest, graph: ModelGraph, result: SearchResult, reason: str
) -> tuple[Plan, SearchResult] | None:
    """The plan of the next ranked configuration, its predecessor rejected for `reason` (the plan-time check
    found that the generated script cannot run it: e.g. a TP degree a head count cannot take);
    None when no ranked configuration is left. The search's exactness is unaffected: what it ranked below
    the rejected plan is still the best of the rest."""
    import dataclasses

    from planner.hardware.load import load_cluster

    if len(result.ranked) < 2:
        return None
    rejected = result.rejected.copy()
    rejected[(region_of(result.best.cand), reason)] += 1
    rest = dataclasses.replace(result, best=result.ranked[1], ranked=result.ranked[1:], rejected=rejected)
    cluster = load_cluster(request.gpu, request.nodes, request.gpus_per_node).with_memory_reserve(
        request.memory_reserve_gib
    )
    options = CostOptions.for_cluster(cluster, request.overlap_dp_comm)
    return build_plan(graph, cluster, request, rest, options), rest
