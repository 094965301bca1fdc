"""Checkpoints of a training run with torch.distributed.checkpoint (DCP), as torchtitan's CheckpointManager
keeps them: the model, the optimizer, the learning-rate schedule, the data position, the random number
generators and the step, every CHECKPOINT_EVERY steps and at the end.

- Names are the model's own: each stage's state dict (torch.distributed.checkpoint.state_dict, which takes
  FSDP2's, DTensor's and activation checkpointing's wrappers off) is renamed from the stage's keys
  (`pieces.0.blocks.3.attn.q.weight` in a pipeline stage, `model.blocks.3...` for the model as written) to the
  model's (`blocks.3.attn.q.weight`). Sharded tensors are saved as DTensors with their global shapes, so DCP
  reshards on load: a checkpoint written under one plan resumes under any other plan of the same model.
- A folder `step-NNNNNNNN` is taken as a checkpoint only once its COMPLETE marker exists; rank 0 writes the
  marker (atomically) after DCP has written every rank's data and the metadata, so a save killed half-way
  is never resumed from (`latest` says which folders it skipped).
- A fused projection that TP reorders (TP_FUSED: q | k | v rows interleaved per tp rank, parallel.interleave_fused)
  is saved in the model's own row order (gathered, the tp permutation undone) and put back in this layout's on
  load, weights and AdamW moments alike, so such a checkpoint resumes under another tp degree too.
- Saves are asynchronous where torch supports it (dcp.async_save: the state is copied to CPU memory, then
  written by a thread while training goes on) over a gloo group of their own, so the save's collectives never
  interleave with the training's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from .errors import RunError
from .layout import FusedChunks
from .parallel import chunk_shard_order

COMPLETE = "COMPLETE"  # the marker file: written last, by rank 0, once the whole checkpoint is on disk
_STEP_DIR = re.compile(r"^step-(\d+)$")
# A stage's own prefix before the model's names: a pipeline stage's pieces, or the model as written.
_STAGE_PREFIX = re.compile(r"^(?:pieces\.\d+|model)\.")
_OPTIM_PREFIX = re.compile(r"^(state|param_groups)\.(?:pieces\.\d+|model)\.")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def fused_params(
    tp: int, tp_fused: Mapping[str, FusedChunks], tp_transposed: Sequence[str]
) -> dict[str, tuple[int, FusedChunks, int]]:
    """Model parameter key -> (dim, chunks, tp) of each fused projection's tensors TP reorders (tp > 1)."""
    if tp <= 1:
        return {}
    out: dict[str, tuple[int, FusedChunks, int]] = {}
    for module, chunks in tp_fused.items():
        out[f"{module}.weight"] = (1 if module in tp_transposed else 0, chunks, tp)
        out[f"{module}.bias"] = (0, chunks, tp)
        # nn.MultiheadAttention's packed q | k | v (parallel.ShardedMultiheadAttention)
        out[f"{module}.in_proj_weight"] = (0, chunks, tp)
        out[f"{module}.in_proj_bias"] = (0, chunks, tp)
    return out


def _fqn(key: str) -> str:
    """The parameter a model or flattened optimizer key is of (`state.blocks.0.qkv.weight.exp_avg` -> the weight)."""
    return key[len("state.") :].rsplit(".", 1)[0] if key.startswith("state.") else key


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}"


def model_key(key: str) -> str:
    """A stage's state-dict key as the model names it (`pieces.0.blocks.3.mlp.fc1.weight` -> `blocks.3...`)."""
    return _STAGE_PREFIX.sub("", key, count=1)


def optimizer_key(key: str) -> str:
    """A flattened optimizer state-dict key (`state.<param>.<state>`, `param_groups.<param>.<option>`) with the
    parameter as the model names it."""
    return _OPTIM_PREFIX.sub(r"\1.", key, count=1)


@dataclass(frozen=True)
class Found:
    """The checkpoint a run resumes from, and the newer folders skipped because their save never finished."""

    path: Path | None
    skipped: tuple[Path, ...] = ()

    def skipped_message(self) -> str | None:
        if not self.skipped:
            return None
        names = ", ".join(str(p) for p in self.skipped)
        return (
            f"skipped {names}: no {COMPLETE} marker (the save was stopped before it finished), so it may hold part "
            "of a step"
        )


