"""Writing a set of output files as one unit, under a lock, without losing the user's edits.

`write_output_set(out_dir, files, force)` is what `planner plan` and `planner emit` use:

- **Lock.** `.<out>.lock` beside the folder, held with `flock` for the whole check-and-write: a second
  writer on the same folder fails at once with a message naming the lock (it does not wait: two plans
  racing for one folder is a mistake to report, not to serialise). The kernel drops the lock when its
  holder dies, so a killed run never leaves a folder locked.
- **One unit.** Every file is written into a temporary sibling folder `.<out>.tmp-*`, the files of the
  old folder that stay (the user's own, the edited ones kept) are hard-linked beside them, and the two
  folders are swapped with one `renameat2(RENAME_EXCHANGE)`: readers see the old set or the new one,
  never a mix. Where the swap is impossible (the folder is the working directory, or the system lacks
  the call) each file is replaced atomically and the manifest is committed last.
- **Edit check.** `.planner-manifest.json` records each written file's sha256. A file whose content
  differs both from what is about to be written and from the manifest's digest was edited by someone:
  it is kept unless `force` (and `OutputSet.kept` / the error message name it). Files the previous set
  wrote that the new one does not are removed with it; other files in the folder are left alone.
- **No orphans.** The temporary folder is removed on any error, on Ctrl-C and on SIGTERM (the signal is
  re-delivered afterwards); what a SIGKILL leaves behind is removed by the next writer that holds the lock.

`files` maps relative paths (nested ones allowed, '/'-separated) to (text, executable).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from planner.errors import ConfigError

MANIFEST = ".planner-manifest.json"
# Test seam: a marker path. After its first file the writer creates it and waits (up to 60 s) until it is
# deleted, so that a test can kill a real writer between two files, or hold its lock, without a sleep race.
PAUSE_ENV = "PLANNER_TEST_PAUSE_AFTER_FIRST_WRITE"

Files = dict[str, tuple[str, bool]]


class OutputLockedError(ConfigError):
    """Another planner process is writing the same output folder."""


class OutputConflictError(ConfigError):
    """The output folder holds files that are someone else's (or edited) and --force was not given."""


