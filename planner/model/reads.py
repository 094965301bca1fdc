"""What the user's code read while it was imported and built: the analysis cache's dependencies.

`recording()` collects, while its block runs, every file opened through Python (the interpreter's "open"
audit event: open(), io.open, os.open, and so every library reading through them: PyYAML, json, torch.load)
and, when the block ends, the source files of the modules that appeared in sys.modules. Files of the Python
installation and of installed packages are left out (their versions are in the cache key); so are the
planner's own files and devices. The conservative rule (planner.model.cache): a graph is reused only when
every recorded file still has the digest it had, and a file opened for writing, or one that cannot be read
back, makes the analysis uncacheable (`Reads.complete` is False).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import site
import sys
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass(eq=False)  # compared by identity: nested recordings are removed from the stack by it
class Reads:
    """Files a block of user code read (absolute paths), and whether that list can be trusted."""

    files: set[str] = field(default_factory=set)
    complete: bool = True
    why_incomplete: str = ""

    def update(self, other: Reads) -> None:
        self.files |= other.files
        if not other.complete and self.complete:
            self.complete, self.why_incomplete = False, other.why_incomplete


_active: list[Reads] = []
_lock = threading.Lock()
_hooked = False
_paused = threading.local()  # the planner's own reads (its analysis cache) in this thread are not the model's


def _paused_depth() -> int:
    depth: int = getattr(_paused, "depth", 0)
    return depth


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Leave out what this thread opens in the block: the planner's own files, read while a model is recorded."""
    depth = _paused_depth()
    _paused.depth = depth + 1
    try:
        yield
    finally:
        _paused.depth = depth


def _installed_roots() -> tuple[str, ...]:
    """Folders whose files are versioned by the cache key already (the interpreter, site-packages, planner)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_paths().get("stdlib", "")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    roots.add(str(Path(__file__).resolve().parents[1]))  # planner itself
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


_ROOTS: tuple[str, ...] | None = None


def _relevant(path: str, real: str | None = None) -> bool:
    """Whether a read of `path` (its real path `real`, where known) can change the model: not a device, a
    cache or an installed package's file."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _installed_roots()
    if path.startswith(("/dev/", "/proc/", "/sys/")) or "__pycache__" in path:
        return False
    return not (os.path.realpath(path) if real is None else real).startswith(_ROOTS)


# A module's file -> its real path, resolved once: an imported module's file stays where it is, and the
# thousands torch and transformers import are resolved (a stat of each path component) in every recording.
_MODULE_REAL: dict[str, str] = {}
_FOLDER_REAL: dict[str, str] = {}  # a folder to its real path (`_real_file`)


def _source_of(pyc: str) -> str | None:
    """The source file a __pycache__ .pyc caches, where it exists."""
    try:
        source = importlib.util.source_from_cache(pyc)
    except ValueError:  # not a PEP 3147 cache path
        return None
    return source if os.path.isfile(source) else None


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _active or _paused_depth():
        return
    path, mode, flags = (tuple(args) + (None, None, None))[:3]
    if isinstance(path, int) or path is None:
        return  # an already open descriptor
    try:
        name = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return
    writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
    )
    if not writes and name.endswith(".pyc") and "__pycache__" in name:
        # an import that found its source's bytecode cached reads the .pyc, not the source: the source is read
        name = _source_of(name) or name
    if not _relevant(name):
        return
    for reads in _active:
        if writes:
            if reads.complete:
                reads.complete, reads.why_incomplete = False, f"it opened {name} for writing"
        else:
            reads.files.add(name)


def _real_file(file: str) -> str:
    """os.path.realpath of an absolute file path, its folder resolved once for all the modules in it (thousands
    of modules share a few hundred folders): one lstat of the file itself instead of one per path component."""
    folder, base = os.path.split(file)
    if os.path.islink(file):
        return os.path.realpath(file)
    real = _FOLDER_REAL.get(folder)
    if real is None:
        real = _FOLDER_REAL[folder] = os.path.realpath(folder)
    return os.path.join(real, base)


def _module_files(before: set[str], folder: str | None) -> set[str]:
    """Source files of the modules imported since `before`, and of every module under `folder` (imported by an
    earlier model in this process, so not new, but read by this one all the same)."""
    out = set()
    inside = os.path.join(os.path.realpath(folder), "") if folder else None
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        file = os.path.abspath(file)
        real = _MODULE_REAL.get(file)
        if real is None:
            real = _MODULE_REAL[file] = _real_file(file)
        if (name not in before or (inside and real.startswith(inside))) and _relevant(file, real):
            out.add(file)
    return out


@contextlib.contextmanager
def recording(folder: str | Path | None = None) -> Iterator[Reads]:
    """Record what the block reads (nested blocks each see their own and their inner blocks' reads); the
    modules under `folder` (the model file's) count as read whether or not they are new."""
    global _hooked
    with _lock:
        if not _hooked:
            sys.addaudithook(_hook)  # process-wide and permanent; it does nothing while no block records
            _hooked = True
    reads = Reads()
    before = set(sys.modules)
    _active.append(reads)
    try:
        yield reads
    finally:
        _active.remove(reads)
        reads.files |= _module_files(before, None if folder is None else str(folder))


def digests(files: set[str] | list[str], folder: str | Path | None = None) -> dict[str, str]:
    """{name: sha256 of its bytes, or "missing"} for each recorded file (a file since created is a change too).
    A file inside `folder` (the model file's) is named relative to it ("./config.json"), so that the same model
    in another folder (a source compiled into a fresh temporary folder each run) finds its entry."""
    inside = os.path.join(os.path.abspath(folder), "") if folder is not None else None
    out = {}
    for name in sorted(files):
        key = "./" + name[len(inside):] if inside and name.startswith(inside) else name
        out[key] = _digest(name)
    return dict(sorted(out.items()))


def current_digests(recorded: list[str], folder: str | Path | None = None) -> dict[str, str]:
    """The digests now of files named as `digests` names them."""
    base = Path(folder) if folder is not None else None
    return {
        name: _digest(str(base / name[2:]) if name.startswith("./") and base is not None else name)
        for name in recorded
    }


def _digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if os.path.isfile(path) else "missing"
    except OSError:
        return "unreadable"
