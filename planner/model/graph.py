"""Schemas for a loaded and traced model: the source it came from and its partition units.

All per-sample figures are counted at batch size 1 with the model's sequence length, in the training
dtype, on the meta device; the cost model scales them by the micro-batch size.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The TP decision's one object, defined in the runtime (which imports nothing of the planner) so that the Plan
# carries and the runtime's Layout consumes the same frozen TPPlan.
from planner.runtime.layout import TPPlan as TPPlan
from planner.runtime.layout import TPStyle as TPStyle

TrainDType = Literal["fp32", "bf16", "fp16"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSource(_Model):
    """Where a model comes from: a file following the model-file contract, plus its arguments."""

    path: str = Field(description="absolute path of the model file")
    file_sha256: str = Field(description="digest of the file's bytes, so plans notice edits")
    build_fn: str = "build_model"
    inputs_fn: str = "example_inputs"
    loss_fn: str | None = Field(None, description="name of loss_fn in the file, if it defines one")
    batch_fn: str | None = Field(None, description="name of get_batch(step, micro_batch_size), if defined")
    model_args: dict[str, Any] = Field(default_factory=dict)
    dtype: TrainDType = "bf16"


class GemmShape(_Model):
    """One Linear call of a unit, the GEMM tokens x in_features x out_features per sample, and how tensor
    parallelism splits it (colwise: its output features over the tp ranks, as a vocabulary-parallel head's;
    rowwise: its input features; none: replicated)."""

    tokens: int = Field(description="rows of the GEMM per sample (the call's output without its feature dim)")
    in_features: int
    out_features: int
    split: Literal["colwise", "rowwise", "none"] = "none"


class TPPair(_Model):
    """A column-parallel Linear feeding (through elementwise ops) a row-parallel Linear: one all-reduce."""

    column: list[str] = Field(description="qualified names of the column-parallel Linears (q, k, v ...)")
    row: str = Field(description="qualified name of the row-parallel Linear")
    allreduce_bytes: int = Field(description="bytes all-reduced per sample in forward (row output)")


class Unit(_Model):
    """One partition unit: a contiguous piece of the model a pipeline stage takes whole."""

    name: str = Field(description="e.g. 'embed', 'blocks.3', 'head'")
    modules: list[str] = Field(description="qualified names of the modules the unit owns")
    kind: Literal["block", "other"] = "other"
    signature: str = Field(description="structural digest; equal signatures are identical blocks")
    params: int
    param_bytes: int = Field(description="bytes of the unit's parameters in the training dtype")
    fwd_flops: float = Field(description="forward FLOPs per sample, all ops")
    bwd_flops: float = Field(description="backward FLOPs per sample")
    matmul_flops: float = Field(description="forward FLOPs per sample in dense matmuls / linear / conv")
    attention_flops: float = Field(description="forward FLOPs per sample inside attention (QK^T, AV)")
    memory_bound_bytes: float = Field(
        description="forward bytes read+written per sample by ops that are not matmuls (norms, "
        "elementwise, softmax, embedding lookups), costed against memory bandwidth"
    )
    bwd_matmul_flops: float = Field(0.0, description="backward FLOPs per sample in dense matmuls")
    bwd_attention_flops: float = Field(0.0, description="backward FLOPs per sample inside attention")
    bwd_memory_bound_bytes: float = Field(0.0, description="backward bytes of non-matmul ops per sample")
    activation_bytes: int = Field(description="bytes saved for backward per sample, no recomputation")
    attention_core_bytes: int = Field(
        0, description="part of activation_bytes that selective recomputation drops (s x s attention maps)"
    )
    sdpa_score_bytes: int = Field(
        0, description="bytes per sample scaled_dot_product_attention keeps on top of activation_bytes under the "
        "math backend (the s x s probabilities); the fused backends, which activation_bytes counts, keep none"
    )
    sdpa_kv_bytes: int = Field(
        0, description="bytes per sample of the keys and values its scaled_dot_product_attention calls read: what "
        "context parallelism all-gathers over the cp ranks"
    )
    sdpa_masked: bool = Field(
        False, description="some scaled_dot_product_attention call of the unit passes an attn_mask (pairs of the whole "
        "sequence, which context parallelism cannot shard)"
    )
    input_bytes: int = Field(description="bytes per sample entering the unit (what full recompute keeps)")
    op_sac_bytes: int = Field(
        0, description="bytes per sample per-op selective checkpointing (recompute 'op', torchtitan's policy) keeps "
        "besides the unit's input: every odd matmul's output, the fused attention's output and log-sum-exp"
    )
    op_sac_kept_matmul_flops: float = Field(
        0.0, description="forward matmul FLOPs per sample whose outputs per-op checkpointing keeps (not re-run)"
    )
    loss_bytes: int = Field(
        0, description="the model's last unit only: bytes per sample the loss function (loss_fn on the output) keeps "
        "for its backward (a cross-entropy's fp32 log-softmax) plus the most its backward holds at once (the fp32 "
        "gradients of the logits): outside every checkpointed unit, so kept under any recomputation"
    )
    loss_parallel: bool = Field(
        False, description="the model's last unit only: its loss is the next-token cross-entropy on its "
        "vocabulary-parallel head's logits, so under tp > 1 (cp 1) the run keeps them split by vocabulary "
        "(torch's loss_parallel, runtime/vocab.py): the loss's memory divides by tp and the logits are not gathered"
    )
    output_bytes: int = Field(description="bytes per sample crossing to the next unit (pipeline p2p size)")
    tp_pairs: list[TPPair] = Field(default_factory=list)
    tp_shardable_params: int = Field(0, description="parameters that tensor parallelism shards")
    tp_shardable_flops: float = Field(0.0, description="forward FLOPs per sample that TP divides")
    tp_gather_bytes: int = Field(0, description="bytes per sample all-gathered after a vocab-parallel head")
    tp_styles: dict[str, TPStyle] = Field(
        default_factory=dict, description="module name -> tensor-parallel style for this unit"
    )
    tp_granularity: int = Field(
        0, description="gcd of the head counts and column widths that TP splits; tp must divide it"
    )
    tp_head_attrs: dict[str, list[str]] = Field(
        default_factory=dict,
        description="module -> integer attributes (head counts, split widths) each rank divides by tp before "
        "its sharded projections run, e.g. {'h.0.attn': ['split_size']}",
    )
    tp_fused: dict[str, int | list[int]] = Field(
        default_factory=dict, description="column module -> chunks of a fused projection (q, k, v: their number, "
        "or their widths where the model takes them at fixed offsets): each is "
        "sharded on its own so every rank keeps its heads of each"
    )
    tp_transposed: list[str] = Field(
        default_factory=list, description="sharded modules whose weight is stored [in, out] (HF Conv1D): "
        "colwise shards weight dim 1 and the bias, rowwise weight dim 0"
    )
    tp_copied: list[str] = Field(
        default_factory=list, description="row-parallel modules whose output the unit's code changes in place "
        "(Falcon's `mlp_output += attention_output`): the runtime gives their output as a copy"
    )
    tp_summed: list[str] = Field(
        default_factory=list, description="weights every tp rank holds whole that reach the heads' sharded values "
        "broadcast over them (a learned scale over head_dim): each rank computes its own heads' share of their "
        "gradient, which the runtime sums over tp"
    )
    tp_refused: list[str] = Field(default_factory=list, description="projections left replicated, and why")
    tp_shards_attention: bool = Field(
        True, description="a TP pair covers the unit's attention, so its heads (and FLOPs) split by tp"
    )
    gemm_dim: int = Field(0, description="FLOP-weighted smallest dimension of the unit's Linears (for GEMM efficiency)")
    gemm_shapes: list[GemmShape] = Field(
        default_factory=list, description="the unit's Linear calls as (tokens, in, out, TP split): each rank's GEMM "
        "sizes under tensor parallelism (`planner.cost.model.gemm_dim_at`); empty: gemm_dim alone (divided by tp)"
    )
    uses_flash_attention: bool = Field(False, description="attention through scaled_dot_product_attention")
    expert_params: int = Field(0, description="parameters of the unit's MoE experts (expert parallelism divides them)")
    frozen_params: int = Field(
        0, description="parameters that do not train (requires_grad=False: frozen embeddings, a LoRA model's base "
        "weights): no gradient and no optimizer state"
    )
    grad_meet: list[int] = Field(
        default_factory=list, description="zero-bubble's weight step: for each end j = i+1, ..., n of a stage that "
        "starts at this unit i or before (n units), the first unit whose computed values the unit's trained "
        "weights meet inside units i..j-1 (n: none), the largest over its weights; a stage after the first "
        "that starts at s holds the unit only where that is below s (`planner.search.problem.zero_bubble_stages`). "
        "Empty: every weight meets the first unit's values at once (no stage is refused for it)"
    )
    experts: dict[str, int] = Field(
        default_factory=dict, description="MoE experts modules of the unit -> their number of experts (one "
        "all-to-all dispatch and combine each under expert parallelism)"
    )
    ep_granularity: int = Field(0, description="gcd of the unit's expert counts; ep must divide it (0: no experts)")
    moe_dispatch_bytes: int = Field(
        0, description="bytes per sample one all-to-all moves, summed over the unit's MoE blocks (top_k x hidden "
        "per token)"
    )


class ModelGraph(_Model):
    """A traced model grouped into partition units, in execution order."""

    source: ModelSource
    model_class: str
    trace_method: Literal["fx", "fx-meta", "export"]
    units: list[Unit]
    total_params: int
    tokens_per_sample: int | None = Field(
        None, description="sequence length when the inputs are integer tokens, else None"
    )
    sample_input_shapes: list[list[int]] = Field(description="shapes of example_inputs(1)")
    has_sequence: bool = Field(
        True, description="the activations carry dimension 1 of the first input as their dimension 1 ([batch, seq, "
        "...]): the sequence that sequence parallelism splits; False where the model has none (a recommender's "
        "dense features)"
    )
    min_micro_batch: int = Field(
        1, description="the smallest micro-batch the model accepts in training: 2 where a batch norm sees one value "
        "per channel in a sample (its statistics need two)"
    )
    distinct_blocks: int = Field(description="number of distinct unit signatures analysed")
    structure: list[str] = Field(
        default_factory=list, description="the repeated blocks found and where, e.g. '12 x GPT2Block in transformer.h'"
    )
    source_spec: str | None = Field(None, description="the model source compiled into the model file (hf:NAME)")
    source_settings: dict[str, Any] = Field(
        default_factory=dict, description="settings the compiled source applies (use_cache=False, sdpa ...), or "
        "that the planner applies to the transformers models a model file builds"
    )
    dtype_bytes: int

    @property
    def tp(self) -> TPPlan:
        """The model's TP decision under tp > 1: every unit's (what the cost model divided by tp is what the
        script shards), merged in unit order (`TPPlan.of`)."""
        return TPPlan.of(self.units)

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def fwd_flops_per_sample(self) -> float:
        return sum(u.fwd_flops for u in self.units)

    @property
    def bwd_flops_per_sample(self) -> float:
        return sum(u.bwd_flops for u in self.units)