@dataclass
class OutputSet:
    """What happened to each file of a set: written (new or changed), unchanged, or kept (edited)."""

    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def atomic_write_text(path: str | Path, text: str, executable: bool = False) -> None:
    """Write text so that readers see either the old file or the whole new one, never a partial one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --- the lock ----------------------------------------------------------------------------------------------


def lock_path(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.lock"


@contextlib.contextmanager
def output_lock(out_dir: Path) -> Iterator[Path]:
    """Hold the folder's lock (fail fast if another process holds it); the lock file is removed afterwards."""
    path = lock_path(out_dir)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(
                f"Cannot create the lock file {path}: {e.strerror or e}. Check that the folder above --out "
                "exists and is writable."
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise OutputLockedError(
                f"Another planner process{f' (pid {holder})' if holder else ''} is writing {out_dir} right now: "
                f"it holds the lock {path}. Wait for it to finish, or write to another folder with --out."
            ) from None
        # The previous holder may have unlinked the file between our open and our lock: retry on the new one.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # closing drops the flock


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None


# --- the manifest and the edit check ----------------------------------------------------------------------


def read_manifest(out_dir: Path) -> dict[str, str]:
    """{relative path: sha256} of the files the last planner run wrote into out_dir ({} if none)."""
    try:
        data = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
        files = data["files"]
        return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return {}


def _manifest_text(files: Files) -> str:
    digests = {name: sha256_text(text) for name, (text, _) in sorted(files.items())}
    return json.dumps({"files": digests, "note": "written by planner; do not edit"}, indent=2, sort_keys=True) + "\n"


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


@dataclass
class Classified:
    """Each name of a new set against what out_dir holds now."""

    new: list[str] = field(default_factory=list)  # not there yet
    same: list[str] = field(default_factory=list)  # there with the same content
    generated: list[str] = field(default_factory=list)  # there as the last run wrote it (safe to replace)
    edited: list[str] = field(default_factory=list)  # there with content nobody recorded: the user's
    blocked: list[str] = field(default_factory=list)  # a folder or other non-file in the way
    stale: list[str] = field(default_factory=list)  # written by the last run, absent from the new set


def classify(out_dir: Path, files: Files) -> Classified:
    manifest = read_manifest(out_dir)
    c = Classified()
    for name, (text, _) in sorted(files.items()):
        path = out_dir / name
        in_way = next((q for q in reversed(path.relative_to(out_dir).parents) if q != Path(".")
                       and ((out_dir / q).is_symlink() or ((out_dir / q).exists() and not (out_dir / q).is_dir()))),
                      None)
        if in_way is not None:
            c.blocked.append(str(in_way))
        elif not path.exists() and not path.is_symlink():
            c.new.append(name)
        elif path.is_symlink() or not path.is_file():
            c.blocked.append(name)
        else:
            digest = _file_digest(path)
            if digest == sha256_text(text):
                c.same.append(name)
            elif digest is not None and manifest.get(name) == digest:
                c.generated.append(name)
            else:
                c.edited.append(name)
    c.blocked = sorted(set(c.blocked))
    c.stale = sorted(n for n, d in manifest.items() if n not in files and _file_digest(out_dir / n) == d)
    return c


def check_names(files: Files) -> None:
    """Relative, normalised, '/'-separated paths that stay inside the folder (a bug otherwise)."""
    for name in files:
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or str(p) != name or name in ("", ".", MANIFEST):
            raise ValueError(f"output file name {name!r} must be a plain relative path inside the folder")


# --- writing -----------------------------------------------------------------------------------------------


def write_output_set(
    out_dir: str | Path, files: Files, force: bool, keep_edited: bool = True, always: frozenset[str] = frozenset(),
    precheck: Callable[[Path, Classified], None] | None = None,
) -> OutputSet:
    """Write `files` into out_dir as one unit under its lock; see the module docstring.

    keep_edited: edited files are kept (listed in `kept`) when True; when False they are an
    OutputConflictError (the caller decides: a new plan beside an old edited script would not match).
    `force` replaces edited files and files in the way; names in `always` are replaced even when edited.
    precheck(out_dir, classified): the caller's own refusal rules, run under the lock before anything is written.
    """
    check_names(files)
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder. Pass a folder path (it is created if needed).")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"Cannot create {out.parent}: {e.strerror or e}. Check --out.") from e
    with _cleanup_on_signal(), output_lock(out):
        _remove_orphans(out)
        c = classify(out, files)
        if precheck is not None:
            precheck(out, c)
        if c.blocked and not force:
            raise OutputConflictError(
                f"{out} holds {', '.join(c.blocked)}, which is not a plain file (a folder or link in the way of a "
                "file planner writes). Move it away, pass --force to replace it, or choose another folder with --out."
            )
        if c.edited and not force and not keep_edited:
            raise OutputConflictError(
                f"{out} already holds {', '.join(c.edited)} with other content (edited since planner wrote it, or "
                "someone else's file). Pass --force to overwrite, or choose another folder with --out."
            )
        kept = set() if force else set(c.edited) - set(always)
        to_write = {n: v for n, v in files.items() if n not in kept}
        manifest_files = dict(to_write)
        previous = read_manifest(out)
        for name in kept:  # an edited file keeps its old digest: it stays "edited" next time too
            manifest_files[name] = files[name]
        result = OutputSet(
            written=[out / n for n in sorted(to_write) if n not in c.same],
            unchanged=[out / n for n in sorted(c.same)],
            kept=[out / n for n in sorted(kept)],
        )
        if not result.written and not c.stale and not c.blocked and previous:
            return result  # nothing to change
        manifest = _manifest_text(manifest_files)
        if kept:
            # Kept files: record the digests the previous manifest held (or none), never the edited content.
            data = json.loads(manifest)
            for name in kept:
                if name in previous:
                    data["files"][name] = previous[name]
                else:
                    data["files"].pop(name, None)
            manifest = json.dumps(data, indent=2, sort_keys=True) + "\n"
        try:
            swapped = False
            if _can_swap(out):
                try:
                    _write_swapped(out, to_write, manifest, drop=set(to_write) | set(c.stale) | set(c.blocked))
                    swapped = True
                except _CannotSwap:
                    pass  # a mount point (a bind mount looks like a plain folder): file by file instead
            if not swapped:
                _write_in_place(out, to_write, manifest, c.stale, c.blocked)
        except OSError as e:
            raise ConfigError(
                f"Cannot write the output set into {out}: {e.strerror or e}"
                + (f" ({e.filename})" if getattr(e, "filename", None) else "")
                + ". Nothing was changed there. Check that --out is on a writable file system with free space."
            ) from e
        return result


def _remove_orphans(out: Path) -> None:
    """Temporary folders of writers that died by SIGKILL (we hold the lock: no live writer owns them)."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _pause_for_tests() -> None:
    marker = os.environ.get(PAUSE_ENV)
    if marker:
        path = Path(marker)
        path.write_text(f"{os.getpid()}\n")
        deadline = time.monotonic() + 60
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def _write_file(path: Path, text: str, executable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o755 if executable else 0o644)


def _write_swapped(out: Path, files: Files, manifest: str, drop: set[str]) -> None:
    """Build the new folder beside `out` and exchange the two in one rename."""
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        os.chmod(stage, (out.stat().st_mode & 0o7777) if out.is_dir() else 0o777 & ~_umask())
        for i, (name, (text, executable)) in enumerate(sorted(files.items())):
            _write_file(stage / name, text, executable)
            if i == 0:
                _pause_for_tests()
        _write_file(stage / MANIFEST, manifest, False)
        if out.is_dir():
            _link_tree(out, stage, drop | {MANIFEST})
            try:
                _exchange(stage, out)  # stage now holds the old folder
            except OSError as e:
                if e.errno in (errno.EBUSY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM):
                    raise _CannotSwap from e
                raise
        else:
            os.rename(stage, out)
            stage = None  # type: ignore[assignment]
        _fsync_dir(out.parent)
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


class _CannotSwap(Exception):
    """The folder cannot be exchanged (it is a mount point): the caller writes file by file."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _link_tree(src: Path, dst: Path, drop: set[str], prefix: str = "") -> None:
    """Hard-link (or copy) what stays of the old folder into the new one: everything not in `drop`."""
    for entry in os.scandir(src):
        rel = f"{prefix}{entry.name}"
        if rel in drop:
            continue
        target = dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            if target.exists() and not target.is_dir():
                continue  # the new set writes a file where a folder was (only with --force)
            target.mkdir(exist_ok=True)
            shutil.copystat(entry.path, target)
            _link_tree(Path(entry.path), target, drop, f"{rel}/")
        elif target.exists() or target.is_symlink():
            continue
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_file(follow_symlinks=False):
            try:
                os.link(entry.path, target, follow_symlinks=False)
            except OSError:
                shutil.copy2(entry.path, target)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> None:
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(b))


def _can_swap(out: Path) -> bool:
    """The folder can be exchanged: renameat2 exists and no process of ours works inside it."""
    if _renameat2() is None:
        return False
    if not out.exists():
        return True
    cwd = Path.cwd().resolve()
    real = out.resolve()
    return real != cwd and real not in cwd.parents and os.path.ismount(real) is False


def _write_in_place(out: Path, files: Files, manifest: str, stale: list[str], blocked: list[str]) -> None:
    """The fallback: each file replaced atomically, the manifest last (it marks the set complete)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # no manifest while the set is being replaced
    for name in blocked:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    for i, (name, (text, executable)) in enumerate(sorted(files.items(), key=lambda kv: kv[0] == "plan.json")):
        atomic_write_text(out / name, text, executable)
        if i == 0:
            _pause_for_tests()
    for name in stale:
        (out / name).unlink(missing_ok=True)
    atomic_write_text(out / MANIFEST, manifest)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Terminated(BaseException):
    pass


@contextlib.contextmanager
def _cleanup_on_signal() -> Iterator[None]:
    """SIGTERM unwinds the block (so its cleanup runs) and is then re-delivered with its default action."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) is on_term:
                signal.signal(signal.SIGTERM, previous)
