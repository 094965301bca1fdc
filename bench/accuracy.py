"""Cost-model accuracy: SC21 Table 1 (the A100 fit) and published runs beyond it (validation).

Usage:
    python bench/accuracy.py                       # SC21 table, then every published run; exit 1 if SC21 misses
    python bench/accuracy.py --rows 1.7B,145B      # a subset of SC21 Table 1
    python bench/accuracy.py --set matmul=0.8      # try other A100 efficiencies without editing the YAML
    python bench/accuracy.py --published-only      # only the runs of bench/published_runs.yaml
    python bench/accuracy.py --published-only --rows llama3-405b --recompute-blocks 3
                                                   # runs whose id holds llama3-405b, each stage's first 3 blocks
                                                   # recomputed fully (Megatron-LM's --recompute-method block)
    python bench/accuracy.py --sc21-only           # only SC21 Table 1

Published runs. bench/published_runs.yaml holds runs from SC21, the Megatron-LM README (H100), MosaicML
llm-foundry (MPT with FSDP on A100 and H100), torchtitan (Llama 3.1 on H100), BLOOM-176B and MT-NLG 530B,
and mixture-of-experts runs on H100 (Qwen3-235B-A22B from Megatron-MoE-ModelZoo, GPT-OSS 120B from
Megatron-Bridge, built from their Hugging Face configs with the published expert-parallel degree pinned),
each with its citation, model configuration, layout and published figure (bench/published_runs.py has the
schema). Each is planned with its layout pinned and the predicted iteration time is set against the
published one (converted from tokens/s or TFLOP/s where that is what was published). One set of
efficiencies per GPU, the spec's, each fitted on its GPU's calibration sources only (published_runs.yaml
`splits`: A100 on SC21 Table 1 here, H100 on the Megatron-LM README rows by bench/fit_published.py); the
error distribution is printed for the validation rows apart from the fit rows, per GPU. Rows that use
something the planner does not model (FP8, torch.compile) are flagged and left out of the distribution.
Rows that overlap TP communication with the GEMMs (tp_comm_overlap) are planned with async TP pinned
(Candidate.tp_overlap), whose exposed part the cost model counts.

Throughput. For every GPT row of Narayanan et al., SC21, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Table 1 (weak scaling on DGX A100 80GB), the planner plans the sample GPT
with the paper's configuration pinned: t, p, GPUs and batch size from Table 1; micro-batch size, virtual
stages and data-parallel implementation from the paper's artifact (Megatron-LM examples/sc21/
run_table_1.sh); full ("uniform") activation recomputation in every row; no sequence parallelism and no
distributed optimizer (both came later). The published "achieved teraFLOP/s per GPU" counts the FLOPs
executed, recomputation included (96 B s l h^2 (1 + s/6h + V/16lh)), so it is compared with the plan's
`hardware_tflops_per_gpu`, which counts the same way.

Attention. Megatron-LM ran attention unfused in 2021: QK^T, scale-mask-softmax, dropout and AV as
separate kernels with the b x a x s x s score tensor in HBM. The sample GPT is built with
attention="math" (and dropout 0.1, as SC21), so the planner's own analysis counts those kernels: the
bmm FLOPs as matmul work and the score tensor's bytes as memory-bound work. One set of efficiencies
from the YAML applies to every row; nothing is derived or tuned per row.

Memory. Megatron-LM's megatron/training/theoretical_memory_usage.py models one setting: sequence
parallelism with selective recomputation, on the first pipeline stage (the busiest). For the same
degrees, micro-batch size and schedule in that setting, its weight+optimizer and activation bytes are set
against the cost model's model states and activations of pipeline rank 0, without the workspace,
fragmentation and communication buffers the formula leaves out. The cost model is evaluated on
Megatron's own stage partition (l/(p v) layers per stage, embedding first, head last) instead of being
searched: with selective recomputation the 1.7B and 3.6B rows need more than 80 GB (why the paper
recomputed everything), which the search would refuse, and a searched partition could differ from the one
the formula assumes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path

from published_runs import (
    NotExpressible,
    PublishedRuns,
    Run,
    load_runs,
    plan_run,
    predicted_iteration_s,
    rank0_memory_gib,
    run_cluster,
)

from planner.cost.model import Candidate, CostOptions, optimizer_time, rank_memory, unit_cost
from planner.errors import ConfigError, InfeasibleError
from planner.hardware.load import load_cluster
from planner.hardware.spec import ClusterSpec, Efficiencies
from planner.model.graph import ModelGraph
from planner.pipeline import PlanRequest, analyse, build_plan, pins_from, predicted_for
from planner.plan import Plan, Predicted
from planner.search.problem import PartitionProblem
from planner.search.search import SearchResult, evaluate, search

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "sample_models" / "gpt.py")
CLUSTER = "dgx-a100"
GPUS_PER_NODE = 8
SEQ = 2048
VOCAB = 51200  # Megatron pads GPT-2's 50257 tokens to a multiple of 1024
DTYPE = "bf16"  # the paper trained in fp16: same peak and bytes on the A100
TOLERANCE = 0.10
GiB = 2**30

# SC21 ran attention unfused with dropout 0.1 on the attention probabilities (run_table_1.sh leaves
# Megatron's --attention-dropout default); the sample GPT's attention="math" spells out the same kernels.
MODEL_ARGS = {"attention": "math", "attn_dropout": 0.1, "dropout": 0.1}


@dataclass(frozen=True)
class Row:
    """One row of SC21 Table 1 with the artifact's run settings (examples/sc21/run_table_1.sh)."""

    name: str
    layers: int
    hidden: int
    heads: int
    t: int
    p: int
    gpus: int
    batch: int
    published: float  # achieved teraFLOP/s per GPU, Table 1
    mbs: int  # MBS in run_table_1.sh
    layers_per_virtual_stage: int | None  # --num-layers-per-virtual-pipeline-stage; None: plain 1F1B
    ddp: str  # "torch" (overlaps the gradient all-reduce with backward) or "local" (after the backward)

    @property
    def preset(self) -> str:
        return "megatron-" + self.name.lower()

    @property
    def v(self) -> int:
        if self.layers_per_virtual_stage is None:
            return 1
        return self.layers // (self.p * self.layers_per_virtual_stage)

    @property
    def schedule(self) -> str:
        return "interleaved-1f1b" if self.v > 1 else "1f1b"

    @property
    def dp(self) -> int:
        return self.gpus // (self.t * self.p)

    @property
    def m(self) -> int:
        return self.batch // (self.dp * self.mbs)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Narayanan et al., SC21, Table 1 (layers, hidden, heads, t, p, GPUs, batch, achieved teraFLOP/s per GPU)
