"""What a generated train.py runs: importing only the standard library and torch, so that a plan directory
(train.py plus its copy of this package, planner_runtime/) trains on a cluster where the planner is not
installed. The planner imports the same functions for the rules it shares with the script (module
ownership, stage cutting, stage-to-rank placement, deterministic initialisation).

Modules, by job:
  layout.py    the validated Layout (degrees, stages, TP plan), ModelFile and Training built from train.py's
               constants; derived facts as properties
  model.py     importing the model file, building on meta, materialising a rank's weights, batches
  stages.py    tracing (torch.fx, torch.export as the fallback) and cutting the graph into stages
  parallel.py  TP / sequence parallelism, activation checkpointing, FSDP2 / replicate, in torchtitan's order
  schedule.py  the torch.distributed.pipelining schedule and the last stage's loss
  loss.py      the default loss
  loop.py      process group and mesh, the training step, metrics.json
  digest.py    the digest train.py checks before importing its copy of this package
"""

from __future__ import annotations

# Only the torch-free parts here: the planner reads layout rules and digests without importing torch; the
# training run is `from planner_runtime.loop import run`.
from .errors import LayoutError, RunError
from .layout import Layout, ModelFile, Stage, Training, stage_rank

__all__ = ["Layout", "LayoutError", "ModelFile", "RunError", "Stage", "Training", "stage_rank"]
