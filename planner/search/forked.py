"""Solving a batch of candidates side by side in forked processes.

The search solves its candidates in batches of `ILP_WORKERS`. CBC runs in its own process, but the planner's
own solvers (the chain dynamic program, the branch and bound for several stages per rank) are Python: in
threads they take turns on one CPU. `map_forked` runs the first item of a batch in this process and each
other item in a forked child, which inherits the model's graph and costs (nothing is copied in) and sends
back only its result, pickled. The function must be a pure function of its argument (a solve is: its node
budgets are counts, never time), so the results are those of solving one after another; a child that fails
(killed, or its function raised, or its result does not pickle) has its item solved again in this process,
where an error is raised as it would be without the fork.

`SideSolvers` does the same with children forked once and kept for the whole search: forking a process that
holds torch, transformers and the model's graph costs about 20 ms (its page tables copied, then torn down at
its exit), more than most solves of a batch, and a search runs tens of batches. Each item then travels to
its child pickled, except the objects the child already holds as they were at its fork (`shared`: the model's
graph, the cluster, the cost options), which travel as references to its own copy.

No child is forked without `fork` (not Linux), with one CPU, or with PLANNER_SEARCH_FORK=0. The child
touches nothing another thread of this process may hold (the progress display's): it logs nothing, warns
nothing, writes only to its pipe and ends with os._exit.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

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


class SideSolvers:
    """`map_forked` with children forked at their first batch and kept until `close`: the k-th item of each batch
    (k >= 1) goes to the k-th child. Objects in `shared` travel as references to the child's own copy of them,
    as it was at the fork: they must not change while the children live (the search's graph, cluster and cost
    options do not). A child that fails is ended and its item solved in this process; later batches then fork
    per batch (`map_forked`)."""

    def __init__(self, shared: Sequence[object]) -> None:
        self.shared = list(shared)
        self.ids = {id(obj): i for i, obj in enumerate(self.shared)}
        self.children: list[_Child] = []
        self.failed = False

    def map(self, fn: Callable[[_In], _Out], items: Sequence[_In]) -> list[_Out]:
        """[fn(x) for x in items], the first in this process and each other one in a child at the same time."""
        if self.failed:
            return map_forked(fn, items)
        while len(self.children) < len(items) - 1:
            self.children.append(_Child(self.shared))
        sent = [child.send(_dumps((fn, item), self.ids)) for child, item in zip(self.children, items[1:])]
        out = [fn(items[0])] if items else []
        for k, item in enumerate(items[1:]):
            got = self.children[k].receive() if sent[k] else None
            if got is None:  # the child failed: this item here (raising its error, if it has one)
                self.failed = True
                out.append(fn(item))
            else:
                out.append(cast(_Out, got[0]))
        if self.failed:
            self.close()
        return out

    def close(self) -> None:
        """End the children (each leaves at the end of its pipe) and reap them."""
        for child in self.children:
            child.close()
        self.children = []


_LENGTH = struct.Struct("<Q")


class _Child:
    """One forked side solver: requests in, results out, each a length and a pickle."""

    def __init__(self, shared: list[object]) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()

        def serve() -> None:  # the parent solves an item itself where this fails
            os.close(down_w)
            os.close(up_r)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the children
            logging.disable(logging.CRITICAL)
            warnings.simplefilter("ignore")
            while (request := _read(down_r)) is not None:
                unpickler = pickle.Unpickler(io.BytesIO(request))
                unpickler.persistent_load = shared.__getitem__  # type: ignore[method-assign]
                fn, item = unpickler.load()
                try:
                    result: bytes = pickle.dumps((fn(item),), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception:  # noqa: BLE001 - the parent solves it again, and raises the error there
                    result = b""
                _write(up_w, result)

        self.pid = processes.fork(serve)
        os.close(down_r)
        os.close(up_w)
        self.down, self.up = down_w, up_r

    def send(self, request: bytes) -> bool:
        """Whether the request went out (the child may be gone)."""
        try:
            _write(self.down, request)
            return True
        except OSError:
            return False

    def receive(self) -> tuple[object] | None:
        """The child's result, or None where its function raised or the child is gone."""
        data = _read(self.up)
        if not data:
            return None
        try:
            return cast(tuple[object], pickle.loads(data))
        except Exception:  # noqa: BLE001 - a broken result: solved again in the parent
            return None

    def close(self) -> None:
        for fd in (self.down, self.up):
            try:
                os.close(fd)
            except OSError:
                pass
        processes.end(self.pid)


def _dumps(obj: object, ids: dict[int, int]) -> bytes:
    """`obj` pickled, the objects of `ids` (by identity) as references to the child's copy."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)

    def persistent_id(o: Any) -> int | None:
        return ids.get(id(o))

    pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    pickler.dump(obj)
    return buf.getvalue()


def _write(fd: int, data: bytes) -> None:
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(fd: int) -> bytes | None:
    """One message, or None at the end of the pipe."""
    head = _read_exactly(fd, _LENGTH.size)
    if head is None:
        return None
    (n,) = _LENGTH.unpack(head)
    return _read_exactly(fd, n) if n else b""
