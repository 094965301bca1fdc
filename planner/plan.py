"""The Plan schema (plan.json): everything codegen and the report need, and nothing executable.

A plan is data only: it is validated on load and never pickled or exec'd. Its schema version is
checked so that an old plan is refused with a clear message instead of being misread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

from planner.errors import PlanError
from planner.model.graph import ModelSource, TPPlan
from planner.names import Recompute, Schedule, SearchStatus
from planner.runtime.layout import TP_KEYS

SCHEMA_VERSION = 1
# Minor versions add fields with defaults that keep older plans' meaning, so a plan of an older minor loads
# (a missing field takes its default); one of a newer minor may hold fields this planner ignores: refused.
# 1: expert parallelism (parallel.ep, experts, predicted.comm.expert_parallel_s).
# 2: the TP style norm_heads.
# 3: trace_method "fx-meta" (symbolic tracing with meta values).
# 4: context parallelism (parallel.cp, predicted.comm.context_parallel_s; written only where cp > 1, and only such
#    a plan records minor 4, so plans without it stay as minor 3 wrote them).
# 5: block recomputation (stages' recompute_full_blocks and recompute_full_modules, alternatives'
#    recompute_full_blocks; written only where some stage recomputes blocks, and only such a plan records minor 5).
# 6: tp_copied (row-parallel modules whose output the model changes in place, given as a copy), and tp_fused values
#    that list chunk widths (chunks taken at fixed offsets); only a plan holding either records minor 6.
# 7: tp_summed (weights held whole, broadcast over the sharded heads, their gradient summed over tp); only a plan
#    holding one records minor 7.
SCHEMA_MINOR = 7
# The minor a plan without context parallelism records (nothing of minor 4 in it).
_MINOR_WITHOUT_CP = 3

Source = Literal["measured", "estimated"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A predicted time, rate or fraction: a finite number >= 0 (NaN or inf would print as invalid JSON and
# mean nothing; a negative time is a corrupted file).
Figure = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Bytes = Annotated[int, Field(ge=0)]


class ParallelConfig(_Model):
    """Degrees and batch layout. World size is dp * tp * pp; tp stays inside a node."""

    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    virtual_stages: int = Field(1, ge=1, description="pipeline stages per pp rank (interleaving)")
    micro_batch_size: int = Field(ge=1)
    num_micro_batches: int = Field(ge=1, description="micro-batches per data-parallel replica")
    global_batch_size: int = Field(ge=1)
    schedule: Schedule = "1f1b"
    zero_stage: int = Field(0, ge=0, le=3, description="0: DDP, 1/2: sharded optimizer/grads, 3: FSDP")
    sequence_parallel: bool = False
    ep: int = Field(1, ge=1, description="expert parallelism: each MoE layer's experts sharded over ep dp ranks")
    cp: int = Field(
        1, ge=1, exclude_if=lambda v: v == 1,
        description="context parallelism: each sample's sequence sharded over cp ranks holding the same weights "
        "(world = dp x cp x tp x pp; gradients averaged over dp x cp); written only where > 1",
    )
    mesh_dims: list[str] = Field(default_factory=lambda: ["pp", "dp", "tp"], description="outer to inner")
    tp_overlap: bool = Field(
        False, description="torch's async TP: sequence parallelism's collectives overlapped with the matmuls "
        "(torch.compile, CUDA symmetric memory)"
    )

    @model_serializer(mode="wrap")
    def _without_defaults_added_later(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Fields added after plan.json's layout settled are written only when set, so earlier plans' files
        (and their digests) stay byte-identical."""
        out: dict[str, Any] = handler(self)
        if not self.tp_overlap:
            out.pop("tp_overlap", None)
        return out

    @model_validator(mode="after")
    def _consistent(self) -> ParallelConfig:
        if self.dp * self.micro_batch_size * self.num_micro_batches != self.global_batch_size:
            raise ValueError(
                f"dp ({self.dp}) x micro_batch_size ({self.micro_batch_size}) x num_micro_batches "
                f"({self.num_micro_batches}) must equal global_batch_size ({self.global_batch_size})"
            )
        if self.dp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp ({self.dp}): experts are sharded over dp ranks")
        if sorted(self.mesh_dims) != sorted(["pp", "dp", "tp"] + (["cp"] if self.cp > 1 else [])):
            raise ValueError(f"mesh_dims {self.mesh_dims} must order pp, dp, tp (and cp where cp > 1)")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise ValueError("interleaved-1f1b needs virtual_stages >= 2")
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            raise ValueError(f"schedule {self.schedule} takes one stage per rank (virtual_stages=1)")
        if self.schedule == "zero-bubble" and self.virtual_stages != 2:
            raise ValueError("zero-bubble (ZBV) places two stages per rank in a V: virtual_stages must be 2")
        if self.tp_overlap and not (self.tp > 1 and self.sequence_parallel):
            raise ValueError("tp_overlap (async TP) needs tp > 1 with sequence_parallel")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages


