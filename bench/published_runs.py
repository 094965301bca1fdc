"""Published training runs (bench/published_runs.yaml): their schema, and each one planned at its layout.

Every run is planned with its published layout pinned (t, p, dp, virtual stages, micro-batch, schedule,
recomputation, sequence parallelism, ZeRO stage, and for a mixture-of-experts model the expert-parallel
degree), the sample GPT or Llama, or a Hugging Face model from its config (`model: hf`: transformers' class
for the config's model_type, as `planner plan hf:NAME --hf-config` builds it), on the meta device at the
published configuration, on the run's GPU spec with the spec's own efficiencies. The published figure is
turned into an iteration time (tokens/s from the batch, TFLOP/s through the publisher's FLOP formula), so
the error does not depend on how either side counts FLOPs.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from planner.cost.model import CostOptions
from planner.hardware.load import load_cluster
from planner.hardware.spec import ClusterSpec, Efficiencies
from planner.model.graph import ModelGraph
from planner.names import Recompute, Schedule
from planner.pipeline import PlanRequest, analyse, build_plan, pins_from
from planner.plan import Plan
from planner.search.search import search

ROOT = Path(__file__).resolve().parents[1]
RUNS_FILE = ROOT / "bench" / "published_runs.yaml"
MODELS = {"gpt": ROOT / "sample_models" / "gpt.py", "llama": ROOT / "sample_models" / "llama.py"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Strict):
    title: str
    where: str = Field(description="paper section/table, or repository + file + commit")


class ModelConfig(_Strict):
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt | None = None  # llama only; None: as many as heads
    ffn: PositiveInt | None = None  # None: 4 * hidden
    vocab: PositiveInt
    seq: PositiveInt


class HFModel(_Strict):
    """A Hugging Face model planned from its config (the `hf:` model source), for models the sample files do
    not cover (mixture-of-experts: Qwen3-MoE, GPT-OSS, ...)."""

    name: str = Field(description="the model's Hub id, for the report (nothing is downloaded)")
    seq: PositiveInt
    config: dict[str, Any] = Field(description="config.json's fields: model_type, architectures, published sizes")

    @model_validator(mode="after")
    def _names_its_class(self) -> HFModel:
        arch = self.config.get("architectures")
        if not isinstance(self.config.get("model_type"), str):
            raise ValueError(f"hf {self.name}: config.model_type is required (the transformers config class)")
        if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str)):
            raise ValueError(f"hf {self.name}: config.architectures must name one transformers model class")
        return self


class Layout(_Strict):
    tp: PositiveInt
    cp: PositiveInt = Field(1, description="context parallelism: the sequence sharded over cp ranks (ring attention)")
    pp: PositiveInt
    v: PositiveInt = 1
    ep: PositiveInt = Field(1, description="expert parallelism (MoE): each layer's experts over ep ranks")
    mbs: PositiveInt
    global_batch: PositiveInt
    recompute: Recompute
    recompute_blocks: PositiveInt | None = Field(
        None, description="Megatron-LM's --recompute-method block --recompute-num-layers N: each stage's first N "
        "blocks recomputed fully, the rest at `recompute` (planner plan --recompute-blocks N)",
    )
    sp: bool
    zero: Literal[0, 1, 2, 3]
    schedule: Schedule
    overlap_dp_comm: bool = Field(description="False: gradients reduced after the last backward (Megatron 'local' DDP)")
    overlap_param_gather: bool = Field(
        False, description="ZeRO-1/2 weights all-gathered during the next forward (Megatron --overlap-param-gather)"
    )


class Published(_Strict):
    metric: Literal["iteration_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu"]
    value: float = Field(gt=0)
    flops: Literal["megatron-hardware", "megatron-model", "model-6nd"] | None = Field(
        None, description="the publisher's FLOP count behind a tflops_per_gpu figure"
    )

    @model_validator(mode="after")
    def _flops_named(self) -> Published:
        if (self.metric == "tflops_per_gpu") != (self.flops is not None):
            raise ValueError("published.flops is required for tflops_per_gpu and only for it")
        return self


class PublishedMemory(_Strict):
    """Memory per GPU a source published for the run: model states and activations (GiB) of its busiest rank, or
    only its peak (torchtitan's figure: the allocator's maximum reserved memory over the run, busiest GPU)."""

    states_gib: float | None = Field(None, gt=0, description="weights, gradients and optimizer states")
    activations_gib: float | None = Field(None, gt=0)
    peak_gib: float | None = Field(None, gt=0, description="the whole peak per GPU, where only that is published")
    cite: str

    @model_validator(mode="after")
    def _one_kind(self) -> PublishedMemory:
        split = self.states_gib is not None and self.activations_gib is not None
        if split == (self.peak_gib is not None) or (not split and (self.states_gib or self.activations_gib)):
            raise ValueError("memory: give states_gib and activations_gib, or peak_gib alone")
        return self

    @property
    def total_gib(self) -> float:
        return self.peak_gib if self.peak_gib is not None else (self.states_gib or 0.0) + (self.activations_gib or 0.0)


class Run(_Strict):
    id: str
    source: str
    role: Literal["fit", "validation"]
    cite: str
    model: Literal["gpt", "llama", "hf"]
    model_args: dict[str, float | int | str] = Field(default_factory=dict, description="extra sample-model arguments")
    loss_fn: str | None = Field(
        None, description="the loss function of the sample model file the run's loss stands for (default: loss_fn)"
    )
    gpu: str = Field(description="GPU spec or cluster preset name")
    gpus: PositiveInt
    cluster_overrides: dict[Literal["memory_gib", "memory_bandwidth_gbps", "inter_node_bandwidth_gbps"], float] = Field(
        default_factory=dict, description="published facts of the run's machine that differ from the spec"
    )
    config: ModelConfig | None = Field(None, description="the sample GPT's or Llama's configuration")
    hf: HFModel | None = Field(None, description="model: hf, the Hugging Face config it is built from")
    layout: Layout
    published: Published | None = Field(
        None, description="the published speed; None only for a memory-only row (`PublishedRuns.memory_runs`)"
    )
    memory: PublishedMemory | None = Field(None, description="published memory per GPU, where there is one")
    unsupported: str | None = Field(None, description="what the run used that the planner does not model")
    miss_cause: str | None = Field(
        None,
        description="why the row misses where the cause lies outside the cost model (the software of the run's "
        "vintage, with the numbers that show it): printed beside the miss; unlike `unsupported`, the row stays in "
        "the distributions",
    )
    tp_comm_overlap: bool = Field(
        False, description="TP communication overlapped with the GEMMs (Megatron --tp-comm-overlap, torchtitan's "
        "AsyncTP): planned with the planner's async TP pinned (Candidate.tp_overlap, its exposed part costed)"
    )
    assumed: list[str] = Field(default_factory=list, description="unpublished fields and how they were set")

    @model_validator(mode="after")
    def _consistent(self) -> Run:
        lay = self.layout
        if self.gpus % (lay.tp * lay.cp * lay.pp):
            raise ValueError(f"{self.id}: {self.gpus} GPUs are not a multiple of tp*cp*pp = {lay.tp * lay.cp * lay.pp}")
        if lay.global_batch % (self.dp * lay.mbs):
            raise ValueError(f"{self.id}: global batch {lay.global_batch} is not a multiple of dp*mbs")
        if (self.model == "hf") != (self.hf is not None) or (self.config is None) != (self.hf is not None):
            raise ValueError(f"{self.id}: model hf takes `hf` (a Hugging Face config), gpt and llama take `config`")
        if self.config is not None and self.model == "gpt" and self.config.kv_heads is not None:
            raise ValueError(f"{self.id}: kv_heads is for the llama model only")
        if self.hf is not None and self.published.metric == "tflops_per_gpu":
            raise ValueError(f"{self.id}: tflops_per_gpu needs the publisher's FLOP formula (gpt and llama only)")
        if self.hf is not None and self.model_args:
            raise ValueError(f"{self.id}: model_args are the sample models'; an hf model takes its config's fields")
        if lay.ep > 1 and self.hf is None:
            raise ValueError(f"{self.id}: ep {lay.ep} needs a mixture-of-experts model (model: hf)")
        if self.miss_cause and self.role == "fit":
            raise ValueError(f"{self.id}: a fit row's miss is the fit's to explain, not a recorded miss_cause")
        return self

    @property
    def dp(self) -> int:
        return self.gpus // (self.layout.tp * self.layout.cp * self.layout.pp)

    @property
    def seq(self) -> int:
        return self.hf.seq if self.hf is not None else self.dense_config.seq

    @property
    def dense_config(self) -> ModelConfig:
        if self.config is None:
            raise ValueError(f"{self.id}: an hf model has no sample-model config")
        return self.config

    @property
    def tokens_per_iteration(self) -> int:
        return self.layout.global_batch * self.seq

    def publisher_flops(self) -> float:
        """FLOPs per iteration as the publisher counts them (Narayanan et al. SC21 eq. 3 and its 72 form; model-6nd:
        6 N per token, N the blocks' weights and the output layer (Kaplan et al. 2020), plus 12 l s h per token for
        attention's two matmuls, the same attention term as the 72 form's s/6h)."""
        c = self.dense_config
        b, s, n, h, v = self.layout.global_batch, c.seq, c.layers, c.hidden, c.vocab
        flops = self.published.flops if self.published is not None else None
        if flops == "model-6nd":
            kv = (c.kv_heads or c.heads) * (h // c.heads)
            mlp = (3 if self.model == "llama" else 2) * h * (c.ffn or 4 * h)
            weights = n * (2 * h * h + 2 * h * kv + mlp) + v * h
            return b * s * (6 * weights + 12 * n * s * h)
        if flops == "megatron-hardware":
            return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
        return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))

    @cached_property
    def published_iteration_s(self) -> float:
        """The published figure as seconds per iteration."""
        pub = self.published
        if pub is None:
            raise ValueError(f"{self.id}: a memory-only row has no published speed")
        if pub.metric == "iteration_time_s":
            return pub.value
        if pub.metric == "tokens_per_s":
            return self.tokens_per_iteration / pub.value
        if pub.metric == "tokens_per_s_per_gpu":
            return self.tokens_per_iteration / (pub.value * self.gpus)
        return self.publisher_flops() / (pub.value * 1e12 * self.gpus)

    def model_args_full(self) -> dict:
        if self.hf is not None:
            return {"seq": self.hf.seq}
        c = self.dense_config
        args = {"layers": c.layers, "hidden": c.hidden, "heads": c.heads, "vocab": c.vocab, "seq": c.seq}
        if c.ffn is not None:
            args["ffn"] = c.ffn
        if self.model == "llama":
            args["kv_heads"] = c.kv_heads or c.heads
        return {**args, **self.model_args}

    def request(self, gpus_per_node: int) -> PlanRequest:
        lay = self.layout
        pins = {
            "dp": self.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "virtual_stages": lay.v,
            "micro_batch_size": lay.mbs,
            "schedule": lay.schedule,
            "recompute": lay.recompute,
            "sequence_parallel": lay.sp,
            "zero_stage": lay.zero,
        }
        if lay.recompute_blocks is not None:
            pins["recompute_blocks"] = lay.recompute_blocks
        if lay.tp > 1 and lay.sp:  # pinned either way: the search would turn async TP on where it runs
            pins["tp_overlap"] = self.tp_comm_overlap
        if self.hf is not None:
            if self.dp % lay.ep:
                raise NotExpressible(
                    f"expert parallelism over more ranks than data parallelism (ep {lay.ep}, dp {self.dp}: Megatron's "
                    f"MoE parallel folding, the experts over tp x dp ranks): the planner shards experts over ep of the "
                    "dp ranks only (ep divides dp)" + (f", and with tp = 1 only (tp {lay.tp})" if lay.tp > 1 else "")
                )
            pins["ep"] = lay.ep
        if lay.cp > 1:
            if not planner_has_cp():
                raise NotExpressible(
                    f"context parallelism (cp {lay.cp}): not expressible yet (no cp degree in the planner)"
                )
            pins["cp"] = lay.cp
        return PlanRequest(
            model_path=str(MODELS[self.model] if self.hf is None else hf_model_file(self.hf)),
            model_args=self.model_args_full(),
            loss_fn=self.loss_fn,
            gpu=self.gpu,
            nodes=self.gpus // gpus_per_node,
            global_batch_size=lay.global_batch,
            pins=pins,
            top_k=0,
            overlap_dp_comm=lay.overlap_dp_comm,
        )


def hf_model_file(hf: HFModel) -> Path:
    """The model file `planner plan hf:NAME --hf-config` compiles for the config, in a folder named by the
    config's digest (the same config, the same file and path: the analysis cache and the plans stay the same)."""
    from planner.model.sources import CONFIG_FILE, compile_source

    text = json.dumps(hf.config, indent=1, sort_keys=True) + "\n"
    digest = hashlib.sha256(f"{hf.seq}\n{text}".encode()).hexdigest()[:16]
    where = Path(tempfile.gettempdir()) / "planner-published-runs" / digest
    config = where / CONFIG_FILE
    where.mkdir(parents=True, exist_ok=True)
    if not config.is_file() or config.read_text() != text:
        config.write_text(text)
    return compile_source(f"hf:{hf.name}", where, hf_config=config, seq=hf.seq)


