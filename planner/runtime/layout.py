"""The validated description of one training job, built from the plan's constants in train.py.

Like torchtitan's ParallelDims: the objects check themselves when built, stating the rule, the values and the
fix, and expose derived facts (world size, which stages a pp rank runs, where a module lives) as properties,
so the rest of the runtime takes a `Layout` instead of reading globals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

from .errors import LayoutError
from .names import RECOMPUTE_MODES, SCHEDULES

# colwise_gather: a column-parallel Linear whose output is all-gathered (the vocab-parallel LM head);
# norm_heads: a norm over each head's features (Qwen3's q_norm), its input split by heads, its weight whole.
TPStyle = Literal["colwise", "rowwise", "colwise_gather", "norm_heads"]
# A fused projection's chunks (TP_FUSED): n equal ones (q | k | v split by `split(width)`), or the widths of its
# chunks in the model's order where the model takes them at fixed offsets (`qkv[..., :q_width]`; Phi-3's q, k
# and v of grouped-query attention, unequal): each chunk is split over tp on its own.
FusedChunks = int | list[int]


def chunk_widths(width: int, chunks: FusedChunks) -> list[int]:
    """The widths of a fused output's chunks: `chunks` equal ones, or the widths given (which must sum to it)."""
    if isinstance(chunks, list):
        if sum(chunks) != width or any(w <= 0 for w in chunks):
            raise ValueError(f"chunk widths {chunks} do not tile a width of {width}")
        return list(chunks)
    if chunks <= 0 or width % chunks:
        raise ValueError(f"{chunks} equal chunks do not tile a width of {width}")
    return [width // chunks] * chunks


def sizes_in_code(head_attrs: Mapping[str, Any], fused: Mapping[str, FusedChunks]) -> bool:
    """Whether the model's code holds sizes of the sharded dimension that a rank cannot take as they are: head
    counts read in forward (`head_attrs`), or fused chunks taken at fixed offsets (widths in `fused`). Under tp
    such a model runs as a traced graph whose sizes are made the rank's (tp_graph), never as written."""
    return bool(head_attrs) or any(isinstance(c, list) for c in fused.values())
TP_STYLES: tuple[str, ...] = get_args(TPStyle)
DTYPES = ("fp32", "bf16", "fp16")
LR_DECAYS = ("cosine", "linear", "constant")
_FIX = "Re-plan (planner plan ...) or correct the constant at the top of train.py."


_RANGE = re.compile(r"\{(\d+)-(\d+)\}")


def expand_names(name: str) -> list[str]:
    """The module names a plan constant stands for: "blocks.{0-3}.attn" is blocks.0.attn ... blocks.3.attn
    (train.py writes runs of numbered blocks this way to stay short); other names stand for themselves."""
    m = _RANGE.search(name)
    if m is None:
        return [name]
    lo, hi = int(m.group(1)), int(m.group(2))
    return [n for i in range(lo, hi + 1) for n in expand_names(name[: m.start()] + str(i) + name[m.end() :])]


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pp rank that runs pipeline stage `stage`: in a V for zero-bubble (ZBV: stage s on rank s for s < pp,
    on rank 2*pp-1-s after), round-robin (s % pp) for every other schedule, as torch's schedules place them."""
    if schedule != "zero-bubble":
        return stage % pp
    return stage if stage < pp else 2 * pp - 1 - stage


def runs_traced_graph(pp: int, tp: int, sequence_parallel: bool, head_counts: bool = False) -> bool:
    """Whether the script cuts a traced graph (pipeline stages, the rewrite sequence parallelism needs, or tp
    over attention that reads its head count or split width in forward: nanoGPT's `C // self.n_head` follows no
    divided attribute, so the graph's sizes are made the rank's, tp_graph) rather than running the user's model
    as written; the planner's search asks the same question."""
    return pp > 1 or (tp > 1 and (sequence_parallel or head_counts))


# plan.json's keys for the TPPlan's fields: the plan holds one TPPlan, its file keeps the flat keys it always had
TP_KEYS = {"tp_plan": "styles", "tp_head_attrs": "head_attrs", "tp_fused": "fused", "tp_transposed": "transposed",
           "tp_copied": "copied", "tp_summed": "summed", "tp_refused": "refused"}


class TPDecisions(Protocol):
    """What `TPPlan.of` reads of an analysis unit (planner.model.graph.Unit): its own TP decisions."""

    @property
    def tp_styles(self) -> Mapping[str, TPStyle]: ...
    @property
    def tp_head_attrs(self) -> Mapping[str, list[str]]: ...
    @property
    def tp_fused(self) -> Mapping[str, FusedChunks]: ...
    @property
    def tp_transposed(self) -> Sequence[str]: ...
    @property
    def tp_copied(self) -> Sequence[str]: ...
    @property
    def tp_summed(self) -> Sequence[str]: ...
    @property
    def tp_refused(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class TPPlan:
    """Which modules tensor parallelism shards, and how: the one home of that decision. Built once from the
    analysis' units (`of`, `planner.model.graph.ModelGraph.tp`), carried by the Plan (plan.json keeps its flat
    keys, tp_plan ... tp_refused; tp_copied only where some module is copied), and consumed whole by the
    runtime's `Layout`: train.py and `parallelize` rebuild it from those keys. Module names may stand for runs of
    numbered blocks ("blocks.{0-3}.attn", `expand_names`), as train.py writes them; the plan holds them expanded."""

    # the Plan (pydantic) validates this dataclass as one of its fields: no keys beyond these
    __pydantic_config__ = {"extra": "forbid"}

    styles: dict[str, TPStyle] = field(default_factory=dict)  # module -> its TP style (TP_PLAN)
    # module -> integer attributes (head counts, split widths) each rank divides by tp before sharding, because
    # its forward reshapes by them (view(b, s, self.num_heads, -1)) (TP_HEAD_ATTRS)
    head_attrs: dict[str, list[str]] = field(default_factory=dict)
    fused: dict[str, FusedChunks] = field(default_factory=dict)  # colwise module -> its fused output's chunks
    transposed: list[str] = field(default_factory=list)  # TP modules whose weight is stored [in, out] (HF Conv1D)
    # row-parallel modules whose output the model changes in place (`out += residual`): given as a copy (TP_COPIED)
    copied: list[str] = field(default_factory=list)
    # weights held whole, broadcast over the sharded heads (a learned scale over head_dim): their gradient, each
    # rank's heads' share, is summed over tp after the backward (TP_SUMMED)
    summed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # projections TP leaves replicated, and why (plan only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "styles", {n: s for k, s in self.styles.items() for n in expand_names(k)})
        heads = {n: list(v) for k, v in self.head_attrs.items() for n in expand_names(k)}
        object.__setattr__(self, "head_attrs", heads)
        object.__setattr__(self, "fused", {n: c for k, c in self.fused.items() for n in expand_names(k)})
        object.__setattr__(self, "transposed", [n for k in self.transposed for n in expand_names(k)])
        object.__setattr__(self, "copied", [n for k in self.copied for n in expand_names(k)])
        object.__setattr__(self, "summed", [n for k in self.summed for n in expand_names(k)])
        object.__setattr__(self, "refused", list(self.refused))
        for name, style in self.styles.items():
            if style not in TP_STYLES:
                raise LayoutError(
                    f"TP_PLAN gives {name} the style {style!r}: expected one of {', '.join(TP_STYLES)}. {_FIX}"
                )

    @classmethod
    def from_keys(cls, data: Mapping[str, Any]) -> TPPlan:
        """The TPPlan a plan.json (or its layout.json) holds under its flat keys (`TP_KEYS`)."""
        return cls(**{f: data[key] for key, f in TP_KEYS.items() if key in data})

    @classmethod
    def of(cls, units: Iterable[TPDecisions]) -> TPPlan:
        """The units' TP decisions (`Unit.tp_styles` ... `Unit.tp_refused`) as one plan: names sorted, the
        reasons for a refusal in the order the units give them, each once."""
        styles: dict[str, TPStyle] = {}
        head_attrs: dict[str, list[str]] = {}
        fused: dict[str, FusedChunks] = {}
        transposed: set[str] = set()
        copied: set[str] = set()
        summed: set[str] = set()
        refused: list[str] = []
        for u in units:
            styles.update(u.tp_styles)
            head_attrs.update(u.tp_head_attrs)
            fused.update(u.tp_fused)
            transposed.update(u.tp_transposed)
            copied.update(u.tp_copied)
            summed.update(u.tp_summed)
            refused.extend(r for r in u.tp_refused if r not in refused)
        return cls(
            styles=dict(sorted(styles.items())),
            head_attrs=dict(sorted(head_attrs.items())),
            fused=dict(sorted(fused.items())),
            transposed=sorted(transposed),
            copied=sorted(copied),
            summed=sorted(summed),
            refused=refused,
        )


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the pp rank holding it, the modules it owns (qualified names), its recompute, and the
    modules of its first blocks recomputed fully whatever its recompute (Megatron-LM's block method; plan.json's
    recompute_full_modules)."""

    pp_rank: int
    modules: tuple[str, ...]
    recompute: str = "none"
    full: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFile:
    """The user's model file and the names of its functions (the model-file contract)."""

    path: str
    build_fn: str = "build_model"
    inputs_fn: str = "example_inputs"
    loss_fn: str | None = None  # None: default_loss
    batch_fn: str | None = None  # None: synthetic batches from inputs_fn
    model_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Training:
    seed: int = 0
    lr: float = 1e-3
    steps: int = 10
    dtype: str = "bf16"  # bf16 / fp16: mixed precision on GPUs (fp16 with dynamic loss scaling); CPU runs use fp32
    # AdamW and its schedule: linear warm-up over warmup_steps, then lr_decay down to lr * min_lr_ratio.
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_decay: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0  # max global gradient norm; None: no clipping
    checkpoint_every: int = 1000  # steps between checkpoints (0: only at the end)
    data_file: str | None = None  # a flat binary file of token ids (relative: to train.py's folder); None: batches
    data_dtype: str = "uint16"  # of the model file

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.dtype not in DTYPES:
            raise LayoutError(f"DTYPE must be one of {', '.join(DTYPES)}, got {self.dtype!r}. {_FIX}")
        if self.steps < 0:
            raise LayoutError(f"STEPS must be 0 or more, got {self.steps}. {_FIX}")
        if self.lr_decay not in LR_DECAYS:
            raise LayoutError(f"LR_DECAY must be one of {', '.join(LR_DECAYS)}, got {self.lr_decay!r}. {_FIX}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise LayoutError(
                f"WARMUP_STEPS and CHECKPOINT_EVERY must be 0 or more, got {self.warmup_steps} and "
                f"{self.checkpoint_every}. {_FIX}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise LayoutError(f"MIN_LR_RATIO must be within [0, 1], got {self.min_lr_ratio}. {_FIX}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise LayoutError(f"BETAS must be two numbers in [0, 1), got {self.betas}. {_FIX}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise LayoutError(f"GRAD_CLIP must be positive or None (no clipping), got {self.grad_clip}. {_FIX}")


@dataclass(frozen=True)
class Layout:
    """Degrees, batch layout, schedule and the stages of a plan. World size = pp * dp * cp * tp."""

    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    num_micro_batches: int  # per data-parallel replica
    stages: tuple[Stage, ...]
    virtual_stages: int = 1  # pipeline stages per pp rank
    schedule: str = "1f1b"
    zero_stage: int = 0  # 0: replicate (DDP), 1/2: FSDP2 keeping weights gathered in forward, 3: FSDP2
    sequence_parallel: bool = False
    mesh_dims: tuple[str, ...] = ("pp", "dp", "tp")  # outer to inner
    global_batch_size: int | None = None  # None: dp * num_micro_batches * micro_batch_size
    tp_plan: TPPlan = field(default_factory=TPPlan)  # which modules TP shards, and how (the plan's one object)
    ep: int = 1  # expert parallelism: experts sharded over groups of ep consecutive dp ranks
    experts: dict[str, int] = field(default_factory=dict)  # MoE experts module -> number of experts
    cp: int = 1  # context parallelism: each sample's sequence sharded over cp ranks (mesh dimension "cp")
    async_tp: bool = False  # torch's async TP: SP's collectives overlapped with the matmuls (compile, CUDA)
    # The vocabulary-parallel LM heads (colwise_gather) whose logits stay split by vocabulary for loss parallelism:
    # set by the runtime where the loss is the next-token cross-entropy on them (vocab.with_loss_parallel), never
    # by train.py's constants.
    sharded_heads: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # Stages may come as plain lists/tuples from the plan's constants.
        stages = tuple(s if isinstance(s, Stage) else Stage(s[0], tuple(s[1]), *s[2:]) for s in self.stages)
        stages = tuple(
            Stage(
                s.pp_rank,
                tuple(n for m in s.modules for n in expand_names(m)),
                s.recompute,
                tuple(n for m in s.full for n in expand_names(m)),
            )
            for s in stages
        )
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "mesh_dims", tuple(self.mesh_dims))
        if not isinstance(self.tp_plan, TPPlan):
            raise LayoutError(f"TP_PLAN must come as a TPPlan, got {type(self.tp_plan).__name__}. {_FIX}")
        object.__setattr__(self, "experts", {n: c for k, c in self.experts.items() for n in expand_names(k)})
        for name in ("pp", "dp", "tp", "virtual_stages", "micro_batch_size", "num_micro_batches", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name.upper()} must be a positive integer, got {value!r}. {_FIX}")
        if self.cp > 1:
            if sorted(self.mesh_dims) != ["cp", "dp", "pp", "tp"]:
                raise LayoutError(
                    f"With CP ({self.cp}) MESH_DIMS must order 'pp', 'dp', 'cp' and 'tp', got {list(self.mesh_dims)}. "
                    f"{_FIX}"
                )
            if self.ep > 1 or self.async_tp or (self.pp > 1 and self.schedule == "zero-bubble"):
                raise LayoutError(
                    f"CP ({self.cp}) runs without expert parallelism, async TP and the zero-bubble schedule (the "
                    f"planner refuses each, with the reason). {_FIX}"
                )
        elif sorted(self.mesh_dims) != ["dp", "pp", "tp"]:
            raise LayoutError(f"MESH_DIMS must order 'pp', 'dp' and 'tp', got {list(self.mesh_dims)}. {_FIX}")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"Unknown schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}. {_FIX}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"ZERO_STAGE must be 0, 1, 2 or 3, got {self.zero_stage!r}. {_FIX}")
        if self.async_tp and not (self.tp > 1 and self.sequence_parallel):
            raise LayoutError(
                f"ASYNC_TP overlaps sequence parallelism's collectives with the matmuls: it needs TP > 1 (got "
                f"{self.tp}) and SEQUENCE_PARALLEL = True (got {self.sequence_parallel}). {_FIX}"
            )
        if self.pp == 1 and self.virtual_stages != 1:
            raise LayoutError(
                f"Without a pipeline (PP = 1) there is one stage: VIRTUAL_STAGES must be 1, got "
                f"{self.virtual_stages}. {_FIX}"
            )
        if self.global_batch_size is not None and self.global_batch_size != self.samples_per_step:
            raise LayoutError(
                f"GLOBAL_BATCH_SIZE ({self.global_batch_size}) must equal DP ({self.dp}) x NUM_MICRO_BATCHES "
                f"({self.num_micro_batches}) x MICRO_BATCH_SIZE ({self.micro_batch_size}) = "
                f"{self.samples_per_step}. {_FIX}"
            )
        if len(self.stages) != self.num_stages:
            raise LayoutError(
                f"The plan has {len(self.stages)} stage(s), but PP ({self.pp}) x VIRTUAL_STAGES "
                f"({self.virtual_stages}) = {self.num_stages}. {_FIX}"
            )
        seen: dict[str, int] = {}
        for i, stage in enumerate(self.stages):
            if not stage.modules:
                raise LayoutError(f"Stage {i} owns no modules: every stage needs at least one. {_FIX}")
            if stage.recompute not in RECOMPUTE_MODES:
                raise LayoutError(
                    f"Stage {i} has recompute {stage.recompute!r}: expected one of {', '.join(RECOMPUTE_MODES)}. {_FIX}"
                )
            if stage.full and stage.recompute == "full":
                raise LayoutError(
                    f"Stage {i} recomputes every unit fully (recompute 'full'), so it names no blocks recomputed "
                    f"fully apart. {_FIX}"
                )
            stray = sorted(set(stage.full) - set(stage.modules))
            if stray:
                raise LayoutError(
                    f"Stage {i} recomputes {stray} fully, but does not own them: a stage recomputes its own blocks. "
                    f"{_FIX}"
                )
            want = stage_rank(self.schedule, self.pp, i)
            if stage.pp_rank != want:
                raise LayoutError(
                    f"Stage {i} is on pp rank {stage.pp_rank}, but schedule {self.schedule} runs it on pp rank "
                    f"{want}. {_FIX}"
                )
            for m in stage.modules:
                if m in seen:
                    raise LayoutError(f"Module {m!r} is in stages {seen[m]} and {i}: a module has one owner. {_FIX}")
                seen[m] = i
        self._check_ep()

    def _check_ep(self) -> None:
        if self.ep == 1:
            return
        if self.dp % self.ep:
            raise LayoutError(
                f"EP ({self.ep}) must divide DP ({self.dp}): experts are sharded over a sub-group of the "
                f"data-parallel ranks. {_FIX}"
            )
        if self.tp > 1:
            raise LayoutError(
                f"EP ({self.ep}) runs without tensor parallelism (TP = 1): the experts' slices are not TP-sharded; "
                f"this plan has TP {self.tp}. {_FIX}"
            )
        if self.pp > 1 and self.schedule == "zero-bubble":
            raise LayoutError(
                f"EP ({self.ep}) cannot run under the zero-bubble schedule: its split backward frees the "
                f"experts' all-to-all saved tensors after the input-gradient pass. Use 1f1b. {_FIX}"
            )
        if self.mesh_dims != ("pp", "dp", "tp"):
            raise LayoutError(f"EP needs MESH_DIMS ('pp', 'dp', 'tp'), got {list(self.mesh_dims)}. {_FIX}")
        if not self.experts:
            raise LayoutError(f"EP ({self.ep}) is set but EXPERTS names no experts module to shard. {_FIX}")
        for name, count in self.experts.items():
            if not isinstance(count, int) or count < 1 or count % self.ep:
                raise LayoutError(
                    f"EXPERTS gives {name} {count!r} experts, which EP ({self.ep}) does not divide: each rank "
                    f"holds whole experts. {_FIX}"
                )

    # Derived facts.
    @property
    def loss_parallel(self) -> bool:
        return bool(self.sharded_heads)

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1


    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def samples_per_step(self) -> int:
        return self.dp * self.num_micro_batches * self.micro_batch_size

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sums_over_tp(self) -> bool:
        """Whether some weight's gradient is summed over tp after the backward (TPPlan.summed)."""
        return self.tp_enabled and bool(self.tp_plan.summed)

    @property
    def sp_enabled(self) -> bool:
        """Sequence parallelism runs only with tensor parallelism."""
        return self.sequence_parallel and self.tp > 1

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "cp": self.cp}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in self.mesh_dims)

    @property
    def stage_of_module(self) -> dict[str, int]:
        """Module name -> the index of the stage that owns it."""
        return {m: i for i, s in enumerate(self.stages) for m in s.modules}

    def stages_on(self, pp_rank: int) -> list[int]:
        """The stage indices pp rank `pp_rank` runs, in pipeline order."""
        return [i for i, s in enumerate(self.stages) if s.pp_rank == pp_rank]

    def describe(self) -> dict[str, Any]:
        """The layout as metrics.json records it."""
        return {
            "world_size": self.world_size,
            "pp": self.pp,
            "dp": self.dp,
            "tp": self.tp,
            "virtual_stages": self.virtual_stages,
            "schedule": self.schedule,
            "zero_stage": self.zero_stage,
            "sequence_parallel": self.sequence_parallel,
            "ep": self.ep,
            **({"cp": self.cp} if self.cp > 1 else {}),
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "global_batch_size": self.samples_per_step,
        }


def read_layout_file(path: Any, digest: str) -> tuple[list[Any], dict[str, str], dict[str, list[str]]]:
    """STAGES, TP_PLAN and TP_HEAD_ATTRS from the layout.json that `planner emit` writes beside train.py
    when the plan's module lists are too long to read as constants there; refused if its sha256 differs from
    the one train.py records (an edited or foreign file would train something the plan did not cost)."""
    import hashlib
    import json
    from pathlib import Path

    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as e:
        raise LayoutError(
            f"{file} cannot be read ({e.strerror}): train.py takes its stages from it. Regenerate the scripts "
            "with `planner emit plan.json --out DIR`."
        ) from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise LayoutError(
            f"{file} differs from the one this train.py was generated with: the stages must match the plan. "
            "Regenerate the scripts with `planner emit plan.json --out DIR`, or restore the file."
        )
    layout = json.loads(data)
    return [tuple(s) for s in layout["stages"]], dict(layout["tp_plan"]), dict(layout["tp_head_attrs"])