class MemoryBreakdown(_Model):
    """Bytes per GPU held by one stage's rank."""

    weights: Bytes
    gradients: Bytes
    optimizer: Bytes
    activations: Bytes
    comm_buffers: Bytes
    workspace: Bytes = Field(description="allocator fragmentation and kernel workspace allowance")

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.comm_buffers + self.workspace


def recompute_label(mode: str, full_blocks: int) -> str:
    """A stage's recomputation as the report prints it: "selective", or "full x3 + selective" where its first
    3 blocks are recomputed fully."""
    return f"full x{full_blocks} + {mode}" if full_blocks else mode


class StagePlan(_Model):
    """One pipeline stage: which units it owns, on which pp rank, and its predicted cost."""

    index: int = Field(ge=0, description="position in the pipeline, 0 = first")
    pp_rank: int = Field(ge=0)
    units: list[str]
    modules: list[str] = Field(description="qualified module names owned by the stage")
    recompute: Recompute = "none"
    recompute_full_blocks: int = Field(
        0, ge=0, exclude_if=lambda v: v == 0,
        description="Megatron-LM's block method: the stage's first N blocks recomputed fully, the rest at "
        "`recompute` (--recompute-method block --recompute-num-layers N); written only where > 0",
    )
    recompute_full_modules: list[str] = Field(
        default_factory=list, exclude_if=lambda v: not v,
        description="the modules of those blocks (what the script checkpoints fully); written only where any",
    )
    forward_time_s: Figure = Field(description="per micro-batch, including TP communication")
    backward_time_s: Figure = Field(description="per micro-batch, including recomputation and TP comm")
    p2p_time_s: Figure = Field(0.0, description="send of activations (fwd) or gradients (bwd), each way")
    compute_time_s: Figure = Field(description="forward + backward per micro-batch")
    memory_bytes: Bytes
    memory: MemoryBreakdown
    source: Source = "estimated"

    @model_validator(mode="after")
    def _full_blocks_named(self) -> StagePlan:
        if bool(self.recompute_full_blocks) != bool(self.recompute_full_modules):
            raise ValueError(
                f"stage {self.index}: recompute_full_blocks ({self.recompute_full_blocks}) and recompute_full_modules "
                f"({len(self.recompute_full_modules)} module(s)) must both be set or both be left out"
            )
        if self.recompute_full_blocks and self.recompute == "full":
            raise ValueError(f"stage {self.index}: recompute full recomputes every block; recompute_full_blocks is 0")
        stray = sorted(set(self.recompute_full_modules) - set(self.modules))
        if stray:
            raise ValueError(f"stage {self.index}: recompute_full_modules {stray} are not among the stage's modules")
        return self

    @property
    def recompute_label(self) -> str:
        """The stage's recomputation as the report prints it (`recompute_label`)."""
        return recompute_label(self.recompute, self.recompute_full_blocks)


class CommBreakdown(_Model):
    """Seconds per iteration spent in each kind of communication (exposed, i.e. not overlapped)."""

    tensor_parallel_s: Figure = 0.0
    pipeline_p2p_s: Figure = 0.0
    data_parallel_s: Figure = 0.0
    data_parallel_exposed_s: Figure = 0.0
    expert_parallel_s: Figure = Field(0.0, description="MoE all-to-all dispatch and combine, forward and backward")
    context_parallel_s: Figure = Field(
        0.0, exclude_if=lambda v: v == 0, description="context parallelism's key/value all-gathers (forward) and "
        "reduce-scatters of their gradients (backward); written only where > 0"
    )


class Predicted(_Model):
    iteration_time_s: Figure
    samples_per_s: Figure
    tokens_per_s: Figure | None = None
    model_tflops_per_gpu: Figure = Field(description="model FLOPs (no recomputation) per second per GPU")
    hardware_tflops_per_gpu: Figure = Field(description="FLOPs executed per second per GPU, recomputation included")
    mfu: Figure
    peak_memory_bytes: Bytes
    memory_capacity_bytes: Bytes
    memory_reserve_bytes: Bytes = Field(0, description="memory per GPU every plan keeps free (CUDA context, NCCL, ...)")
    attention_backend: str = Field(
        "flash", description="the SDPA backend whose saved tensors the activation memory counts (the GPU spec's)"
    )
    bubble_fraction: Figure
    comm: CommBreakdown = CommBreakdown()
    source: Source = "estimated"


