"""Solving a batch of candidates side by side in forked processes.

The search solves its candidates in batches of `ILP_WORKERS`. CBC runs in its own process, but the planner's
own solvers (the chain dynamic program, the branch and bound for several stages per rank) are Python: in
threads they take turns on one CPU. `map_forked` runs the first item of a batch in this process and each
other item in a forked child, which inherits the model's graph and costs (nothing is copied in) and sends
back only its result, pickled. The function must be a pure function of its argument (a solve is: its node
budgets are counts, never time), so the results are those of solving one after another; a child that fails
(killed, or its function raised, or its result does not pickle) has its item solved again in this process,
where an error is raised as it would be without the fork.

No child is forked without `fork` (not Linux), with one CPU, or with PLANNER_SEARCH_FORK=0. The child
touches nothing another thread of this process may hold (the progress display's): it logs nothing, warns
nothing, writes only to its pipe and ends with os._exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from planner import processes

FORK_ENV = "PLANNER_SEARCH_FORK"

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def fork_allowed() -> bool:
    """Whether batches are solved in forked processes here."""
    if os.environ.get(FORK_ENV, "").strip().lower() in ("0", "false", "no"):
        return False
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    return len(os.sched_getaffinity(0)) >= 2


def map_forked(fn: Callable[[_In], _Out], items: Sequence[_In]) -> list[_Out]:
    """[fn(x) for x in items], the first in this process and each other one in a forked child at the same time."""
    running: dict[int, tuple[int, int]] = {}  # item index -> (pid, read end of its pipe), until collected
    try:
        for i in range(1, len(items)):
            running[i] = _fork(fn, items[i])
        out = [fn(items[0])] if items else []
        for i in range(1, len(items)):
            pid, fd = running.pop(i)
            result = _collect(pid, fd)
            out.append(cast(_Out, result[0]) if result is not None else fn(items[i]))
        return out
    finally:
        for pid, fd in running.values():  # an error on the way: end the children still running
            _end(pid, fd)


def _fork(fn: Callable[[_In], _Out], item: _In) -> tuple[int, int]:
    read_fd, write_fd = os.pipe()

    def child() -> None:  # where it fails, the parent solves the item itself (and raises its error)
        os.close(read_fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the children
        logging.disable(logging.CRITICAL)
        warnings.simplefilter("ignore")
        data = memoryview(pickle.dumps(fn(item)))
        while data:
            data = data[os.write(write_fd, data):]

    pid = processes.fork(child)
    os.close(write_fd)
    return pid, read_fd


def _collect(pid: int, fd: int) -> tuple[object] | None:
    """The child's result, or None where it failed; the child reaped."""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return None
    try:
        return (pickle.loads(b"".join(chunks)),)
    except Exception:  # noqa: BLE001 - a broken result: solved again in this process
        return None


def _end(pid: int, fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    processes.end(pid)