def latest(folder: Path) -> Found:
    """The newest complete checkpoint under `folder` (or `folder` itself, if it is one)."""
    if (folder / COMPLETE).is_file():
        return Found(folder)
    if _STEP_DIR.match(folder.name) and folder.is_dir():
        raise RunError(
            f"{folder} is not a complete checkpoint (no {COMPLETE} marker: its save was stopped before it "
            f"finished). Resume from {folder.parent} to take the newest complete one."
        )
    steps = sorted(
        ((int(m.group(1)), p) for p in (folder.iterdir() if folder.is_dir() else ()) if (m := _STEP_DIR.match(p.name))),
        reverse=True,
    )
    skipped: list[Path] = []
    for _, path in steps:
        if (path / COMPLETE).is_file():
            return Found(path, tuple(skipped))
        skipped.append(path)
    return Found(None, tuple(skipped))


def write_marker(path: Path, info: dict[str, Any]) -> None:
    """The COMPLETE marker, written to a temporary name and renamed: it exists whole or not at all."""
    tmp = path / f".{COMPLETE}.tmp"
    tmp.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / COMPLETE)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


class Checkpointer:
    """Saves and loads this rank's share of a run: its stages (one optimizer and one scheduler each), the
    training state (step, data position, plan facts) and its random number generators."""

    def __init__(
        self,
        folder: Path,
        stages: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        device: torch.device,
        asynchronous: bool = True,
        log: Callable[[str], None] = lambda _: None,
        fused: dict[str, tuple[int, FusedChunks, int]] | None = None,
    ) -> None:
        self.folder = folder
        self.stages, self.optimizers, self.schedulers = list(stages), list(optimizers), list(schedulers)
        self.device = device
        self.asynchronous = asynchronous
        self.log = log
        self.fused = fused or {}  # fused_params(...): tensors saved in the model's order, not this layout's
        # A group of its own (gloo: DCP's collectives are object collectives, and async_save needs a CPU
        # backend), so that a save's thread never interleaves collectives with the training's.
        self.group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self.pending: tuple[Future[Any], Path, dict[str, Any]] | None = None

    # The state.
    def _model_and_optimizer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for stage, optimizer in zip(self.stages, self.optimizers, strict=True):
            for k, v in get_model_state_dict(stage, options=_OPTIONS).items():
                model.setdefault(model_key(k), v)  # a weight two stages of this rank hold: one copy saved
            flat: dict[str, Any] = dict(get_optimizer_state_dict(stage, optimizer, options=_OPTIONS))
            for k, v in flat.items():
                optim.setdefault(optimizer_key(k), v)
        return model, optim

    def _reordered(self, key: str, value: Any) -> tuple[int, FusedChunks, int] | None:
        spec = self.fused.get(_fqn(key))
        if spec is None or not isinstance(value, torch.Tensor) or value.dim() <= spec[0]:
            return None  # not a fused tensor (or an optimizer's step count)
        return spec

    def _in_model_order(self, state: dict[str, Any]) -> dict[str, Any]:
        """Fused projections' tensors gathered and put in the model's row order (plain tensors: DCP keeps one)."""
        out = dict(state)
        for key, value in state.items():
            spec = self._reordered(key, value)
            if spec is not None:
                dim, chunks, tp = spec
                full = _full(value)
                order = chunk_shard_order(full.shape[dim], chunks, tp).to(full.device)
                out[key] = full.index_select(dim, torch.argsort(order)).detach().clone()
        return out

    def _state(self, train: dict[str, Any]) -> dict[str, Any]:
        model, optim = self._model_and_optimizer()
        model, optim = self._in_model_order(model), self._in_model_order(optim)
        return {
            "model": model,
            "optimizer": optim,
            # JSON text: one opaque value, the same on every rank (DCP keeps one copy).
            "train": json.dumps({**train, "scheduler": self.schedulers[0].state_dict() if self.schedulers else None}),
            "rng": {f"rank{self.rank}": rng_state(self.device)},
        }

    # Saving.
    def save(self, step: int, train: dict[str, Any], final: bool = False) -> None:
        """Save the state after `step` steps into step-NNNNNNNN; asynchronously unless `final` (the run ends:
        the save must be on disk before the process exits) or asynchronous saves are off."""
        self.wait()
        path = step_dir(self.folder, step)
        if self.rank == 0 and path.exists():
            # An older run's folder for this step (a resumed run saves the steps it re-trains): the marker goes
            # first, so that a crash while deleting never leaves a complete-looking folder.
            (path / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path)
        dist.barrier(group=self.group)
        state = self._state(train)
        info = {"step": step, **{k: v for k, v in train.items() if k != "data"}}
        if self.asynchronous and not final:
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group)
            assert isinstance(future, Future), "async_save without a stager returns the upload's future"
            self.pending = (future, path, info)
        else:
            dcp.save(state, checkpoint_id=str(path), process_group=self.group)
            self._finish(path, info)

    def poll(self) -> None:
        """Finish an asynchronous save that has completed (its marker), without waiting for one that has not."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, and mark it complete."""
        if self.pending is None:
            return
        future, path, info = self.pending
        self.pending = None
        future.result()  # raises the save's error, if it failed
        self._finish(path, info)

    def _finish(self, path: Path, info: dict[str, Any]) -> None:
        # On rank 0 DCP returns once every rank's data and the metadata are written (it gathers every rank's
        # write results before writing the metadata), so the marker can follow at once.
        if self.rank == 0:
            write_marker(path, info)
            self.log(f"checkpoint {path} saved (step {info['step']})")

    # Loading.
    def load(self, path: Path) -> dict[str, Any]:
        """Load `path` into the stages, optimizers and schedulers (resharded to this layout) and this rank's
        random number generators where the checkpoint has this rank's; returns the training state."""
        reader = dcp.FileSystemReader(str(path))
        saved = reader.read_metadata().state_dict_metadata
        model, optim = self._model_and_optimizer()
        self._check_model(path, saved, model)
        state: dict[str, Any] = {"model": model, "optimizer": optim, "train": ""}
        rng_key = f"rng.rank{self.rank}.cpu"
        if rng_key in saved:
            state["rng"] = {f"rank{self.rank}": rng_state(self.device)}
        optim_keys = {f"optimizer.{k}" for k in optim}
        missing = sorted(k for k in optim_keys if k not in saved)
        if missing:
            raise RunError(
                f"{path} holds no optimizer state for {missing[:3]}: it was saved by another optimizer set-up. "
                "Start from its weights with a fresh optimizer, or resume with the optimizer it was saved with."
            )
        targets = {}  # fused tensors: loaded whole in the model's order, then put in this layout's
        for part in ("model", "optimizer"):
            for key, value in list(state[part].items()):
                if self._reordered(key, value) is not None:
                    targets[(part, key)] = value
                    state[part][key] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        for (part, key), target in targets.items():
            dim, chunks, tp = self.fused[_fqn(key)]
            whole = state[part][key]
            ours = whole.index_select(dim, chunk_shard_order(whole.shape[dim], chunks, tp).to(whole.device))
            if isinstance(target, DTensor):
                shard = distribute_tensor(ours, target.device_mesh, target.placements).to_local()
                target.to_local().copy_(shard)
            else:
                target.copy_(ours)
            state[part][key] = target
        for stage, optimizer in zip(self.stages, self.optimizers, strict=True):
            own_model = {k: state["model"][model_key(k)] for k in get_model_state_dict(stage, options=_OPTIONS)}
            set_model_state_dict(stage, own_model, options=_OPTIONS)
            own_optim = {
                k: state["optimizer"][optimizer_key(k)]
                for k in get_optimizer_state_dict(stage, optimizer, options=_OPTIONS)
            }
            set_optimizer_state_dict(stage, optimizer, own_optim, options=_OPTIONS)
        train: dict[str, Any] = json.loads(state["train"])
        if train.get("scheduler") is not None:
            for scheduler in self.schedulers:
                scheduler.load_state_dict(train["scheduler"])
        if "rng" in state:
            rng = state["rng"][f"rank{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        return train

    def _check_model(self, path: Path, saved: dict[str, Any], model: dict[str, Any]) -> None:
        """Refuse a checkpoint of another model: keys it lacks or does not know, shapes that differ."""
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, sorted(model), group=self.group)
        ours = {k for keys in everyone for k in keys}
        theirs = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
        lacking, extra = sorted(ours - theirs), sorted(theirs - ours)
        if lacking or extra:
            raise RunError(
                f"{path} is a checkpoint of another model: it lacks {lacking[:5]} and holds {extra[:5]} that this "
                "model does not have. Resume with the model it was saved from, or point --resume at this model's "
                "checkpoints."
            )
        for k, v in model.items():
            shape = tuple(saved[f"model.{k}"].size) if hasattr(saved[f"model.{k}"], "size") else None
            if isinstance(v, torch.Tensor) and shape is not None and tuple(v.shape) != shape:
                raise RunError(
                    f"{path} holds {k} of shape {list(shape)}, this model's is {list(v.shape)}: the checkpoint was "
                    "saved from a model built with other arguments. Resume with the same MODEL_ARGS."
                )
