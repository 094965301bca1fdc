"""The plan-time check in a forked process that gets ready while the search runs.

Part of the check's time does not depend on the plan: importing the TP runtime (DTensor) and torch's
symbolic shapes (sympy), the first calls of the meta kernels, loading the model file, building the model on
meta and tracing it. `CheckWorker.start` forks the planner once the model is analysed, before the search; the
child does that work (`planner.runtime.check.warm_up`, `Prepared`) while the parent searches, then runs the
same `check_plan_runs` on each plan the parent sends (the best, then runner-ups) and answers with its result
or the PlannerError it raised. A worker not ready when the search ends is waited for only where its
preparation serves the plan's check (`prepared_serves`: then the rest of it is work the check would do in
the planner's process too; a large model's preparation can outlast the search, and the check of a model run
as written does not use it), else the check runs in the planner's own process; it runs there too where the
worker dies or fails otherwise than by the user's error, and where there is no worker: no fork (not Linux),
one CPU, CUDA initialised (a forked child cannot use it), other threads running (a fork could inherit a held
lock), or PLANNER_CHECK_WORKER=0.
PLANNER_CHECK_WORKER=wait waits for the worker however long it takes to get ready (the tests of its answers
use it: a small model's search ends before it is).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
from typing import IO, Any

from planner.errors import PlannerError
from planner.model.graph import ModelSource
from planner.plan import Plan
from planner.runtime.layout import runs_traced_graph

log = logging.getLogger(__name__)

WORKER_ENV = "PLANNER_CHECK_WORKER"


def _setting() -> str:
    """PLANNER_CHECK_WORKER as given: "0" (or false, no) for none, "wait" to always wait for it."""
    return os.environ.get(WORKER_ENV, "").strip().lower()


def worker_allowed() -> bool:
    """Whether forking a check worker is safe and worth it here."""
    if _setting() in ("0", "false", "no"):
        return False
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    if len(os.sched_getaffinity(0)) < 2:
        return False  # the child would only take turns with the search
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False  # CUDA cannot be used in a forked child (model code may touch it: --measure ran on the GPU)
    _stop_tqdm_monitor()
    return threading.active_count() == 1


def _stop_tqdm_monitor() -> None:
    """torch.fx's Interpreter opens a tqdm bar (disabled) on every run, and the first bar starts tqdm's monitor
    thread (it tunes the refresh of slow bars). This process shows no bar: the thread is stopped, and not
    started again, so that the process can fork."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    std.tqdm.monitor_interval = 0
    monitor = std.tqdm.monitor
    if monitor is not None:
        monitor.exit()
        std.tqdm.monitor = None


def prepared_serves(plan: Plan) -> bool:
    """Whether the worker's preparation (the model built and traced for a micro-batch of one, without experts
    kept as calls) stands for the build and trace of this plan's check: a traced graph (a pipeline, sequence
    parallelism) from plain torch.fx, which holds no shape, or traced for a micro-batch of one."""
    p = plan.parallel
    graph = runs_traced_graph(p.pp, p.tp, p.sequence_parallel)
    return graph and not plan.experts and (plan.trace_method == "fx" or p.micro_batch_size == 1)


def tp_likely(pinned_tp: int | None, total_params: int, gpu_memory_bytes: float) -> bool:
    """Whether the plan will likely shard with TP, so that the worker imports DTensor ahead: tp pinned above 1,
    or not pinned and the model's training state (16 bytes a parameter: bf16 weights and gradients, fp32
    master weights and Adam's two moments) more than one GPU holds."""
    if pinned_tp is not None:
        return pinned_tp > 1
    return total_params * 16 > gpu_memory_bytes


