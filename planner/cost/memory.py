"""Per-GPU memory formulas: model states by ZeRO stage and activations by recomputation.

Sources:
- Model states: mixed-precision Adam keeps 2 bytes of bf16 weights, 4 of fp32 gradients, 4 of fp32 master
  weights and 8 of Adam moments per parameter: 18 bytes (Megatron-LM, theoretical_memory_usage.py;
  Rajbhandari et al. 2020, ZeRO, Sec. 3.1 counts 16 with half-precision gradients). ZeRO-1 shards the
  optimizer states (12 bytes) across data parallelism, ZeRO-2 also the gradients, ZeRO-3 also the weights.
  In fp32 training there is no master copy: 4 + 4 + 8 = 16 bytes.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
  per layer s*b*h*(34 + 5*a*s/h) bytes, of which 24*s*b*h (the tensors inside the tensor-parallel
  regions) divide by t with tensor parallelism and all 34 with sequence parallelism; selective
  recomputation drops the 5*a*s/h attention-map term; full recomputation keeps only the layer input.
  The per-unit counts (planner.model.counting) are of the kernels the GPU run executes: under SDPA's fused
  backends (flash, memory-efficient, cuDNN) a GPT block keeps 34*s*b*h bytes plus the log-sum-exp and the
  norms' statistics, Korthikanti's formula without its 5*a*s/h term; under the math backend the s x s
  probabilities (2*a*s*s*b bytes of the 5) come back, as `math_scores_per_sample`.
- A stage's whole memory (`memory_report`, as Megatron's report_theoretical_memory): the sum of the above with
  its communication buffers, plus the workspace and the fragmentation share (`CostOptions`, whose
  fragmentation is the spec's memory_reserve.fragmentation: `CostOptions.for_cluster`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from planner.cost.candidate import CostOptions

# Fraction of a transformer block's activations that tensor parallelism shards without sequence
# parallelism: 24 of the 34 s*b*h terms (Korthikanti et al. 2022, Eq. 2).
TP_SHARDED_ACTIVATION_FRACTION = 24.0 / 34.0


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter held by one GPU for each kind of model state."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes_per_param(dtype: str, zero_stage: int, dp: int) -> StateBytes:
    """Bytes per (tensor-parallel-local) parameter on one GPU under ZeRO stage `zero_stage` (Rajbhandari 2020)."""
    if dtype == "fp32":
        weights, grads, optim = 4.0, 4.0, 8.0
    else:
        weights, grads, optim = 2.0, 4.0, 12.0  # bf16 weights, fp32 grads, fp32 master + 2 moments
    if zero_stage >= 1:
        optim /= dp
    if zero_stage >= 2:
        grads /= dp
    if zero_stage >= 3:
        weights /= dp
    return StateBytes(weights, grads, optim)


def activation_bytes(
    saved_per_sample: float,
    attention_core_per_sample: float,
    input_per_sample: float,
    micro_batch_size: int,
    recompute: str,
    tp: int,
    tp_sharded: bool,
    sequence_parallel: bool,
    math_scores_per_sample: float = 0.0,
    op_sac_per_sample: float = 0.0,
) -> float:
    """Activation bytes one micro-batch leaves on a GPU for one unit (Korthikanti et al. 2022).

    `math_scores_per_sample`: what SDPA keeps beyond the fused kernels where the target runs its math
    backend (`Unit.sdpa_score_bytes`, 0 for flash / memory-efficient / cuDNN); an attention map, so
    selective recomputation drops it and tensor parallelism splits it by heads.
    `op_sac_per_sample`: what per-op selective checkpointing ("op", torchtitan's policy) keeps besides the
    unit's input (`Unit.op_sac_bytes`: every odd matmul's output, the fused attention's output and log-sum-exp).
    """
    if recompute == "op":
        # The unit's input (split by t under sequence parallelism, as with full recomputation) and the kept
        # outputs, most of them inside the tensor-parallel regions (column-parallel q, v and gate outputs, the
        # attention split by heads): divided by t; the row-parallel outputs too, approximately, where their
        # reduce-scatter leaves 1/t under sequence parallelism.
        kept_input = input_per_sample / (tp if sequence_parallel else 1)
        kept = op_sac_per_sample / tp if tp > 1 and (tp_sharded or sequence_parallel) else op_sac_per_sample
        return (kept_input + kept) * micro_batch_size
    saved_per_sample = saved_per_sample + math_scores_per_sample
    attention_core_per_sample = attention_core_per_sample + math_scores_per_sample
    if recompute == "full":
        kept = input_per_sample / (tp if sequence_parallel else 1)
        return kept * micro_batch_size
    core = 0.0 if recompute == "selective" else attention_core_per_sample
    rest = saved_per_sample - attention_core_per_sample
    if tp > 1:
        if sequence_parallel:
            rest /= tp
        elif tp_sharded:
            # Eq. 2: s*b*h*(10 + 24/t + 5*a*s/(h*t)): 24 of the 34 sbh terms split by t
            frac = TP_SHARDED_ACTIVATION_FRACTION
            rest = rest * (1 - frac) + rest * frac / tp
        if tp_sharded or sequence_parallel:
            core /= tp  # the attention maps live inside the TP region: split by heads
    return (rest + core) * micro_batch_size


class StageBytes(Protocol):
    """A stage's bytes by kind (planner.cost.model.StageCost): what `memory_report` sums."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float


@dataclass(frozen=True)
class MemoryReport:
    """One stage's bytes on its GPU by kind, and their sum: the numbers plan.json and the report print."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float
    workspace: float  # the fixed workspace and the fragmentation share of everything else (`memory_report`)

    @property
    def states(self) -> float:
        """What the stage holds whatever its micro-batches: model states and communication buffers (`held_states`
        sums the same, in the same order, without the report)."""
        return self.weights + self.gradients + self.optimizer + self.comm_buffers

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.comm_buffers + self.workspace


def held_states(stage: StageBytes) -> float:
    """`MemoryReport.states` of a stage without making its report (the search sums it for every partition it
    evaluates); the same sum in the same order, so the same float."""
    return stage.weights + stage.gradients + stage.optimizer + stage.comm_buffers


def memory_report(stage: StageBytes, options: CostOptions) -> MemoryReport:
    """The stage's memory, the one place it is summed (Megatron-LM's report_theoretical_memory): its model
    states, activations and communication buffers, plus `options.workspace_bytes` and `options.fragmentation`
    of the rest (the allocator's share, as `terms.rank_peak_bytes` adds it to a rank's peak)."""
    held = stage.weights + stage.gradients + stage.optimizer + stage.activations + stage.comm_buffers
    workspace = options.workspace_bytes + options.fragmentation * held
    return MemoryReport(
        stage.weights, stage.gradients, stage.optimizer, stage.activations, stage.comm_buffers, workspace
    )