class NotExpressible(Exception):
    """A run's layout uses something the planner cannot express yet (the reason is the message)."""


def planner_has_cp() -> bool:
    """Whether this planner searches context parallelism (a `cp` degree on Candidate)."""
    from planner.cost.candidate import Candidate

    return "cp" in Candidate.__dataclass_fields__


class Split(_Strict):
    """Which sources a GPU's efficiencies are fitted on and which only validate them, chosen before fitting."""

    gpus: list[str] = Field(description="the runs' `gpu` names this split covers")
    calibration: list[str] = Field(description="sources whose rows are role: fit")
    validation: list[str] = Field(description="sources whose rows are role: validation")
    reasoning: str


class PublishedRuns(_Strict):
    sources: dict[str, Source]
    splits: dict[str, Split] = Field(default_factory=dict, description="per GPU family: calibration vs validation")
    runs: list[Run]
    memory_runs: list[Run] = Field(
        default_factory=list,
        description="layouts a source published memory for but no speed (compared in the memory table only)",
    )

    @model_validator(mode="after")
    def _known_sources(self) -> PublishedRuns:
        for r in self.runs:
            if r.published is None:
                raise ValueError(f"{r.id}: a run needs its published speed (memory-only rows go to memory_runs)")
        for r in self.memory_runs:
            if r.memory is None or r.published is not None:
                raise ValueError(f"{r.id}: a memory-only row has a published memory figure and no speed")
            if r.source not in self.sources:
                raise ValueError(f"{r.id}: unknown source {r.source!r}")
        ids = [r.id for r in self.runs + self.memory_runs]
        if len(set(ids)) != len(ids):
            raise ValueError("run ids must be unique")
        for r in self.runs:
            if r.source not in self.sources:
                raise ValueError(f"{r.id}: unknown source {r.source!r}")
        fitted_on = {src for sp in self.splits.values() for src in sp.calibration}
        for name, sp in self.splits.items():
            both = (set(sp.calibration) | fitted_on) & set(sp.validation)
            if both:
                raise ValueError(f"split {name}: sources {sorted(both)} are both calibration and validation")
            for r in self.runs:
                if r.gpu not in sp.gpus:
                    continue
                if r.source not in sp.calibration + sp.validation:
                    raise ValueError(f"{r.id}: source {r.source!r} is in neither list of split {name}")
                want = "fit" if r.source in sp.calibration else "validation"
                if r.role != want:
                    raise ValueError(f"{r.id}: split {name} puts source {r.source!r} in {want}, the row says {r.role}")
        return self


