"""The planner's forked helper processes (the plan-time check's worker, the search's side-by-side solves): one
way to start one and one way to end it. And the collector's policy of the planner's own process while it
imports a model's code (`defer_collection`, `model_loaded`)."""

from __future__ import annotations

import gc
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
    _reap(block=False)
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


def end(pid: int, wait: bool = True) -> None:
    """End a forked process at once (it writes nothing more) and reap it; one already gone is reaped. Without
    `wait`, it is reaped where it is gone already, else later (by the next `fork` or `end`): its memory is
    released by the kernel meanwhile (the check worker's: 0.03 s of a plan's end, waited for to no use)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _unreaped.append(pid)
    _reap(block=wait)


_unreaped: list[int] = []  # ended processes not yet reaped


def _reap(block: bool) -> None:
    for pid in list(_unreaped):
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            _unreaped.remove(pid)


_deferred = False  # the cyclic collector is off until the model is loaded (`defer_collection`)


def defer_collection() -> None:
    """The command line's process: the cyclic collector off until the model is loaded and built (`model_loaded`:
    a model file may reach transformers' class only in its build). The imports of torch's and transformers'
    modules and the model's build make hundreds of thousands of objects
    that live as long as the process; each young collection of those walks them: 0.15 s of a DeepSeek-V3 plan
    (925 collections), all before its analysis. A short process (`planner.cli.main`) only: nothing else calls
    it."""
    global _deferred
    if gc.isenabled():
        gc.disable()
        _deferred = True


def model_loaded() -> None:
    """Once the model file is imported and its model built (the analysis), or the search starts (an analysis from
    the cache): what the process holds now out of the collector's sight (gc.freeze: it lives as long as the
    process) and the collector on again, where `defer_collection` turned it off."""
    global _deferred
    if _deferred:
        _deferred = False
        gc.freeze()
        gc.enable()
