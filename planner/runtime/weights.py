"""Weights in: a rank's modules take their initial values from a checkpoint, read through the library that owns
its format, each rank reading only what it holds: the model as written (no pipeline) reads after TP and FSDP
have sharded it, each rank its shard of each tensor (`load_sharded`: safetensors' get_slice); a pipeline
stage reads its modules' tensors as they are built (`load_weights`), as does a model whose TP reorders fused
rows or keeps a slice of the experts.

Checkpoints (`open_checkpoint`):
- a Hugging Face model folder (`save_pretrained`: model.safetensors, or shards with model.safetensors.index.json)
  or one .safetensors file: safetensors' `safe_open`, one tensor at a time;
- a Hugging Face repo id in the local cache (`org/name`): huggingface_hub's `snapshot_download` with
  `local_files_only=True` (nothing downloads), then as a folder;
- a torch.distributed.checkpoint folder (a `.metadata` file): DCP's FileSystemReader, loading only the keys
  asked for (`no_dist`: each rank reads its own, no collective);
- a `torch.save`d state_dict (.pt / .pth / .bin; a dict under "model" or "state_dict" too): `torch.load` with
  `mmap=True` and `weights_only=True`, so only the tensors copied are paged in.

Names: a checkpoint's keys are the model's parameter names (any of a tied weight's names), or the same under
"model." (a DCP checkpoint of a training state). Its keys and shapes are checked against the whole model on
every rank before anything is read (`check_matches`): another model's checkpoint names the first keys that
differ, a shape that differs names the parameter.

Imports only the standard library and torch; safetensors and huggingface_hub are imported when used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from .errors import RunError

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# The key prefixes under which a checkpoint may hold the model's names (a training state saves {"model": ...}).
PREFIXES = ("", "model.")


class Checkpoint:
    """The tensors of a checkpoint by name: their shapes (read without the data) and `read(names)`."""

    kind = "checkpoint"

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        self.path = path
        self.shapes = shapes

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """`name`'s values at `index` (one slice per dimension)."""
        return self.read([name])[name][index]


class SafetensorsCheckpoint(Checkpoint):
    kind = "safetensors"

    def __init__(self, path: Path, files: list[Path]) -> None:
        from safetensors import safe_open

        self.file_of: dict[str, Path] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                    self.file_of[key] = file
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        super().__init__(path, shapes)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        for file, keys in sorted(by_file.items()):
            with safe_open(str(file), framework="pt") as f:
                for key in keys:
                    out[key] = f.get_tensor(key)
        return out

    def read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.file_of[name]), framework="pt") as f:
            value: torch.Tensor = f.get_slice(name)[index]  # reads only these bytes of the file
        return value