# and run_table_1.sh (MBS, layers per virtual stage, DDP). Every run used --activations-checkpoint-method
# uniform (full recomputation).
ROWS = [
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, "torch"),
    Row("3.6B", 30, 3072, 32, 2, 1, 64, 512, 138, 16, None, "torch"),
    Row("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142, 16, None, "torch"),
    Row("18B", 40, 6144, 48, 8, 1, 256, 1024, 135, 8, None, "torch"),
    Row("39B", 48, 8192, 64, 8, 2, 512, 1536, 138, 4, None, "local"),
    Row("76B", 60, 10240, 80, 8, 4, 1024, 1792, 140, 2, 5, "local"),
    Row("145B", 80, 12288, 96, 8, 8, 1536, 2304, 148, 2, 5, "local"),
    Row("310B", 96, 16384, 128, 8, 16, 1920, 2160, 155, 1, 3, "local"),
    Row("530B", 105, 20480, 128, 8, 35, 2520, 2520, 163, 1, 1, "local"),
    Row("1T", 128, 25600, 160, 8, 64, 3072, 3072, 163, 1, None, "local"),
]


# ------------------------------------------------------------------ Megatron-LM's formulas, for reference


def megatron_flops_per_iteration(row: Row) -> float:
    """FLOPs Megatron counts per iteration with full recomputation (Narayanan et al. SC21, eq. 3)."""
    b, s, n, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def megatron_parameters(row: Row) -> tuple[float, float]:
    """(transformer-layer parameters, embedding parameters) as theoretical_memory_usage.py counts them."""
    h, n, ffn = row.hidden, row.layers, 4 * row.hidden
    # 2 l h^2 (1 + ffn/h + query groups/heads + 2/h + 1/(l h)): attention, MLP, layer norms, final norm
    layers = 2 * n * h * h * (1 + ffn / h + 1 + 2 / h + 1 / (n * h))
    return layers, h * VOCAB


def megatron_weight_and_optimizer_bytes(row: Row, untied: bool = True) -> float:
    """compute_weight_and_optimizer_memory: the most loaded shard (first stage) at 18 bytes per parameter.

    The sample GPT does not tie its output layer to the embedding, so with p = 1 the first stage also
    holds the head (the formula's `untie_embeddings_and_output_weights`).
    """
    layers, emb = megatron_parameters(row)
    shard = (layers / row.p + emb) / row.t
    if untied and row.p == 1:
        shard += emb / row.t
    return 18 * shard  # no distributed optimizer


