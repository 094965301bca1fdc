"""The analysis cache: a ModelGraph on disk, keyed by a digest of everything the analysis read, so that
re-planning the same model skips building, tracing and counting.

Everything the model's own code read is a dependency of the entry (planner.model.reads): the source files of
the modules its import brought in (a sub-package, a sibling module) and the files its import and build
opened (a YAML or JSON config), each with its sha256. An entry is used only when every one of them still has
that digest; an analysis whose reads are not all known (its code opened a file for writing) is not cached.

The key covers the model file's bytes (not its path: a source compiled into each plan directory hits, and the graph
takes the path it was loaded from), the .py and .json files beside it (sibling imports, a compiled source's
config.json), the function names, --model-arg values and dtype, the planner's version and the source of
planner.model (the analysis itself) and of planner.runtime (its tracers), and the torch, transformers and torchtitan
versions (what tracing, Hugging Face and torchtitan models depend on). Files live in ``$PLANNER_CACHE_DIR/analysis``
(default ``~/.cache/planner/analysis``); ``PLANNER_NO_CACHE=1`` bypasses the cache. An unreadable or mismatched
entry is ignored (and rewritten). The plan-time check's passes are remembered beside it (``checks/``)."""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from planner import __version__
from planner.io import atomic_write_text
from planner.model.graph import ModelGraph, ModelSource
from planner.model.reads import Reads, current_digests, digests, paused

CACHE_DIR_ENV = "PLANNER_CACHE_DIR"  # shared with the profile cache (planner.measure.profile)
NO_CACHE_ENV = "PLANNER_NO_CACHE"
SCHEMA = 2  # 2: the entry lists the files the model's code read, with their digests


def cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() in ("", "0", "false", "no")


def analysis_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else $PLANNER_CACHE_DIR/analysis, else ~/.cache/planner/analysis."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get(CACHE_DIR_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "planner") / "analysis"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _files_digest(paths: list[Path]) -> dict[str, str]:
    out = {}
    for p in sorted(paths):
        try:
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError:
            out[p.name] = "unreadable"
    return out


def analysis_key(source: ModelSource) -> str:
    """The digest of everything the analysis of ``source`` depends on."""
    model = Path(source.path)
    beside = [p for p in model.parent.iterdir() if p.is_file() and p.suffix in (".py", ".json")]
    here = Path(__file__).resolve().parent
    blob = json.dumps(
        {
            "schema": SCHEMA,
            "source": source.model_dump(mode="json", exclude={"path"}),  # the file's bytes are in it
            "beside": _files_digest(beside),
            "planner": __version__,
            "planner.model": _files_digest(list(here.glob("*.py"))),
            # the analysis traces and builds with the runtime's tracers, stages and model loading
            "planner.runtime": _files_digest(list((here.parent / "runtime").glob("*.py"))),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "torchtitan": _version("torchtitan"),  # torchtitan:MODEL sources build from its registry
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _entry(key: str, folder: str | Path | None, cache_dir: str | Path | None) -> dict[str, Any] | None:
    """The entry stored for ``key`` whose recorded reads all still hold, or None."""
    path = analysis_cache_dir(cache_dir) / f"{key}.json"
    try:
        with paused():  # the planner's own file, not one the model read
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key or data.get("schema") != SCHEMA:
            return None
        reads = data["reads"]
        if not isinstance(reads, dict) or current_digests(list(reads), folder) != reads:
            return None  # a file the model's code read has changed since (or appeared, or went away)
        return data
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def read_cached(
    key: str, folder: str | Path | None = None, cache_dir: str | Path | None = None
) -> ModelGraph | None:
    """The cached graph for ``key``, or None (absent, unreadable, not this key's, or a read file changed).
    ``folder``: the model file's, against which the files read beside it are checked."""
    data = _entry(key, folder, cache_dir)
    try:
        return None if data is None else ModelGraph.model_validate(data["graph"])
    except (KeyError, TypeError, ValidationError):
        return None


def reads_digest(key: str, folder: str | Path | None = None, cache_dir: str | Path | None = None) -> str | None:
    """A digest of the files the cached analysis of ``key`` read, as they are now; None when there is no valid
    entry (the plan-time check's cache then does not apply either)."""
    data = _entry(key, folder, cache_dir)
    if data is None:
        return None
    return hashlib.sha256(json.dumps(data["reads"], sort_keys=True).encode()).hexdigest()


def write_cached(
    key: str, graph: ModelGraph, reads: Reads, folder: str | Path | None = None, cache_dir: str | Path | None = None
) -> None:
    """Store ``graph`` under ``key`` with the digests of what the model's code read; an analysis whose reads are
    not all known, or a cache that cannot be written, is skipped."""
    if not reads.complete:
        return
    path = analysis_cache_dir(cache_dir) / f"{key}.json"
    entry = {
        "schema": SCHEMA, "key": key, "reads": digests(reads.files, folder), "graph": graph.model_dump(mode="json"),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with paused():
            atomic_write_text(path, json.dumps(entry))
    except OSError:
        pass


def check_passed(key: str, cache_dir: str | Path | None = None) -> bool:
    """Whether the plan-time check passed before for ``key`` (a digest of the plan, the model's analysis key
    and the runtime's sources: the same check would run on the same inputs)."""
    root = analysis_cache_dir(cache_dir).parent if cache_dir is None else Path(cache_dir)
    try:
        with paused():
            return (root / "checks" / key).read_text(encoding="utf-8").strip() == key
    except (OSError, UnicodeDecodeError):
        return False


def record_check_pass(key: str, cache_dir: str | Path | None = None) -> None:
    root = analysis_cache_dir(cache_dir).parent if cache_dir is None else Path(cache_dir)
    try:
        with paused():
            atomic_write_text(root / "checks" / key, key + "\n")
    except OSError:
        pass