class DcpCheckpoint(Checkpoint):
    kind = "torch.distributed.checkpoint"

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self.dtypes = {k: m.properties.dtype for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
        shapes = {k: tuple(m.size) for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
        super().__init__(path, shapes)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        state = {n: torch.empty(self.shapes[n], dtype=self.dtypes[n]) for n in names}
        if state:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        return state


class StateDictCheckpoint(Checkpoint):
    kind = "state_dict"

    def __init__(self, path: Path) -> None:
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # a pickle of something else, a truncated file: torch's own message says which
            raise RunError(f"Cannot read {path} as a torch state_dict ({type(e).__name__}: {e}).") from None
        for key in ("model", "state_dict"):
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
        if not isinstance(loaded, dict):
            raise RunError(f"{path} holds a {type(loaded).__name__}, not a state_dict: save model.state_dict().")
        self.tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        super().__init__(path, {k: tuple(v.shape) for k, v in self.tensors.items()})

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in names}


def open_checkpoint(source: str | Path) -> Checkpoint:
    """The checkpoint at `source`: a folder, a file, or a Hugging Face repo id in the local cache."""
    path = Path(source).expanduser()
    if not path.exists():
        path = _from_hf_cache(str(source))
    if path.is_dir():
        if (path / ".metadata").is_file():
            return DcpCheckpoint(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(path.glob("*.safetensors"))
        if files:
            return SafetensorsCheckpoint(path, files)
        bins = sorted(p for p in path.iterdir() if p.suffix in STATE_DICT_SUFFIXES)
        if len(bins) == 1:
            return StateDictCheckpoint(bins[0])
        raise RunError(
            f"{path} holds no .safetensors files, no DCP checkpoint (.metadata) and no single state_dict file: "
            "pass a folder written by save_pretrained or torch.distributed.checkpoint, or a state_dict file."
        )
    if path.suffix == ".safetensors":
        return SafetensorsCheckpoint(path, [path])
    return StateDictCheckpoint(path)


def _from_hf_cache(repo_id: str) -> Path:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        raise RunError(
            f"--init-from {repo_id}: no such file or folder. Pass a checkpoint's path or a repo id (org/name)."
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise RunError(
            f"--init-from {repo_id} is neither a file nor a folder, and huggingface_hub (to look it up in the local "
            "Hugging Face cache) is not installed: pass the checkpoint's folder, or pip install huggingface_hub."
        ) from None
    try:
        # HF_HUB_CACHE as set now (huggingface_hub reads it once, at its import)
        cache = os.environ.get("HF_HUB_CACHE")
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except Exception as e:  # LocalEntryNotFoundError, a malformed id: the job never downloads
        raise RunError(
            f"--init-from {repo_id}: not a file or folder, and not in the local Hugging Face cache "
            f"({type(e).__name__}). Download it first (hf download {repo_id}) or pass the checkpoint's folder."
        ) from None


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name -> all its names (a tied weight has several)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(first.setdefault(id(p), name), []).append(name)
    return names


def check_matches(ckpt: Checkpoint, model: nn.Module) -> tuple[dict[str, str], str]:
    """Each of the model's parameters (first name) -> its key in `ckpt`, and the prefix of the checkpoint's
    keys (PREFIXES), after checking that the checkpoint is
    this model's: every parameter present (under one of its names) with its shape, and no other tensors than
    the model's parameters and buffers. Works on a model on the meta device (only names and shapes)."""
    aliases = _aliases(model)
    buffers = {n for n, _ in model.named_buffers()}
    best: tuple[int, str, dict[str, str]] | None = None
    for prefix in PREFIXES:
        found = {}
        for first, names in aliases.items():
            key = next((prefix + n for n in names if prefix + n in ckpt.shapes), None)
            if key is not None:
                found[first] = key
        if best is None or len(found) > best[0]:
            best = (len(found), prefix, found)
    assert best is not None
    _, prefix, found = best
    missing = [n for n in aliases if n not in found]
    known = {prefix + n for names in aliases.values() for n in names} | {prefix + b for b in buffers}
    unexpected = sorted(k for k in ckpt.shapes if k not in known and (prefix == "" or k.startswith(prefix)))
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"the model's {_first(missing)} are not in it")
        if unexpected:
            what.append(f"it holds {_first(unexpected)}, which the model does not have")
        raise RunError(
            f"The checkpoint {ckpt.path} ({ckpt.kind}) is not this model's: {'; '.join(what)} "
            f"({len(found)} of {len(aliases)} parameters match). Pass a checkpoint of the planned model (same "
            "architecture and names), or plan the model the checkpoint was written from."
        )
    params = dict(model.named_parameters())
    for first, key in found.items():
        want = tuple(params[first].shape)
        if ckpt.shapes[key] != want:
            raise RunError(
                f"The checkpoint {ckpt.path} holds {key} with shape {list(ckpt.shapes[key])}, the model's "
                f"parameter {first} has shape {list(want)}: the checkpoint was written for another configuration "
                "(hidden size, vocabulary, heads). Plan the model with the checkpoint's configuration."
            )
    return found, prefix


def _first(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def load_weights(model: nn.Module, ckpt: Checkpoint, held: Iterable[str]) -> None:
    """Copy the checkpoint's values into the model's parameters that are not on meta (the modules `held`
    hold), and its persistent buffers of those modules that the checkpoint has; nothing else is read."""
    found, prefix = check_matches(ckpt, model)
    params = dict(model.named_parameters())
    wanted = {first: key for first, key in found.items() if not params[first].is_meta}
    values = ckpt.read(sorted(wanted.values()))
    with torch.no_grad():
        for first, key in wanted.items():
            params[first].copy_(values.pop(key))
    _load_buffers(model, ckpt, prefix, set(held))


def load_sharded(model: nn.Module, ckpt: Checkpoint, held: Iterable[str]) -> None:
    """Copy the checkpoint into a model already sharded by TP and FSDP (its parameters DTensors), each rank
    reading only its shard of each tensor (safetensors' get_slice; a state_dict file is memory-mapped, so only
    the slice's pages are read), and the persistent buffers of the modules `held` that the checkpoint has.
    For weights whose sharded layout is the checkpoint's (not TP_FUSED's reordered rows)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    found, prefix = check_matches(ckpt, model)
    with torch.no_grad():
        for first, p in model.named_parameters():
            if p.is_meta:
                continue
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                local = p.to_local()
            else:
                shape, offset, local = tuple(p.shape), (0,) * p.dim(), p
            if local.numel():
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                local.copy_(ckpt.read_slice(found[first], index))
    _load_buffers(model, ckpt, prefix, set(held))


def _load_buffers(model: nn.Module, ckpt: Checkpoint, prefix: str, held: set[str]) -> None:
    """The checkpoint's values of the persistent buffers of the modules `held` (batch norm's statistics)."""
    keys = {}
    for name, module in model.named_modules():
        if name not in held:
            continue
        for bname, b in module.named_buffers(recurse=False):
            full = f"{name}.{bname}" if name else bname
            if b is not None and not b.is_meta and prefix + full in ckpt.shapes:
                keys[full] = prefix + full
    values = ckpt.read(sorted(keys.values()))
    named = dict(model.named_buffers())
    with torch.no_grad():
        for full, key in keys.items():
            named[full].copy_(values[key])


def checkpoint_problem(source: str | Path, model: nn.Module) -> str | None:
    """Why `source` cannot initialise `model` (a meta model will do), or None: the planner's check at plan time."""
    try:
        check_matches(open_checkpoint(source), model)
    except RunError as e:
        return str(e)
    return None