def megatron_activation_bytes(row: Row) -> float:
    """compute_activation_memory: first pipeline stage, sequence parallelism + selective recomputation.

    Korthikanti et al. 2022, Table 2: s b h (18 + 4 ffn/h) = 34 s b h per layer, times all l layers
    (p micro-batches in flight on l/p layers), the interleaving penalty 1 + (p-1)/(p v), the embedding's
    input and dropout mask, the output layer with p = 1, all divided by t.
    """
    s, b, h, n, p = SEQ, row.mbs, row.hidden, row.layers, row.p
    act = s * b * h * (18 + 4 * (4 * h) / h) * n
    act += 8 * s * b * p  # input token ids
    act += s * b * h * p  # embedding dropout mask
    if row.v > 1:
        act *= 1 + (p - 1) / (p * row.v)
    elif p > 1:
        act *= min(1.0, row.m / p)
    if p == 1:
        act += s * b * h * 4 * (1 + VOCAB / h)  # inputs to the output layer and the cross-entropy
    return act / row.t


# ------------------------------------------------------------------------------------------ clusters


def with_efficiency(cluster: ClusterSpec, **changes: float) -> ClusterSpec:
    eff = Efficiencies(**{**cluster.gpu.efficiency.model_dump(), **changes})
    return cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"efficiency": eff})})