class CheckWorker:
    """The parent's handle on the forked check: `check(plan)` sends a plan and returns the check's result
    (or raises its PlannerError); None where the worker cannot answer (the caller checks in-process)."""

    def __init__(self, pid: int, send: IO[bytes], recv: IO[bytes]) -> None:
        self.pid = pid
        self._send: IO[bytes] | None = send
        self._recv = recv
        self._ready = False

    @classmethod
    def start(cls, model_path: str, source: ModelSource, seed: int, warm_tp: bool) -> CheckWorker | None:
        """Fork the worker (None where `worker_allowed` says no). `model_path`: the model file, named in the
        errors of its code (its exits, signals) as the in-process check names it; `source` and `seed`: the
        model and seed the plans will name (plan.model, plan.training.seed), prepared for ahead; `warm_tp`:
        whether to warm up the TP runtime too (where `tp_likely`)."""
        if not worker_allowed():
            return None
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the parent's code
            code = 0
            try:
                os.close(to_child_w)
                os.close(to_parent_r)
                recv, send = os.fdopen(to_child_r, "rb"), os.fdopen(to_parent_w, "wb")
                _serve(model_path, source, seed, warm_tp, recv, send)
            except BaseException:  # noqa: BLE001 - the parent sees the pipe close and checks in-process
                code = 1
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(to_parent_w)
        log.debug("plan-time check: worker process %d gets ready while the search runs", pid)
        return cls(pid, os.fdopen(to_child_w, "wb"), os.fdopen(to_parent_r, "rb"))

    def check(self, plan: Plan) -> str | None:
        """The check's result for `plan` from the worker: the method it would run ("module", "fx", ...); raises
        the PlannerError the check raised; None where the worker gave no answer (it is closed then)."""
        if self._send is None:
            return None
        try:
            if not self._ready:
                # Waited for where its preparation serves this plan's check (then the rest of it is work the
                # check would do here too), else used only if it is ready: a large model's preparation can
                # outlast the search, and the check of the model as written does not use it.
                waits = _setting() == "wait" or prepared_serves(plan)
                if not waits and not select.select([self._recv], [], [], 0)[0]:
                    log.debug("plan-time check: worker not ready when the search ended; checking in this process")
                    self.close()
                    return None
                kind, _ = pickle.load(self._recv)
                if kind != "ready":
                    raise pickle.UnpicklingError(f"unexpected {kind!r} before the first plan")
                self._ready = True
            pickle.dump(plan, self._send)
            self._send.flush()
            kind, value = pickle.load(self._recv)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            log.debug("plan-time check: worker gave no answer (%s); checking in this process", e)
            self.close()
            return None
        if kind in ("ok", "error"):
            log.debug("plan-time check: the worker answered (%s)", kind)
        if kind == "ok":
            return str(value)
        if kind == "error":
            raise value
        log.debug("plan-time check: worker failed (%s); checking in this process", value)
        return None

    def close(self) -> None:
        """End the worker (at once: it writes nothing) and reap it."""
        if self._send is None:
            return
        for f in (self._send, self._recv):
            try:
                f.close()
            except OSError:
                pass
        self._send = None
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve(
    model_path: str, source: ModelSource, seed: int, warm_tp: bool, recv: IO[bytes], send: IO[bytes]
) -> None:
    """The child: warm up and prepare, then check each plan received until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this process
    import torch

    from planner.codegen.check import check_plan_runs
    from planner.codegen.render import model_file
    from planner.model.guard import user_code
    from planner.runtime.check import Prepared, warm_up

    torch.set_num_threads(1)  # a forked intra-op thread pool is not safe to use; the check runs on meta
    prepared: Prepared | None = None
    try:
        warm_up()
        with user_code(model_path, "Checking that the plan runs", None):
            prepared = Prepared(model_file(source), seed)
    except Exception as e:  # noqa: BLE001 - an optimisation: each check starts from scratch without it
        log.debug("plan-time check: worker could not prepare (%s)", e)
    send.write(pickle.dumps(("ready", None)))
    send.flush()
    # The TP runtime's import and first calls, while no plan is waiting (an import cannot be interrupted, so a
    # plan with tp 1 may wait for it: done only where tp > 1 is likely).
    if warm_tp and not select.select([recv], [], [], 0)[0]:
        try:
            warm_up(tp=True)
        except Exception as e:  # noqa: BLE001 - an optimisation: the check imports what it needs itself
            log.debug("plan-time check: worker could not warm up TP (%s)", e)
    while True:
        try:
            plan = pickle.load(recv)
        except EOFError:
            return
        answer: tuple[str, Any]
        try:
            with user_code(model_path, "Checking that the plan runs", None):
                answer = ("ok", check_plan_runs(plan, prepared))
        except PlannerError as e:
            answer = ("error", e)
        except Exception as e:  # noqa: BLE001 - not the user's error: the parent reruns the check itself
            answer = ("failed", f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(answer)
        except Exception as e:  # noqa: BLE001 - an error that does not pickle: the parent reruns the check
            data = pickle.dumps(("failed", f"unpicklable answer ({e})"))
        send.write(data)
        send.flush()
