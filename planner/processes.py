"""The planner's forked helper processes (the plan-time check's worker, the search's side-by-side solves): one
way to start one and one way to end it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def fork(child: Callable[[], None]) -> int:
    """Fork; the child runs `child()` and ends with os._exit, status 0, or 1 where it raised (never returning
    into the caller's code, running no atexit handler). What the streams buffer is written first, so that the
    child cannot write it again. Returns the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        except BaseException:  # noqa: BLE001 - the parent sees the status (or the closed pipe) and goes on
            pass
        finally:
            os._exit(code)
    return pid


def end(pid: int) -> None:
    """End a forked process at once (it writes nothing more) and reap it; one already gone is reaped."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