class Alternative(_Model):
    """A runner-up configuration with its predicted figures."""

    parallel: ParallelConfig
    recompute: list[Recompute]
    recompute_full_blocks: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, exclude_if=lambda v: not v,
        description="per stage, its first blocks recomputed fully (StagePlan.recompute_full_blocks); written only "
        "where any stage has some",
    )
    predicted: Predicted
    note: str = ""

    @model_validator(mode="after")
    def _one_count_per_stage(self) -> Alternative:
        if self.recompute_full_blocks and len(self.recompute_full_blocks) != len(self.recompute):
            raise ValueError(
                f"recompute_full_blocks holds {len(self.recompute_full_blocks)} counts for {len(self.recompute)} "
                "stages: one per stage"
            )
        return self


class Rejection(_Model):
    """A region of the search space that was ruled out, with why and how many candidates it held."""

    region: str
    reason: str
    count: int = 1


class ClusterSummary(_Model):
    name: str
    gpu: str
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)


class TrainingConfig(_Model):
    """Knobs of the generated training script (not searched)."""

    seed: int = 0
    lr: float = Field(1e-4, gt=0, allow_inf_nan=False)
    steps: int = Field(10, ge=1)
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    # the checkpoint the weights start from (train.py's INIT_FROM; None: the model's own initialisation)
    init_from: str | None = None


class SearchStats(_Model):
    candidates: int = 0
    pruned_by_bound: int = 0
    ilps_solved: int = 0
    status: SearchStatus = "optimal"
    gap: float = 0.0
    # relative gap of the chosen plan's iteration time to the least valid lower bound on that figure of a
    # candidate the search did not settle for it (planner.search.search.SearchResult.reported_gap)
    reported_gap: float = 0.0


_TP_PLAN = TypeAdapter(TPPlan)


def _tp_plan_of(fields: dict[str, Any]) -> TPPlan:
    """The TPPlan of plan.json's flat keys, checked as strictly as the rest of a plan (JSON types as written:
    a plan validates strictly, where pydantic takes a dataclass only as an instance)."""
    try:
        return _TP_PLAN.validate_json(json.dumps(fields), strict=True)
    except TypeError as e:
        raise ValueError(f"the tp_* keys hold a value that is not JSON: {e}") from None
    except ValidationError as e:
        errs = e.errors()
        err = errs[0]
        key = {f: k for k, f in TP_KEYS.items()}.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else "tp"
        # a union's member is not where the value is (tp_fused: a chunk count or a list of widths)
        loc = [str(x) for x in err["loc"][1:] if str(x) not in ("int", "list[int]")]
        where = ".".join([key, *loc])
        if key == "tp_fused" and len(errs) > 1:
            raise ValueError(f"{where}: a number of equal chunks or a list of chunk widths (numbers)") from None
        raise ValueError(f"{where}: {err['msg']}") from None


