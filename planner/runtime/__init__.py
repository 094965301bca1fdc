"""What a generated train.py runs: importing only the standard library and torch, so that a plan directory
(train.py plus its copy of this package, planner_runtime/) trains on a cluster where the planner is not
installed. The planner imports the same functions for the rules it shares with the script (module
ownership, stage cutting, stage-to-rank placement, deterministic initialisation).

Modules, by job:
  layout.py    the validated Layout (degrees, stages, TP plan), ModelFile and Training built from train.py's
               constants (or its layout.json, for module lists too long to read there); derived facts
  model.py     importing the model file, building on meta, materialising a rank's weights, batches
  stages.py    tracing (torch.fx, then with meta values, torch.export as the last fallback) and cutting the
               graph into stages
  tracers.py   the fx tracers: parameters read by name; meta values beside each proxy (shape-reading code)
  parallel.py  TP / sequence parallelism, activation checkpointing, FSDP2 / replicate, in torchtitan's order
  tp_rules.py  the TP plan's rules on the model's modules (split dimensions, what must divide)
  recompute.py activation checkpointing of a stage's units (full or selective)
  schedule.py  the torch.distributed.pipelining schedule and the last stage's loss
  loss.py      the default loss
  loop.py      process group and mesh, the training step, metrics.json / metrics.jsonl, checkpoints and resume
  checkpoint.py torch.distributed.checkpoint saves and loads under the model's own names (any plan resumes
               any other plan's checkpoint), the COMPLETE marker, asynchronous saves
  optim.py     AdamW per stage, warm-up and cosine / linear decay, clipping by the global norm
  data.py      batches from a flat binary token file (nanoGPT / Megatron-LM), deterministic and dp-sharded
  experts.py   expert parallelism: each rank's slice of the experts, all-to-all token dispatch/combine
  tied.py      weights shared by several pipeline stages: a copy per stage, gradients summed over them
  check.py     the plan-time check: one micro-batch, stage by stage, on the meta device (imports neither
               DTensor nor FSDP: tp_rules.py and recompute.py hold what it shares with parallel.py)
  meta.py      running on the meta device without importing torch._dynamo (planning and the check)
  memo.py      running repeated identical ops on the meta device once (tracing's shape run and the check)
  digest.py    the digest train.py checks before importing its copy of this package
  api.py       parallelize(plan): a plan applied to its model for people with their own training loop
  weights.py   --init-from: a rank's modules read their tensors from a Hugging Face folder (safetensors), a DCP
               checkpoint or a state_dict file, checked by name and shape against the model first

What the run does with the models people have:
- Without a pipeline (pp = 1) and without sequence parallelism the stage is the user's model itself, run
  as written: any output type, any inputs, TP applied to its own modules. Pipelines (and sequence
  parallelism) cut a traced graph (torch.fx, else torch.export) at the plan's module boundaries.
- The model's forward gets as many leading inputs of a micro-batch as it takes (integer / boolean
  attention masks and position ids included; a pipeline sends them on to the stages that use them); the
  loss gets all of them.
- Initial weights are the model's own (model.own_initialisation): after each module's reset_parameters, transformers'
  `_init_weights` (children before parents, as post_init) or a top-level `init_weights()` (torchtitan's), each
  parameter drawn from a seed of (seed, its name), and any other number an `_init_weights` draws (Mamba's
  dt_proj bias) from one of (seed, the module's name), so every layout starts from the same values.
- The last stage's output may be a tensor, dict, dataclass, Hugging Face ModelOutput or tuple: the model
  file's loss_fn receives it as the model returns it; the default loss uses its `loss` if it has one, else
  its `logits` (next-token cross-entropy for integer token inputs, else the mean). Intermediate stage
  boundaries carry tuples of tensors (an exported graph's structures are flat there).
- Buffers updated in forward (batch norm's running statistics) belong to the module that owns them, so
  each pipeline stage updates its own modules' buffers (a traced graph keeps the in-place update inside
  the owner's nodes; no stage touches another's), once per micro-batch and in micro-batch order, since
  every schedule runs a stage's forwards in that order: with dp 1 a pipeline's buffers after training
  equal one process's over the same micro-batches (tests/test_runtime_stages.py checks this). Under data
  parallelism they stay per replica (neither averaged nor broadcast), as with DDP's
  broadcast_buffers=False: every replica normalises with its own micro-batches' statistics (in training
  mode batch norm uses the batch's, so losses and gradients equal one process's), and eval-time
  statistics are those of replica 0's micro-batches, not the global batch's.
- A stage that sends sends contiguous tensors (point-to-point needs them; a view such as a transposed
  encoder output is copied).
- A weight used by two stages (GPT-2's wte / lm_head) lives in both: each copy starts from the value its
  first holder module gives it, and the copies' gradients are summed over the stages' ranks before the
  optimizer step (Megatron-LM's embedding group), so they stay equal. Two stages of one pp rank (the first
  and last stage of a ZBV V, T5's encoder and decoder embeddings under interleaving) hold a copy each
  (tied.own_copies), summed on the rank first.
- TP_HEAD_ATTRS: module attributes holding head counts are divided by tp before parallelize_module (as
  torchtitan does `attn.n_heads //= tp`); only for the model as written, since a traced graph has the
  counts baked in.
- TP_FUSED: a column projection computing q, k and v in one output has its output features reordered
  (parallel.chunk_shard_order) so that a plain Shard gives each rank its heads' slice of every chunk; the
  sharded parameter is that fixed permutation of the model's (training does not see it; a checkpoint of
  the sharded weight holds the reordered rows). Only equal chunks: a GQA qkv stays replicated.
- TP_TRANSPOSED: HF's Conv1D (weight [in, out]) is replaced by parallel.ShardedConv1D, splitting weight
  dim 1 (colwise) or 0 (rowwise), parameters keeping their names; not in a traced stage (fx inlines it).
- TP_COPIED: a row-parallel module whose output the model changes in place (Falcon's `mlp_output +=
  attention_output`) gives that output as a copy: RowwiseParallel returns a view of its reduced DTensor, which
  autograd does not let be modified in place. Only the modules the analysis found so (a copy per call).
- Tied weights (GPT-2's wte / lm_head, both vocabulary-parallel) are one parameter again after sharding.
"""

from __future__ import annotations

# Only the torch-free parts here: the planner reads layout rules and digests without importing torch; the
# training run is `from planner_runtime.loop import run`.
from pathlib import Path
from typing import Any

from .errors import LayoutError, RefusedLayout, RunError
from .layout import Layout, ModelFile, Stage, TPPlan, Training, read_layout_file, stage_rank

__all__ = [
    "Layout", "LayoutError", "ModelFile", "RefusedLayout", "RunError", "Stage", "TPPlan", "Training", "parallelize",
    "read_layout_file", "stage_rank",
]


def parallelize(plan: str | Path, **options: Any) -> Any:
    """A plan applied to its model on this rank, for your own training loop (api.parallelize: this rank's
    stages, parallelised, and the pipeline schedule). Imports torch when called, not with this package."""
    from .api import parallelize as apply

    return apply(plan, **options)