def yaml_cluster(row: Row, overrides: dict[str, float]) -> ClusterSpec:
    """The row's DGX A100 cluster with the YAML's efficiencies (and any --set overrides)."""
    cluster = load_cluster(CLUSTER, row.gpus // GPUS_PER_NODE)
    return with_efficiency(cluster, **overrides) if overrides else cluster


# ------------------------------------------------------------------------------------------ predictions


def request_for(row: Row) -> PlanRequest:
    """The paper's configuration as a plan request with every searched dimension pinned."""
    pins = {
        "tp": row.t,
        "pp": row.p,
        "micro_batch_size": row.mbs,
        "schedule": row.schedule,
        "recompute": "full",
        "sequence_parallel": False,
        "zero_stage": 0,
    }
    if row.v > 1:
        pins["virtual_stages"] = row.v
    return PlanRequest(
        model_path=MODEL,
        model_args={"preset": row.preset, **MODEL_ARGS},
        gpu=CLUSTER,
        nodes=row.gpus // GPUS_PER_NODE,
        global_batch_size=row.batch,
        pins=pins,
        time_limit=None,
        top_k=0,
        # Megatron's "local" DDP all-reduces the gradients after the last backward; torch DDP overlaps.
        overlap_dp_comm=row.ddp == "torch",
    )


def degrees_request(row: Row, pin_degrees: bool) -> PlanRequest:
    """The row's model, cluster and batch with only its t, p and dp pinned (or nothing): what
    bench/table1_search.py and tests/test_megatron_rows.py compare."""
    return PlanRequest(
        model_path=MODEL,
        model_args={"preset": row.preset},
        gpu=CLUSTER,
        nodes=row.gpus // GPUS_PER_NODE,
        global_batch_size=row.batch,
        pins={"tp": row.t, "pp": row.p, "dp": row.dp} if pin_degrees else {},
        top_k=2,
    )


def plan_row(row: Row, graph: ModelGraph, cluster: ClusterSpec) -> tuple[Plan, SearchResult]:
    """What `plan_model` does, on a given cluster (whose efficiencies this bench adjusts)."""
    request = request_for(row)
    options = CostOptions.for_cluster(cluster, request.overlap_dp_comm)
    result = search(
        graph,
        cluster,
        request.global_batch_size,
        pins_from(request),
        options,
        None,
        request.top_k,
        request.time_limit,
    )
    return build_plan(graph, cluster, request, result, options), result


def megatron_partition(graph: ModelGraph, row: Row) -> list[list[int]]:
    """Megatron's layout: l/(p v) layers per stage, the embedding on the first, the head on the last."""
    blocks = [i for i, u in enumerate(graph.units) if u.kind == "block"]
    per = len(blocks) // (row.p * row.v)
    parts = [blocks[k * per : (k + 1) * per] for k in range(row.p * row.v)]
    parts[0] = list(range(blocks[0])) + parts[0]
    parts[-1] = parts[-1] + list(range(blocks[-1] + 1, len(graph.units)))
    return parts


def candidate(row: Row, sp: bool) -> Candidate:
    return Candidate(
        dp=row.dp,
        tp=row.t,
        pp=row.p,
        virtual_stages=row.v,
        micro_batch_size=row.mbs,
        num_micro_batches=row.m,
        schedule=row.schedule,
        zero_stage=0,
        sequence_parallel=sp,
    )


def predicted_megatron_layout(row: Row, graph: ModelGraph, cluster: ClusterSpec) -> Predicted:
    """The cost model's figures for the paper's configuration on Megatron's stage partition (no search).

    Set beside the plan's own figures, it separates the cost model's error from the partitioner's choice.
    """
    cand = candidate(row, sp=False)
    costs = [unit_cost(u, cand, cluster, graph.source.dtype) for u in graph.units]
    partition = megatron_partition(graph, row)
    options = CostOptions.for_cluster(cluster, row.ddp == "torch")
    ev = evaluate(PartitionProblem(graph, cluster, cand, costs, options=options), partition, ["full"] * len(partition))
    return predicted_for(ev, graph, cluster, options, row.batch)[0]


def memory_rank0(row: Row, graph: ModelGraph, cluster: ClusterSpec) -> tuple[float, float]:
    """(model-state bytes, activation bytes) of pipeline rank 0 with sequence parallelism + selective."""
    cand = candidate(row, sp=row.t > 1)
    costs = [unit_cost(u, cand, cluster, graph.source.dtype) for u in graph.units]
    partition = megatron_partition(graph, row)
    pb = PartitionProblem(graph, cluster, cand, costs, options=CostOptions())
    ev = evaluate(pb, partition, ["selective"] * len(partition))
    bare = [replace(s, comm_buffers=0.0) for s in ev.stages]
    total = rank_memory(bare, cand, CostOptions(workspace_bytes=0.0, fragmentation=0.0))[0]
    states = sum(s.weights + s.gradients + s.optimizer for s in bare if s.rank == 0)
    return states, total - states


@dataclass
class Result:
    row: Row
    graph: ModelGraph
    cluster: ClusterSpec
    plan: Plan
    search: SearchResult
    layout: Predicted  # Megatron's partition
    states: float
    acts: float

    @property
    def tflops(self) -> float:
        return self.plan.predicted.hardware_tflops_per_gpu

    @property
    def tflops_error(self) -> float:
        return self.tflops / self.row.published - 1

    @property
    def layout_error(self) -> float:
        return self.layout.hardware_tflops_per_gpu / self.row.published - 1

    @property
    def memory(self) -> float:
        return self.states + self.acts

    @property
    def megatron_memory(self) -> float:
        return megatron_weight_and_optimizer_bytes(self.row) + megatron_activation_bytes(self.row)

    @property
    def memory_error(self) -> float:
        return self.memory / self.megatron_memory - 1

    @property
    def ok(self) -> bool:
        return abs(self.tflops_error) <= TOLERANCE and abs(self.memory_error) <= TOLERANCE


def run_row(row: Row, overrides: dict[str, float], graphs: dict[str, ModelGraph]) -> Result:
    if row.preset not in graphs:
        graphs[row.preset] = analyse(request_for(row))
    graph = graphs[row.preset]
    cluster = yaml_cluster(row, overrides)
    plan, result = plan_row(row, graph, cluster)
    layout = predicted_megatron_layout(row, graph, cluster)
    states, acts = memory_rank0(row, graph, cluster)
    return Result(row, graph, cluster, plan, result, layout, states, acts)


# ---------------------------------------------------------------------------------------------- output


def print_table(results: list[Result]) -> None:
    print(
        "Throughput: the plan's predicted hardware TFLOP/s per GPU (FLOPs executed, full recomputation\n"
        "included) vs SC21 Table 1 'achieved teraFLOP/s per GPU' (which counts recomputation too); 'layout'\n"
        "is the same cost model on Megatron's own stage partition. Memory: pipeline rank 0's model states +\n"
        "activations with sequence parallelism and selective recomputation vs Megatron-LM's\n"
        "theoretical_memory_usage.py (weight+optimizer + activation, first stage), same t, p, mbs, schedule.\n"
    )
    head = (
        f"{'row':>5} {'params':>7} {'t':>2} {'p':>3} {'dp':>3} {'GPUs':>5} {'batch':>5} {'mbs':>3} {'v':>2} "
        f"{'pred TF/s':>9} {'publ.':>5} {'err %':>6} {'layout':>6} {'err %':>6} "
        f"{'pred GiB':>8} {'Megatron GiB':>12} {'err %':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row = r.row
        print(
            f"{row.name:>5} {r.graph.total_params / 1e9:>6.1f}B {row.t:>2} {row.p:>3} {row.dp:>3} {row.gpus:>5} "
            f"{row.batch:>5} {row.mbs:>3} {row.v:>2} {r.tflops:>9.1f} {row.published:>5.0f} "
            f"{100 * r.tflops_error:>+6.1f} {r.layout.hardware_tflops_per_gpu:>6.1f} {100 * r.layout_error:>+6.1f} "
            f"{r.memory / GiB:>8.1f} {r.megatron_memory / GiB:>12.1f} {100 * r.memory_error:>+6.1f}"
            + ("" if r.ok else "  <- misses 10%")
        )


def print_breakdown(results: list[Result]) -> None:
    """Where each predicted iteration goes, and the checks behind the two comparisons."""
    print(
        "\nBreakdown of the plan's iteration. Per micro-batch on its slowest stage: compute = forward +\n"
        "backward with recomputation and TP communication, TP = that communication, p2p = one send. Per\n"
        "iteration: simulated pipeline + exposed DP sync + optimizer step; bubble = idle share of the\n"
        "pipeline. FLOPs = the planner's executed FLOPs / Megatron's count. Memory split:\n"
        "states (weights, gradients, optimizer) and activations, ours vs Megatron's formula.\n"
    )
    head = (
        f"{'row':>5} {'compute ms':>10} {'TP ms':>6} {'p2p ms':>6} {'m':>4} {'iter s':>7} {'bubble':>6} "
        f"{'DP s':>6} {'opt s':>6} {'FLOPs':>6} {'plan GiB':>8} "
        f"{'states':>6} {'Megatr.':>7} {'acts':>5} {'Megatr.':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row, pred, best = r.row, r.plan.predicted, r.search.best
        slow = max(best.stages, key=lambda s: s.compute)
        executed = pred.hardware_tflops_per_gpu * 1e12 * pred.iteration_time_s * row.gpus
        opt = max(
            optimizer_time(sum(s.params_local for s in best.stages if s.rank == k), best.cand, r.cluster, DTYPE)
            for k in range(best.cand.pp)
        )
        print(
            f"{row.name:>5} {1e3 * slow.compute:>10.1f} {1e3 * slow.tp_comm:>6.1f} {1e3 * slow.p2p:>6.2f} "
            f"{row.m:>4} {pred.iteration_time_s:>7.2f} {pred.bubble_fraction:>6.3f} "
            f"{pred.comm.data_parallel_exposed_s:>6.3f} {opt:>6.3f} "
            f"{executed / megatron_flops_per_iteration(row):>6.3f} "
            f"{pred.peak_memory_bytes / GiB:>8.1f} {r.states / GiB:>6.1f} "
            f"{megatron_weight_and_optimizer_bytes(row) / GiB:>7.1f} {r.acts / GiB:>5.1f} "
            f"{megatron_activation_bytes(row) / GiB:>7.1f}"
        )


def parse_overrides(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in Efficiencies.model_fields:
            raise SystemExit(f"--set: unknown efficiency {key!r}; known: {', '.join(Efficiencies.model_fields)}")
        out[key] = float(value)
    return out


# ------------------------------------------------------------------------------------ published runs


@dataclass
class RunResult:
    run: Run
    predicted_s: float | None  # None: the cost model finds the published layout infeasible
    peak_gib: float | None
    capacity_gib: float
    gpu_name: str
    reason: str = ""
    rank0_gib: tuple[float, float] | None = None  # (states, activations) of pipeline rank 0, bare
    shares: dict[str, float] | None = None  # the plan's iteration by part (bubble, exposed comm), as fractions

    @property
    def error(self) -> float | None:
        if self.predicted_s is None:
            return None
        return self.predicted_s / self.run.published_iteration_s - 1


def run_published(runs: PublishedRuns, memory_only: bool = False) -> list[RunResult]:
    """Each run planned with its layout pinned (`memory_only`: the memory-only rows, `PublishedRuns.memory_runs`,
    whose predicted time is not compared)."""
    graphs: dict = {}
    out = []
    for run in runs.memory_runs if memory_only else runs.runs:
        try:
            plan, cluster = plan_run(run, graphs)
        except NotExpressible as e:
            gpu = run_cluster(run).gpu
            out.append(RunResult(run, None, None, gpu.memory_gib, gpu.name, str(e)))
            continue
        except (InfeasibleError, ConfigError) as e:  # ConfigError: a pin the run cannot take (--recompute-blocks)
            gpu = run_cluster(run).gpu
            out.append(RunResult(run, None, None, gpu.memory_gib, gpu.name, str(e).split(" To make it fit")[0]))
            continue
        pred = plan.predicted
        out.append(
            RunResult(
                run,
                None if memory_only else predicted_iteration_s(run, plan),
                pred.peak_memory_bytes / GiB,
                pred.memory_capacity_bytes / GiB,
                cluster.gpu.name,
                rank0_gib=rank0_memory_gib(plan),
                shares=iteration_shares(plan),
            )
        )
    return out


def iteration_shares(plan: Plan) -> dict[str, float]:
    """Where the plan's iteration goes: pipeline bubble, exposed TP / DP / p2p communication, the rest compute."""
    pred, it = plan.predicted, max(plan.predicted.iteration_time_s, 1e-12)
    c = pred.comm
    parts = {
        "bubble": pred.bubble_fraction,
        "TP comm": c.tensor_parallel_s / it,
        "exposed DP comm": c.data_parallel_exposed_s / it,
        "p2p": c.pipeline_p2p_s / it,
    }
    parts["compute"] = max(0.0, 1.0 - sum(parts.values()))
    return parts


MISS = 0.15  # the target for the worst validation row


def miss_cause(r: RunResult, known: list[str] | None = None) -> str:
    """Why a validation row misses: no prediction (the refusal), a feature not modelled, or the direction and
    what the predicted iteration is made of (the part a fix would have to move). A cause the yaml records
    outside the cost model (`Run.miss_cause`) is named by its number in `known` (appended there when new),
    so that rows sharing one cause print it once."""
    if r.error is None:
        return r.reason
    if r.run.unsupported:
        return f"not modelled: {r.run.unsupported}"
    ranked = sorted((r.shares or {}).items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in ranked if v >= 0.01)
    side = "too fast" if r.error < 0 else "too slow"
    cause = ""
    if r.run.miss_cause and known is not None:
        if r.run.miss_cause not in known:
            known.append(r.run.miss_cause)
        cause = f"; cause [{known.index(r.run.miss_cause) + 1}]"
    return f"predicted {side}; the predicted iteration is {parts}{cause}"


def print_misses(results: list[RunResult]) -> None:
    rows = [r for r in results if r.run.role == "validation" and (r.error is None or abs(r.error) > MISS)]
    print(f"\nMisses: validation rows off by more than {100 * MISS:.0f}% or without a prediction ({len(rows)}):")
    known: list[str] = []
    for r in rows:
        err = "   -  " if r.error is None else f"{100 * r.error:+6.1f}%"
        print(f"  {r.run.id:<36} {err}  {miss_cause(r, known)}")
    if known:
        print("\nCauses outside the cost model (bench/published_runs.yaml, miss_cause):")
    for i, text in enumerate(known, 1):
        print(textwrap.fill(text, width=112, initial_indent=f"  [{i}] ", subsequent_indent="      "))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def distribution(results: list[RunResult]) -> str:
    errs = [abs(r.error) for r in results if r.error is not None]
    missing = sum(1 for r in results if r.error is None)
    if not errs:
        return f"no predictions ({missing} infeasible)"
    within = lambda t: sum(e <= t for e in errs) / len(errs)  # noqa: E731
    return (
        f"n={len(errs)}: median |err| {100 * statistics.median(errs):.1f}%, p90 {100 * percentile(errs, 0.9):.1f}%, "
        f"max {100 * max(errs):.1f}%, within 10% {100 * within(0.10):.0f}%, within 20% {100 * within(0.20):.0f}%"
        + (f"; {missing} more infeasible under the cost model" if missing else "")
    )


def print_published(results: list[RunResult], runs: PublishedRuns) -> None:
    print(
        "\nPublished runs (bench/published_runs.yaml), each planned with its published layout pinned. Iteration\n"
        "time predicted vs published (published tokens/s or TFLOP/s converted with the batch and the publisher's\n"
        "FLOP formula). role: fit = its GPU's efficiencies were fitted on it; val = nothing was fitted on it.\n"
        "'!' marks runs using features the planner does not model (left out of the distributions); '~' runs that\n"
        "overlap TP communication with the GEMMs, planned with async TP (its exposed part costed).\n"
    )
    head = (
        f"{'run':<36} {'role':<4} {'gpu':<15} {'GPUs':>5} {'t':>2} {'p':>3} {'dp':>4} {'ep':>2} {'v':>2} {'mbs':>3} "
        f"{'rec':<4} {'sp':<2} {'z':>1} {'pred s':>8} {'publ s':>8} {'err %':>7} {'GiB':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        run, lay = r.run, r.run.layout
        err = "infeas." if r.error is None else f"{100 * r.error:+7.1f}"
        pred = "-" if r.predicted_s is None else f"{r.predicted_s:8.3f}"
        mem = "-" if r.peak_gib is None else f"{r.peak_gib:5.1f}"
        print(
            f"{run.id:<36} {'fit' if run.role == 'fit' else 'val':<4} {run.gpu:<15} {run.gpus:>5} {lay.tp:>2} "
            f"{lay.pp:>3} {run.dp:>4} {lay.ep:>2} {lay.v:>2} {lay.mbs:>3} {lay.recompute[:4]:<4} "
            f"{'y' if lay.sp else 'n':<2} {lay.zero:>1} {pred:>8} {run.published_iteration_s:>8.3f} {err:>7} {mem:>5}"
            + (" !" if run.unsupported else "")
            + (" ~" if run.tp_comm_overlap and lay.tp > 1 else "")
        )
    notes = [r for r in results if r.run.unsupported or r.error is None]
    if notes:
        print()
    for r in notes:
        if r.run.unsupported:
            print(f"  ! {r.run.id}: {r.run.unsupported}")
        if r.error is None:
            print(f"  infeasible {r.run.id}: {r.reason}")
    print("\nError distribution of |predicted / published - 1|:")
    for role, label in (("fit", "fit rows (SC21 A100, Megatron H100)"), ("validation", "validation rows")):
        rows = [r for r in results if r.run.role == role and not r.run.unsupported]
        print(f"  {label:<32} {distribution(rows)}")
        if role == "fit":
            for gpu in sorted({r.gpu_name for r in rows}):
                print(f"    {gpu:<30} {distribution([r for r in rows if r.gpu_name == gpu])}")
        if role == "validation":
            for gpu in sorted({r.gpu_name for r in rows}):
                print(f"    {gpu:<30} {distribution([r for r in rows if r.gpu_name == gpu])}")
            for src in sorted({r.run.source for r in rows}):
                print(f"    source {src:<23} {distribution([r for r in rows if r.run.source == src])}")
    flagged = [r for r in results if r.run.unsupported]
    if flagged:
        print(f"  {'unsupported features (!)':<32} {distribution(flagged)}")
    print(f"  {len(runs.runs)} runs from {len({r.source for r in runs.runs})} sources")
    print_misses(results)
    print_memory(results + run_published(runs, memory_only=True))


def print_peers(results: list[RunResult], calculon: str | None) -> None:
    """bench/peers.py's estimators on the same validation rows, beside the planner (rows none of them can
    express are counted apart)."""
    from peers import calculon_iteration_s, llm_analysis_iteration_s

    val = [r for r in results if r.run.role == "validation" and not r.run.unsupported]
    errs: dict[str, list[float | None]] = {"planner": [r.error for r in val], "llm-analysis": [], "calculon": []}
    why: dict[str, set[str]] = {"llm-analysis": set(), "calculon": set()}
    for r in val:
        for name, (s, w) in (
            ("llm-analysis", llm_analysis_iteration_s(r.run)),
            ("calculon", calculon_iteration_s(r.run, calculon)),
        ):
            errs[name].append(None if s is None else s / r.run.published_iteration_s - 1)
            if w:
                why[name].add(w.split(":")[0])
    print(f"\nPeers on the {len(val)} validation rows (bench/peers.py; llm-analysis given the planner's efficiencies):")
    for name, e in errs.items():
        print(f"  {name:<13} {peer_distribution(e)}")
        if name in why and why[name]:
            print(f"  {'':<13} without a prediction where: {'; '.join(sorted(why[name]))}")
    for name in ("llm-analysis", "calculon"):
        both = [(p, q) for p, q in zip(errs["planner"], errs[name], strict=True) if p is not None and q is not None]
        if both:
            print(f"  on the {len(both)} rows both predict: planner {peer_distribution([p for p, _ in both])}; "
                  f"{name} {peer_distribution([q for _, q in both])}")


def peer_distribution(errors: list[float | None]) -> str:
    errs = [abs(e) for e in errors if e is not None]
    if not errs:
        return f"no predictions ({len(errors)} rows)"
    return (
        f"n={len(errs)}: median {100 * statistics.median(errs):.1f}%, p90 {100 * percentile(errs, 0.9):.1f}%, "
        f"worst {100 * max(errs):.1f}%" + (f"; {len(errors) - len(errs)} without" if len(errs) < len(errors) else "")
    )


def print_memory(results: list[RunResult]) -> None:
    """Published memory per GPU against the plan's: model states and activations (pipeline rank 0's) where the
    source splits them, else the published peak (torchtitan's maximum reserved memory) against the plan's peak."""
    rows = [r for r in results if r.run.memory is not None]
    if not rows:
        return
    print(
        "\nMemory per GPU, published vs predicted. States and activations: pipeline rank 0's, without the\n"
        "workspace, fragmentation and communication buffers the published figures leave out. 'peak' rows publish only\n"
        "the allocator's maximum reserved memory: compared with the plan's peak (its busiest rank, all of it).\n"
        "'*' marks memory-only rows (a layout the source measured but did not time); '!' unsupported features.\n"
    )
    head = (
        f"{'run':<36} {'states GiB':>10} {'pred':>6} {'err %':>6} {'acts GiB':>8} {'pred':>6} {'err %':>6} "
        f"{'total err %':>11}"
    )
    print(head)
    print("-" * len(head))
    within = 0
    for r in rows:
        mem = r.run.memory
        assert mem is not None
        if r.rank0_gib is None:
            print(f"{r.run.id:<36} refused: {r.reason}")
            continue
        marks = (" *" if r.run.published is None else "") + (" !" if r.run.unsupported else "")
        if mem.peak_gib is not None:
            assert r.peak_gib is not None
            tot = r.peak_gib / mem.peak_gib - 1
            print(
                f"{r.run.id:<36} {'peak':>10} {'':>6} {'':>6} {mem.peak_gib:>8.2f} {r.peak_gib:>6.2f} {'':>6} "
                f"{100 * tot:>+11.1f}{marks}"
            )
        else:
            assert mem.states_gib is not None and mem.activations_gib is not None
            st, ac = r.rank0_gib
            tot = (st + ac) / (mem.states_gib + mem.activations_gib) - 1
            print(
                f"{r.run.id:<36} {mem.states_gib:>10.2f} {st:>6.2f} {100 * (st / mem.states_gib - 1):>+6.1f} "
                f"{mem.activations_gib:>8.2f} {ac:>6.2f} {100 * (ac / mem.activations_gib - 1):>+6.1f} "
                f"{100 * tot:>+11.1f}{marks}"
            )
        within += abs(tot) <= 0.10
    print(f"{within} of {len(rows)} rows with a published memory figure within 10% (total per GPU)")


def with_recompute_blocks(run: Run, n: int) -> Run:
    """`run` planned with its first `n` blocks per stage recomputed fully (`--recompute-blocks`); a run whose
    published recompute is full recomputes every block already and stays as it is."""
    if run.layout.recompute == "full":
        return run
    return run.model_copy(update={"layout": run.layout.model_copy(update={"recompute_blocks": n})})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--published-only", action="store_true", help="only the runs of bench/published_runs.yaml")
    only.add_argument("--sc21-only", action="store_true", help="only SC21 Table 1 (throughput and memory)")
    ap.add_argument(
        "--rows",
        help="comma-separated row names (default: all), e.g. 1.7B,145B,1T; with --published-only, substrings of "
        "the run ids, e.g. llama3-405b,torchtitan-405b",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        help="override A100 efficiencies, e.g. matmul=0.8,gemm_half_dim=128 (attention: fused SDPA only)",
    )
    ap.add_argument(
        "--recompute-blocks",
        type=int,
        metavar="N",
        help="with --published-only: plan each chosen run (--rows) with its first N blocks per stage recomputed "
        "fully and the rest at its published recompute mode (Megatron-LM's --recompute-method block "
        "--recompute-num-layers N; rows whose recompute is full keep it)",
    )
    ap.add_argument("--calculon", metavar="DIR", help="a checkout of github:calculon-ai/calculon, run beside")
    ap.add_argument("--no-peers", action="store_true", help="leave out bench/peers.py's estimators")
    args = ap.parse_args(argv)
    if args.published_only:
        runs = load_runs()
        if args.rows:
            wanted_ids = [n.strip() for n in args.rows.split(",") if n.strip()]
            runs = runs.model_copy(
                update={
                    key: [r for r in getattr(runs, key) if any(w in r.id for w in wanted_ids)]
                    for key in ("runs", "memory_runs")
                }
            )
            if not runs.runs:
                raise SystemExit(f"--rows: no published run id contains any of {args.rows!r}")
        if args.recompute_blocks is not None:
            pinned = [with_recompute_blocks(r, args.recompute_blocks) for r in runs.runs]
            runs = runs.model_copy(update={"runs": pinned})
        results = run_published(runs)
        print_published(results, runs)
        if not args.no_peers:
            print_peers(results, args.calculon)
        return 0
    if args.recompute_blocks is not None:
        raise SystemExit("--recompute-blocks applies to the published runs: pass it with --published-only")
    rows = ROWS
    if args.rows:
        wanted = {n.strip().upper() for n in args.rows.split(",")}
        rows = [r for r in ROWS if r.name.upper() in wanted]
        if not rows:
            raise SystemExit(f"--rows: none of {args.rows!r}; rows are {', '.join(r.name for r in ROWS)}")
    overrides = parse_overrides(args.overrides)
    t0 = time.perf_counter()
    graphs: dict[str, ModelGraph] = {}
    results = [run_row(row, overrides, graphs) for row in rows]
    eff = yaml_cluster(ROWS[0], overrides).gpu.efficiency
    print(
        f"A100 efficiencies ({'hardware_specs/a100-sxm4-80gb.yaml' + (' + --set' if overrides else '')}): "
        f"{', '.join(f'{k}={v:g}' for k, v in eff.model_dump().items())}, the same for every row.\n"
    )
    print_table(results)
    print_breakdown(results)
    worst_t = max(abs(r.tflops_error) for r in results)
    worst_m = max(abs(r.memory_error) for r in results)
    rms = math.sqrt(sum(r.tflops_error**2 for r in results) / len(results))
    print(
        f"\nworst throughput error {100 * worst_t:.1f}% (rms {100 * rms:.1f}%), worst memory error "
        f"{100 * worst_m:.1f}%, tolerance {100 * TOLERANCE:.0f}%; {time.perf_counter() - t0:.0f} s"
    )
    if not args.sc21_only and not args.rows and not overrides:
        runs = load_runs()
        published = run_published(runs)
        print_published(published, runs)
        if not args.no_peers:
            print_peers(published, args.calculon)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
