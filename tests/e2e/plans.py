"""Hand-built Plans for the sample models, so codegen can be tested without the solver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from planner.model.graph import ModelSource
from planner.plan import ClusterSummary, MemoryBreakdown, ParallelConfig, Plan, Predicted, StagePlan, TrainingConfig
from planner.runtime import stage_rank

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_MODELS = ROOT / "sample_models"
TINY_GPT = Path(__file__).resolve().with_name("tiny_gpt.py")

# Tiny sizes: a whole e2e case trains in seconds on a CPU.
TINY = {
    "gpt": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32},
    "llama": {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq": 32},
    "mlp": {"layers": 4, "width": 64, "in_dim": 16, "out_dim": 1},
    "tiny": {"layers": 4, "dim": 64, "heads": 4, "vocab": 256, "seq": 32},
}
CLASSES = {"gpt": "GPT", "llama": "Llama", "mlp": "MLP", "tiny": "TinyGPT"}
FILES = {"gpt": SAMPLE_MODELS / "gpt.py", "llama": SAMPLE_MODELS / "llama.py", "mlp": SAMPLE_MODELS / "mlp.py",
         "tiny": TINY_GPT}

# Partition units (module names) in execution order, as planner.model.units groups them.
_HEAD = {
    "gpt": ["tok_emb", "pos_emb", "drop"], "llama": ["tok_emb"], "mlp": ["proj_in"], "tiny": ["tok_emb", "pos_emb"],
}
_TAIL = {"gpt": ["norm", "head"], "llama": ["norm", "head"], "mlp": ["norm", "head"], "tiny": ["ln_f", "head"]}
# Tensor-parallel styles outside the blocks (vocabulary-parallel embeddings and head) and inside block N.
_TP_OUTSIDE = {
    "gpt": {"tok_emb": "rowwise", "pos_emb": "rowwise", "head": "colwise_gather"},
    "llama": {"tok_emb": "rowwise", "head": "colwise_gather"},
    "mlp": {},
    "tiny": {"tok_emb": "rowwise", "head": "colwise_gather"},
}
_TP = {
    "gpt": {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
            "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "llama": {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
              "mlp.w1": "colwise", "mlp.w3": "colwise", "mlp.w2": "rowwise"},
    "mlp": {"fc1": "colwise", "fc2": "rowwise"},
    "tiny": {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
             "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
}


def _zeros(cls: type[BaseModel], **given: Any) -> Any:
    """`cls` with `given` fields and every other required field zero: predictions do not matter here."""
    fields = {name: 0 for name, f in cls.model_fields.items() if f.is_required() and name not in given}
    return cls(**fields, **given)


def units(model: str, layers: int) -> list[list[str]]:
    return [_HEAD[model], *([f"blocks.{i}"] for i in range(layers)), _TAIL[model]]


def stage_ranks(schedule: str, pp: int, n_stages: int) -> list[int]:
    """Which pp rank runs each stage: a V for zero-bubble (ZBV), round-robin otherwise."""
    return [stage_rank(schedule, pp, i) for i in range(n_stages)]


def make_plan(
    model: str = "gpt",
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
    micro_batch_size: int = 2,
    num_micro_batches: int = 2,
    zero_stage: int = 0,
    sequence_parallel: bool = False,
    recompute: str = "none",
    full_blocks: int = 0,
    lr: float = 1e-2,
    model_args: dict | None = None,
    gpu: str = "cpu",
) -> Plan:
    """A valid Plan for a sample model, its units spread over pp * virtual_stages stages (`full_blocks`: each
    stage's first blocks recomputed fully, Megatron-LM's block method)."""
    args = dict(TINY[model] if model_args is None else model_args)
    path = FILES[model]
    n_stages = pp * virtual_stages
    groups = units(model, args.get("layers", 4))
    if n_stages > len(groups):
        raise ValueError(f"{model} has {len(groups)} units, fewer than {n_stages} stages")
    # Contiguous, near-equal runs of units per stage.
    bounds = [round(i * len(groups) / n_stages) for i in range(n_stages + 1)]
    ranks = stage_ranks(schedule, pp, n_stages)
    memory = _zeros(MemoryBreakdown)
    stages = []
    for i in range(n_stages):
        chunk = groups[bounds[i] : bounds[i + 1]]
        full = [m for g in chunk for m in g if m.startswith("blocks.")][:full_blocks]
        stages.append(
            _zeros(
                StagePlan, index=i, pp_rank=ranks[i], units=["+".join(g) for g in chunk],
                modules=[m for g in chunk for m in g], recompute=recompute, memory=memory,
                recompute_full_blocks=len(full), recompute_full_modules=full,
            )
        )
    tp_plan = {}
    if tp > 1:
        tp_plan.update(_TP_OUTSIDE[model])
        for i in range(args.get("layers", 4)):
            tp_plan.update({f"blocks.{i}.{name}": style for name, style in _TP[model].items()})
    return Plan(
        planner_version="test",
        inputs_digest="0" * 64,
        model=ModelSource(
            path=str(path), file_sha256="0" * 64, model_args=args, dtype="fp32",
            loss_fn=None if model == "tiny" else "loss_fn",
        ),
        model_class=CLASSES.get(model, model),
        trace_method="fx",
        cluster=ClusterSummary(name="local", gpu=gpu, nodes=1, gpus_per_node=dp * tp * pp),
        parallel=ParallelConfig(
            dp=dp, tp=tp, pp=pp, virtual_stages=virtual_stages, micro_batch_size=micro_batch_size,
            num_micro_batches=num_micro_batches, global_batch_size=dp * micro_batch_size * num_micro_batches,
            schedule=schedule, zero_stage=zero_stage, sequence_parallel=sequence_parallel,
        ),
        tp_plan=tp_plan,
        stages=stages,
        predicted=_zeros(Predicted, iteration_time_s=1.0, samples_per_s=1.0, memory_capacity_bytes=1),
        training=TrainingConfig(seed=0, lr=lr, steps=3, dtype="fp32"),
    )


def reference_of(plan: Plan) -> Plan:
    """The same training as one process: dp = tp = pp = 1, the global batch in the same micro-batches."""
    p = plan.parallel
    ref = make_plan(
        "gpt", micro_batch_size=p.micro_batch_size, num_micro_batches=p.dp * p.num_micro_batches,
        lr=plan.training.lr,
    )
    return ref.model_copy(
        update={
            "model": plan.model,
            "model_class": plan.model_class,
            "stages": [ref.stages[0].model_copy(update={"modules": [m for s in plan.stages for m in s.modules]})],
        }
    )


def ci_cases(cases: dict, kept: set[str]) -> list:
    """The parameters of a corpus of cases: those in `kept` run in CI; the others are marked `corpus` (another model
    through a path the kept ones already train), run with `python -m pytest -m corpus`."""
    assert kept <= set(cases), kept - set(cases)
    return [pytest.param(c) if c in kept else pytest.param(c, marks=pytest.mark.corpus) for c in cases]


def model_reads(path: str) -> list[str]:
    """The files a model file reads when imported (planner.model.reads, as `planner plan` records them), for
    scripts written from a Plan built here: a model that reaches its base model by a path from its own __file__
    (tests/fixtures/models/finetune_gpt.py) has it copied beside it."""
    from planner.model.reads import recording
    from planner.runtime.model import load_model_file

    with recording(Path(path).parent) as reads:
        load_model_file(path)
    return sorted(reads.files)
