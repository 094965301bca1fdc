"""Running the user's model code so that no exit, signal or hang of it can end or stall the planner.

A model file is the user's code and runs in this process (spawning a second Python would cost as much as
the whole plan). While it runs, `user_code()`:

- turns `SystemExit` (sys.exit, exit(), quit()) and a `KeyboardInterrupt` the code raises itself into a
  `ModelLoadError` naming the file and line;
- replaces `os._exit` (and `posix._exit`) by a function that raises instead of ending the process;
- catches SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 (whoever sends them) as an error at the line that was
  running; a real Ctrl-C (SIGINT) still interrupts the planner;
- arms a wall-clock limit with `signal.setitimer` (main thread only), so a hang becomes an error too;
- sends what the code prints to stderr, so that `--json` on stdout stays one document: `sys.stdout` is a
  stream onto stderr that the code cannot close, and file descriptor 1 itself points at stderr while the code
  runs (C code, `os.write(1, ...)`, a subprocess), so that closing or writing it does not touch the real one;
- keeps the working directory: a `os.chdir` in the code is undone when it returns;
- keeps the way out: `sys.exit` and `sys.excepthook` are put back, and an `atexit` handler the code registers
  runs at exit under the same rules (prints on stderr, no exit of its own), so it cannot change the status or
  write into `--json` output;

and restores every signal handler, the timer, `os._exit`, stdout (fd 1 and sys.stdout) and the working
directory afterwards. Guards nest: an inner one
(e.g. build_model inside a guarded trace) shares the outer one's timer and only adds its own description.
Ordinary exceptions pass through unchanged: the caller words those (it knows which contract was broken).
What cannot be caught in-process (SIGKILL, os.abort, a hang inside C code that never checks for signals)
is out of reach of any guard short of a subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from planner.errors import ModelLoadError

DEFAULT_TIME_LIMIT_S = 300.0  # import + build + trace of a 175B model on meta takes seconds; 5 min is a hang

# Signals that would end the process by default; while user code runs each one becomes an error instead.
_CAUGHT = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)


class _Escape(BaseException):
    """Raised inside user code to unwind it: an exit, a signal or the time limit."""

    def __init__(self, what: str, timeout: bool = False) -> None:
        super().__init__(what)
        self.what = what
        self.timeout = timeout


class _Guard:
    """The state of the outermost active guard (signals are process-wide, so there is at most one)."""

    def __init__(self, time_limit: float | None) -> None:
        self.time_limit = time_limit
        self.interrupted = False  # a real SIGINT arrived (as opposed to user code raising KeyboardInterrupt)


_active: _Guard | None = None


def _fake_exit(code: int = 0) -> None:
    raise _Escape(f"called os._exit({code!r})")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Escape(f"received signal {signal.Signals(signum).name}")


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    limit = _active.time_limit if _active is not None else None
    raise _Escape(f"did not finish within the {limit:g} s time limit (a hang?)", timeout=True)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _active is not None:
        _active.interrupted = True
    raise KeyboardInterrupt


def where_in(exc: BaseException, path: Path) -> str:
    """'file.py, line N: code' of the deepest traceback frame in the model file (or its folder), or ''."""
    path = path.resolve()
    folder = path.parent
    best = ""
    best_in_file = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        f = Path(frame.filename)
        try:
            f = f.resolve()
        except OSError:
            continue
        text = f"{f.name}, line {frame.lineno}: {(frame.line or '').strip()}"
        if f == path:
            best_in_file = text
        elif f.parent == folder:
            best = text
    return best_in_file or best


@contextlib.contextmanager
def user_code(path: str | Path, what: str, time_limit: float | None = DEFAULT_TIME_LIMIT_S) -> Iterator[None]:
    """Run the block as the user's code `what` (e.g. "importing gpt.py", "build_model()") from `path`.

    time_limit: seconds for the block (None or 0: none); ignored inside another guard, whose limit holds.
    """
    global _active
    file = Path(path)
    if _active is not None:  # nested: the outer guard owns the signals and the timer
        try:
            yield
        except _Escape as e:
            raise _error(file, what, e) from None
        except SystemExit as e:
            raise _error(file, what, _exit_escape(e)) from None
        return
    if time_limit is not None and (not math.isfinite(time_limit) or time_limit < 0):
        raise ModelLoadError(f"The model time limit must be a non-negative number of seconds, got {time_limit!r}.")
    guard = _Guard(time_limit or None)
    main = threading.current_thread() is threading.main_thread()
    saved_handlers = {}
    saved_timer = None
    saved_exit = os._exit
    saved_sys_exit, saved_excepthook, saved_register = sys.exit, sys.excepthook, atexit.register
    posix = sys.modules.get("posix")
    saved_posix_exit = getattr(posix, "_exit", None)
    _active = guard
    try:
        if main:
            # Snapshot every handler: the user's code may install its own, which must not outlive it.
            for sig in signal.valid_signals():
                try:
                    saved_handlers[sig] = signal.getsignal(sig)
                except (OSError, ValueError):
                    continue
            for sig in _CAUGHT:
                signal.signal(sig, _on_signal)
            signal.signal(signal.SIGINT, _on_sigint)
            if guard.time_limit:
                signal.signal(signal.SIGALRM, _on_alarm)
                saved_timer = signal.setitimer(signal.ITIMER_REAL, guard.time_limit)
        # setattr: the stubs type these as never returning, and the replacements raise instead
        setattr(os, "_exit", _fake_exit)  # noqa: B010
        if posix is not None and saved_posix_exit is not None:
            setattr(posix, "_exit", _fake_exit)  # noqa: B010
        setattr(atexit, "register", _exit_handler_registrar(saved_register))  # noqa: B010
        with _cwd_kept(), _fd1_to_stderr(), contextlib.redirect_stdout(_StdoutOnStderr()):
            yield
    except _Escape as e:
        raise _error(file, what, e) from None
    except SystemExit as e:
        raise _error(file, what, _exit_escape(e)) from None
    except KeyboardInterrupt as e:
        if guard.interrupted:
            raise
        raise _error(file, what, _Escape("raised KeyboardInterrupt").with_traceback(e.__traceback__)) from None
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
        setattr(os, "_exit", saved_exit)  # noqa: B010
        sys.exit, sys.excepthook, atexit.register = saved_sys_exit, saved_excepthook, saved_register
        if posix is not None and saved_posix_exit is not None:
            setattr(posix, "_exit", saved_posix_exit)  # noqa: B010
        if main:
            for sig, handler in saved_handlers.items():
                if handler is None:
                    continue  # installed from C; Python cannot put it back
                try:
                    if signal.getsignal(sig) is not handler:
                        signal.signal(sig, handler)
                except (OSError, ValueError):
                    continue
            if saved_timer is not None and saved_timer[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, *saved_timer)
        _active = None


def _exit_handler_registrar(register: Callable[..., Any]) -> Callable[..., Any]:
    """atexit.register while user code runs: the handler is registered, but runs at exit as user code does
    here (its prints on stderr, fd 1 kept, no exit of its own, errors ignored), so that a model cannot write
    into `--json` output or change the exit status on the planner's way out."""

    def guarded_register(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        def run() -> None:
            saved = os._exit
            setattr(os, "_exit", _fake_exit)  # noqa: B010
            try:
                with _fd1_to_stderr(), contextlib.redirect_stdout(_StdoutOnStderr()):
                    fn(*args, **kwargs)
            except BaseException:  # noqa: BLE001 - the planner is exiting: the model's handler cannot stop it
                pass
            finally:
                setattr(os, "_exit", saved)  # noqa: B010

        register(run)
        return fn

    return guarded_register


class _StdoutOnStderr(io.TextIOBase):
    """sys.stdout while user code runs: writes go to the current sys.stderr; close() does nothing (a model
    closing sys.stdout must not close the planner's streams)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False

    def fileno(self) -> int:
        return sys.stderr.fileno()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def _fd1_to_stderr() -> Iterator[None]:
    """File descriptor 1 points at fd 2 during the block and at the real stdout again afterwards, whatever the
    block did to it (wrote, closed or replaced it)."""
    for stream in (sys.stdout, sys.__stdout__):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if stream is not None:
                stream.flush()  # what the planner wrote before goes out on the real stdout
    try:
        saved = os.dup(1)
    except OSError:
        yield  # no fd 1 to protect (closed before the planner started)
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if sys.__stdout__ is not None:
                sys.__stdout__.flush()
        os.dup2(saved, 1)
        os.close(saved)
        if getattr(sys.stdout, "closed", False) and sys.stdout is sys.__stdout__:
            # the code closed sys.__stdout__ (the process's own stream): a new one on the restored fd 1
            stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
            sys.stdout = stdout
            setattr(sys, "__stdout__", stdout)  # noqa: B010 - typeshed declares it Final


@contextlib.contextmanager
def _cwd_kept() -> Iterator[None]:
    """The working directory as it was before the block (a model calling os.chdir at import)."""
    try:
        cwd = os.open(".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.fchdir(cwd)
        os.close(cwd)


def _exit_escape(e: SystemExit) -> _Escape:
    esc = _Escape(f"called sys.exit({e.code!r})")
    return esc.with_traceback(e.__traceback__)


def _error(file: Path, what: str, e: _Escape) -> ModelLoadError:
    where = where_in(e, file) if file.suffix == ".py" else ""
    at = f" at {where}" if where else f" in {file}"
    if e.timeout:
        fix = ("Make it return (no waiting on input, the network or a lock), or raise --load-timeout if the model "
               "really needs longer.")
    else:
        fix = "Remove that call, or guard script-only code with `if __name__ == \"__main__\":`."
    return ModelLoadError(
        f"{what} {e.what}{at}. A model file must define its functions and return: it must not exit the process, "
        f"wait forever or rely on signals while it is imported or its build_model / example_inputs / forward run. "
        f"{fix}"
    )