class Plan(_Model):
    schema_version: int = SCHEMA_VERSION
    schema_minor: int = Field(_MINOR_WITHOUT_CP, ge=0, description="raised to 4 where a layout has cp > 1")
    planner_version: str
    inputs_digest: str = Field(description="sha256 of the model source, cluster and options")
    model: ModelSource
    model_class: str
    total_params: int = Field(0, description="parameters of the whole model")
    trace_method: Literal["fx", "fx-meta", "export"]
    tokens_per_sample: int | None = None
    cluster: ClusterSummary
    parallel: ParallelConfig
    tp: TPPlan = Field(default_factory=TPPlan, description="which modules TP shards (plan.json: TP_KEYS)")
    experts: dict[str, int] = Field(
        default_factory=dict, description="MoE experts module -> its number of experts (what ep shards)"
    )
    source_spec: str | None = Field(None, description="model source compiled into model_source.py (hf:NAME)")
    source_settings: dict[str, Any] = Field(default_factory=dict, description="settings that source applies")
    structure: list[str] = Field(
        default_factory=list, description="the repeated blocks found and where, e.g. '12 x GPT2Block in transformer.h'"
    )
    stages: list[StagePlan]
    predicted: Predicted
    alternatives: list[Alternative] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)
    training: TrainingConfig = TrainingConfig()
    search: SearchStats = SearchStats()
    created_at: str | None = Field(None, description="only when asked for (--timestamp)")

    @model_validator(mode="before")
    @classmethod
    def _tp_of_keys(cls, data: Any) -> Any:
        """plan.json's flat tp_* keys (TP_KEYS) gathered into the one TPPlan."""
        if isinstance(data, dict) and any(key in data for key in TP_KEYS):
            data = dict(data)
            if "tp" in data:
                raise ValueError(f"a plan holds its TP decision as 'tp' or as {', '.join(TP_KEYS)}, not both")
            flat = {field: data.pop(key) for key, field in TP_KEYS.items() if key in data}
            data["tp"] = _tp_plan_of(flat)
        return data

    @model_serializer(mode="wrap")
    def _tp_as_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The TPPlan written under plan.json's flat keys (TP_KEYS), as plans always held it."""
        out: dict[str, Any] = handler(self)
        tp = out.pop("tp", None)
        if isinstance(tp, dict):
            out.update({key: tp[field] for key, field in TP_KEYS.items() if field in tp})
            # written where there is one (schema minors 6 and 7): other plans as they were
            for key in ("tp_copied", "tp_summed"):
                if not out.get(key):
                    out.pop(key, None)
        return out

    @model_validator(mode="after")
    def _stages_match(self) -> Plan:
        p, c = self.parallel, self.cluster
        if len(self.stages) != p.num_stages:
            raise ValueError(f"plan has {len(self.stages)} stages but pp x virtual_stages = {p.num_stages}")
        gpus = c.nodes * c.gpus_per_node
        layouts = [("parallel", p)] + [(f"alternatives.{i}", a.parallel) for i, a in enumerate(self.alternatives)]
        for what, par in layouts:
            if par.world_size != gpus:
                cp = f" x cp {par.cp}" if par.cp > 1 else ""
                raise ValueError(
                    f"{what}: dp {par.dp}{cp} x tp {par.tp} x pp {par.pp} = {par.world_size}, but the cluster has "
                    f"{c.nodes} node(s) x {c.gpus_per_node} = {gpus} GPUs"
                )
        if any(par.cp > 1 for _, par in layouts):
            self.schema_minor = max(self.schema_minor, 4)  # an older planner must refuse what it cannot read
        if any(s.recompute_full_blocks for s in self.stages) or any(a.recompute_full_blocks for a in self.alternatives):
            self.schema_minor = max(self.schema_minor, 5)
        if self.tp.copied or any(isinstance(c, list) for c in self.tp.fused.values()):
            self.schema_minor = max(self.schema_minor, 6)
        if self.tp.summed:
            self.schema_minor = max(self.schema_minor, 7)
        indices = sorted(s.index for s in self.stages)
        if indices != list(range(len(self.stages))):
            raise ValueError(f"stage indices {indices} are not 0..{len(self.stages) - 1}, each once")
        bad = [s.index for s in self.stages if s.pp_rank >= p.pp]
        if bad:
            raise ValueError(f"stage(s) {bad} sit on a pp_rank >= pp ({p.pp})")
        return self

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, two-space indent, trailing newline (byte-identical for equal plans).

        Strict JSON: a NaN or infinity (which the validators keep out) raises instead of printing `NaN`.
        """
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=2, allow_nan=False) + "\n"


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook refusing a key given twice in one object."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_plan(path: str | Path) -> Plan:
    """Read and validate plan.json (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    if not p.is_file():
        raise PlanError(f"No plan found at {p}. Pass a plan.json file or the directory `planner plan --out` wrote.")
    try:
        raw: Any = json.loads(p.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise PlanError(
            f"{p} gives the key {e.key!r} twice in one object; JSON readers disagree on which one counts (Python's "
            "keeps the last), so the plan is refused. Keep one of them, or regenerate the plan with `planner plan`."
        ) from None
    except ValueError as e:  # JSONDecodeError, and an integer longer than Python converts (4300 digits)
        raise PlanError(f"{p} is not valid JSON ({str(e)[:200]}). Regenerate it with `planner plan`.") from None
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        raise PlanError(f"{p} is not valid JSON ({e}). Regenerate it with `planner plan`.") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{p} does not hold a JSON object. Regenerate it with `planner plan`.")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(
            f"{p} has schema_version {version!r}, this planner reads version {SCHEMA_VERSION}. "
            "Regenerate the plan with this planner (`planner plan ...`)."
        )
    minor = raw.get("schema_minor", 0)
    if isinstance(minor, int) and minor > SCHEMA_MINOR:
        raise PlanError(
            f"{p} has schema {version}.{minor}, newer than this planner's {SCHEMA_VERSION}.{SCHEMA_MINOR}: it may "
            "hold settings this planner would ignore. Upgrade the planner or regenerate the plan with this one."
        )
    try:
        # strict: JSON types as written (`tp: true` or `"steps": "10"` are errors, not coerced)
        return Plan.model_validate(raw, strict=True)
    except RecursionError:
        raise PlanError(f"{p} is nested too deeply to be a plan. Regenerate it with `planner plan`.") from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise PlanError(
            f"{p} is not a valid plan: {where}: {first['msg']} ({e.error_count()} problem(s)). "
            "Regenerate it with `planner plan` rather than editing it by hand."
        ) from None