def load_runs(path: Path = RUNS_FILE) -> PublishedRuns:
    return PublishedRuns.model_validate(yaml.safe_load(path.read_text()))


def run_cluster(run: Run, efficiency: Efficiencies | None = None) -> ClusterSpec:
    """The run's cluster: its spec, with the facts the source publishes about its machine (and other
    efficiencies than the spec's, for bench/fit_published.py)."""
    base = load_cluster(run.gpu, 1)
    cluster = load_cluster(run.gpu, run.gpus // base.gpus_per_node)
    gpu_changes = {k: v for k, v in run.cluster_overrides.items() if k in ("memory_gib", "memory_bandwidth_gbps")}
    topo_changes = {k: v for k, v in run.cluster_overrides.items() if k == "inter_node_bandwidth_gbps"}
    if efficiency is not None:
        gpu_changes = {**gpu_changes, "efficiency": efficiency}
    gpu = cluster.gpu.model_copy(update=gpu_changes)
    topology = cluster.topology.model_copy(update=topo_changes)
    return cluster.model_copy(update={"gpu": gpu, "topology": topology})


def graph_key(run: Run) -> tuple:
    if run.hf is not None:
        return (run.model, run.hf.name, json.dumps(run.hf.config, sort_keys=True), run.hf.seq)
    return (run.model, tuple(sorted(run.model_args_full().items())), run.loss_fn)


def plan_run(
    run: Run, graphs: dict[tuple, ModelGraph] | None = None, efficiency: Efficiencies | None = None
) -> tuple[Plan, ClusterSpec]:
    """The run planned with its published layout pinned, on its cluster (graphs: a cache by model config)."""
    cluster = run_cluster(run, efficiency)
    request = run.request(cluster.gpus_per_node)
    graphs = {} if graphs is None else graphs
    key = graph_key(run)
    if key not in graphs:
        graphs[key] = analyse(request)
    graph = graphs[key]
    options = CostOptions.for_cluster(cluster, request.overlap_dp_comm, run.layout.overlap_param_gather)
    # as `planner plan` does: the search keeps the spec's memory reserve free, the plan shows the capacity
    result = search(
        graph,
        cluster.within_reserve(),
        request.global_batch_size,
        pins_from(request),
        options,
        None,
        request.top_k,
        None,
        block_recompute=True,  # as `planner plan` searches
    )
    return build_plan(graph, cluster, request, result, options), cluster


def predicted_iteration_s(run: Run, plan: Plan) -> float:
    """The plan's iteration time (a run that overlaps TP communication is planned with async TP, whose exposed
    part the cost model counts)."""
    return plan.predicted.iteration_time_s


def rank0_memory_gib(plan: Plan) -> tuple[float, float]:
    """(model states, activations) in GiB of pipeline rank 0, as `planner.cost.model.rank_memory` counts them
    (several stages per rank: the largest over the schedule's instants, `rank_peak_activations`), without the
    workspace, fragmentation and communication buffers that published per-GPU figures leave out."""
    from planner.cost.schedules import in_flight_microbatches, rank_peak_activations

    mine = sorted((s for s in plan.stages if s.pp_rank == 0), key=lambda s: s.index)
    states = sum(s.memory.weights + s.memory.gradients + s.memory.optimizer for s in mine)
    par = plan.parallel
    p, m, v = par.pp, par.num_micro_batches, par.virtual_stages
    if v > 1:
        per_mb = [s.memory.activations / max(1, in_flight_microbatches(par.schedule, p, m, v, s.index)) for s in mine]
        acts = rank_peak_activations(par.schedule, p, m, v, 0, per_mb)
    else:
        acts = sum(s.memory.activations for s in mine)
    return states / 2**30, acts / 2**30
