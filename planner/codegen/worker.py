"""The plan-time check in a forked process that gets ready while the model is analysed and searched.

Part of the check's time does not depend on the plan: importing the TP runtime (DTensor) and torch's
symbolic shapes (sympy), the first calls of the meta kernels, loading the model file, building the model on
meta and tracing it. `CheckWorker.start` forks the planner once the model file is loaded (torch, and
transformers for a Hugging Face model, imported), before the model is analysed; the child does that work
(`planner.runtime.check.warm_up`, `Prepared`) while the parent analyses and searches, then runs the same
check on each plan the parent sends and answers with its result or the PlannerError it raised. The parent
sends the search's first guess before any candidate is solved (`Search.guess`: the plan of a candidate of
least bound, its blocks spread evenly; a check's first run also warms the kernels every later check runs),
and the child traces the model ahead only after it (a trace cannot be interrupted, and a plan without a
pipeline does not read it). It sends each plan that becomes the search's best so far at once
(`CheckWorker.ahead`: the final plan is often found long before the search has proven it best, so its check
runs beside the rest of the search; one that a newer best replaces before the worker gets to it is dropped),
then the final plan (its answer is the one to a plan sent ahead with the same `CheckInputs`), and runner-ups
where the check refuses it. A worker not
ready when the search ends is waited for only where its preparation serves the plan's check
(`prepared_serves`: then the rest of it is work the check would do in the planner's process too; a large
model's preparation can outlast the search, and the check of a model run as written does not use it), else
the check runs in the planner's own process; it runs there too where the worker dies or fails otherwise
than by the user's error, and where there is no worker: no fork (not Linux), one CPU, CUDA initialised (a
forked child cannot use it), other threads running (a fork could inherit a held lock), or
PLANNER_CHECK_WORKER=0.
PLANNER_CHECK_WORKER=wait waits for the worker however long it takes to get ready (the tests of its answers
use it: a small model's search ends before it is).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from planner import processes
from planner.codegen.check import CheckInputs
from planner.errors import PlannerError
from planner.model.graph import ModelSource
from planner.plan import Plan
from planner.runtime.layout import runs_traced_graph, sizes_in_code

log = logging.getLogger(__name__)

WORKER_ENV = "PLANNER_CHECK_WORKER"
Request = tuple[int, CheckInputs, bool]  # to the worker: message number, a plan's check inputs, sent ahead
# A plan sent ahead is checked once no newer request has come for this long: the search's best changes in
# bursts (a batch of candidates solved side by side, small ones simulated one after another), and a check
# started cannot be stopped for a newer one (it would also take the preparation, made for one check).
AHEAD_SETTLE_S = 0.05
WORKER_NICENESS = 19  # the lowest scheduling priority (os.nice): the worker only takes CPU time the planner leaves


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
    _join_stopped_display()
    return threading.active_count() == 1


def _join_stopped_display() -> None:
    """rich's Live display, once stopped, tells its refresh thread to end but does not wait for it: a loaded
    machine may not have run it to its end yet when the planner asks whether it can fork. Such a thread (its
    `done` event set) is waited for."""
    live = sys.modules.get("rich.live")
    refresh = getattr(live, "_RefreshThread", None)
    if refresh is None:
        return
    for thread in threading.enumerate():
        if isinstance(thread, refresh) and thread.done.is_set():
            thread.join(timeout=5.0)


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
    """Whether the worker's preparation (the model built on meta; traced for a micro-batch of one later, with
    the experts kept as calls, `Prepared.trace_ahead`) stands for the build and trace of this plan's check: a
    traced graph (a pipeline, sequence parallelism) from plain torch.fx, which holds no shape, or traced for a
    micro-batch of one."""
    p = plan.parallel
    graph = runs_traced_graph(p.pp, p.tp, p.sequence_parallel, sizes_in_code(plan.tp.head_attrs, plan.tp.fused))
    convs = p.tp > 1 and bool(plan.tp.transposed)  # kept as calls under tp: a trace of its own
    return graph and not plan.experts and not convs and (plan.trace_method == "fx" or p.micro_batch_size == 1)


def tp_likely(pinned_tp: int | None, total_params: int, gpu_memory_bytes: float) -> bool:
    """Whether the plan will likely shard with TP, so that the worker imports DTensor ahead: tp pinned above 1,
    or not pinned and the model's training state (16 bytes a parameter: bf16 weights and gradients, fp32
    master weights and Adam's two moments) more than one GPU holds."""
    if pinned_tp is not None:
        return pinned_tp > 1
    return total_params * 16 > gpu_memory_bytes


class Channel:
    """Pickled messages, each framed by its length, over a pair of pipe descriptors: sent without blocking (what
    the pipe cannot take yet waits in a buffer, written by later calls) and received with or without blocking,
    so that neither side stalls the other: the parent sends plans ahead while it searches, the worker drops a
    plan a newer one has replaced."""

    _HEADER = struct.Struct("<Q")

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        os.set_blocking(write_fd, False)
        self._in = bytearray()
        self._out = bytearray()
        self._eof = False

    def send(self, message: object) -> None:
        """Queue `message` and write what the pipe takes now."""
        data = pickle.dumps(message)
        self._out += self._HEADER.pack(len(data)) + data
        self._pump(0)

    def receive(self, block: bool = True) -> Any:
        """The next message; None where none is whole yet and not `block`. Raises EOFError once the other side
        has closed its end (OSError where the pipe breaks), pickle.UnpicklingError on a broken message."""
        while True:
            message = self._take()
            if message is not None or not block:
                return message[0] if message is not None else None
            self._pump(None)

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether a whole message is waiting, or arrives within `timeout` seconds (reads what has arrived)."""
        deadline = time.monotonic() + timeout
        while True:
            self._pump(0)
            if self._whole() is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._eof:
                return False
            self._pump(left)

    def _whole(self) -> int | None:
        if len(self._in) < self._HEADER.size:
            return None
        (n,) = self._HEADER.unpack_from(self._in)
        return n if len(self._in) >= self._HEADER.size + n else None

    def _take(self) -> tuple[Any] | None:
        self._pump(0)
        n = self._whole()
        if n is None:
            if self._eof:
                raise EOFError("the other side closed the pipe")
            return None
        start = self._HEADER.size
        data = bytes(self._in[start:start + n])
        del self._in[: start + n]
        try:
            return (pickle.loads(data),)
        except Exception as e:  # noqa: BLE001 - e.g. an exception class whose arguments do not rebuild it
            raise pickle.UnpicklingError(f"a message did not unpickle ({type(e).__name__}: {e})") from e

    def _pump(self, timeout: float | None) -> None:
        """Write what is queued and read what has arrived; wait up to `timeout` (None: until something moves)."""
        while True:
            writing = [self.write_fd] if self._out else []
            reading = [] if self._eof else [self.read_fd]
            if not writing and not reading:
                return
            r, w, _ = select.select(reading, writing, [], timeout)
            if not r and not w:
                return
            if w:
                try:
                    sent = os.write(self.write_fd, self._out)
                except BlockingIOError:
                    sent = 0
                del self._out[:sent]
            if r:
                chunk = os.read(self.read_fd, 1 << 16)
                if chunk:
                    self._in += chunk
                else:
                    self._eof = True
            if timeout is None:
                return
            timeout = 0  # drain what is there, then return

    def flush(self) -> None:
        """Block until everything queued is written (reading what arrives meanwhile: neither side can then wait
        on a full pipe that the other waits to write to)."""
        while self._out:
            self._pump(None)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class CheckWorker:
    """The parent's handle on the forked check: `ahead(plan)` sends a plan whose check may be wanted (the
    search's best so far) without waiting; `check(plan)` returns the check's result for a plan (or raises its
    PlannerError), the answer to a plan with the same CheckInputs sent ahead where there was one; None where
    the worker cannot answer (the caller checks in-process)."""

    def __init__(self, pid: int, channel: Channel) -> None:
        self.pid = pid
        self._channel: Channel | None = channel
        self._ready = False
        self._sent: list[tuple[CheckInputs, int]] = []  # what the worker was asked to check, by message number
        self._answers: dict[int, tuple[str, Any]] = {}

    @classmethod
    def start(
        cls, model_path: str, source: ModelSource, seed: int, pinned_tp: int | None, gpu_memory_bytes: float
    ) -> CheckWorker | None:
        """Fork the worker (None where `worker_allowed` says no), once the model file is loaded and before it is
        analysed. `model_path`: the model file, named in the errors of its code (its exits, signals) as the
        in-process check names it; `source` and `seed`: the model and seed the plans will name (plan.model,
        plan.training.seed), prepared for ahead; `pinned_tp` and `gpu_memory_bytes`: whether TP is likely
        (`tp_likely`, with the prepared model's parameters), so that the worker warms up the TP runtime too."""
        if not worker_allowed():
            return None
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()

        def child() -> None:  # where it fails, the parent sees the pipe close and checks in-process
            os.close(to_child_w)
            os.close(to_parent_r)
            _serve(model_path, source, seed, pinned_tp, gpu_memory_bytes, Channel(to_child_r, to_parent_w))

        # What is alive now (torch, the planner) lives as long as either process: out of the collector's sight,
        # whose passes would otherwise write to every page of it in both (copies, after the fork).
        gc.freeze()
        pid = processes.fork(child)
        os.close(to_child_r)
        os.close(to_parent_w)
        log.debug("plan-time check: worker process %d gets ready while the model is analysed and searched", pid)
        return cls(pid, Channel(to_parent_r, to_child_w))

    def ahead(self, plan: Plan) -> None:
        """Send `plan` to be checked while the search goes on (the best so far: the search's final plan often
        is, found long before the search has proven it). Nothing is waited for; a plan sent ahead that a newer
        one replaces before the worker starts it is dropped there."""
        if self._channel is None:
            return
        try:
            inputs = CheckInputs.of(plan)
        except PlannerError:  # a plan the runtime refuses: the check raises that when (if) it is the final one
            return
        if self._number(inputs) is not None:
            return
        try:
            self._ask(inputs, ahead=True)
        except OSError as e:  # the worker is gone: the check runs in this process
            log.debug("plan-time check: worker gone (%s)", e)
            self.close()

    def check(self, plan: Plan, meanwhile: Callable[[], None] | None = None) -> str | None:
        """The check's result for `plan` from the worker: the method it would run ("module", "fx", ...); raises
        the PlannerError the check raised; None where the worker gave no answer (it is closed then).
        `meanwhile`: called once before waiting for the answer, where it has not come yet (the planner renders
        the plan's outputs then)."""
        if self._channel is None:
            return None
        inputs = CheckInputs.of(plan)
        try:
            if not self._ready:
                # Waited for where its preparation serves this plan's check (then the rest of it is work the
                # check would do here too), else used only if it is ready: a large model's preparation can
                # outlast the search, and the check of the model as written does not use it.
                waits = _setting() == "wait" or prepared_serves(plan)
                if not waits and not self._channel.ready():
                    log.debug("plan-time check: worker not ready when the search ended; checking in this process")
                    self.close()
                    return None
                self._receive()
                if not self._ready:
                    raise pickle.UnpicklingError("an answer came before the worker was ready")
            number = self._number(inputs)
            if number is None:
                number = self._ask(inputs, ahead=False)
            else:
                log.debug("plan-time check: the worker was sent this plan ahead, during the search")
            self._channel.flush()
            while True:
                answer = self._answers.get(number)
                if answer is None and meanwhile is not None and not self._channel.ready():
                    meanwhile()
                    meanwhile = None
                    continue
                if answer is None:
                    self._receive()
                elif answer[0] == "skipped":  # replaced before the worker got to it: asked again
                    number = self._ask(inputs, ahead=False)
                else:
                    break
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            log.debug("plan-time check: worker gave no answer (%s); checking in this process", e)
            self.close()
            return None
        kind, value = answer
        if kind in ("ok", "error"):
            log.debug("plan-time check: the worker answered (%s)", kind)
        if kind == "ok":
            return str(value)
        if kind == "error":
            raise value
        log.debug("plan-time check: worker failed (%s); checking in this process", value)
        return None

    def _number(self, inputs: CheckInputs) -> int | None:
        """The message number of a request for `inputs` not dropped by the worker, if one was sent."""
        for sent, number in self._sent:
            if sent == inputs and self._answers.get(number, ("",))[0] != "skipped":
                return number
        return None

    def _ask(self, inputs: CheckInputs, ahead: bool) -> int:
        assert self._channel is not None
        number = len(self._sent)
        self._sent.append((inputs, number))
        self._channel.send((number, inputs, ahead))
        return number

    def _receive(self) -> None:
        """One message from the worker (blocking): its readiness, or an answer, kept by number."""
        assert self._channel is not None
        message = self._channel.receive()
        if message == ("ready",):
            self._ready = True
            return
        number, kind, value = message
        self._answers[number] = (kind, value)

    def close(self) -> None:
        """End the worker (at once: it writes nothing); it is reaped once gone (`processes.end`)."""
        if self._channel is None:
            return
        self._channel.close()
        self._channel = None
        processes.end(self.pid, wait=False)


def _serve(
    model_path: str, source: ModelSource, seed: int, pinned_tp: int | None, gpu_memory_bytes: float, channel: Channel
) -> None:
    """The child: warm up and prepare, then check each plan received until the parent closes the pipe; a plan
    sent ahead that a newer message follows is dropped (answered "skipped")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this process
    gc.enable()  # forked before the model's build, where the planner collects nothing yet (processes.defer_collection)
    # Work ahead, on a CPU the planner leaves free: where the search runs solvers on every CPU (CBC's processes
    # beside the search thread) the worker yields to them; the parent waits for it only once it is done.
    os.nice(WORKER_NICENESS)
    import torch

    from planner.codegen.check import check_runs, mixer_stand_in
    from planner.codegen.render import model_file
    from planner.model.grouping import discover_structure
    from planner.model.guard import user_code
    from planner.runtime.check import Cancelled, Prepared, warm_up
    from planner.runtime.scans import each_scan_once

    torch.set_num_threads(1)  # a forked intra-op thread pool is not safe to use; the check runs on meta
    prepared: Prepared | None = None
    try:
        warm_up()
        # (the trace's values of a Mamba mixer are its output's shape, the same from the fused stand-in as from
        # its reference scan, which takes seconds on meta: any plan's check can take this trace)
        with user_code(model_path, "Checking that the plan runs", None):
            prepared = Prepared(model_file(source), seed)
    except Exception as e:  # noqa: BLE001 - an optimisation: each check starts from scratch without it
        log.debug("plan-time check: worker could not prepare (%s)", e)
    log.debug("plan-time check: worker ready (%s)", "prepared" if prepared is not None else "not prepared")
    channel.send(("ready",))
    channel.flush()
    # The TP runtime's import and first calls, while no plan is waiting (an import cannot be interrupted, so a
    # plan with tp 1 may wait for it: done only where tp > 1 is likely).
    params = sum(p.numel() for p in prepared.meta_model.parameters()) if prepared is not None else 0
    if prepared is not None and tp_likely(pinned_tp, params, gpu_memory_bytes) and not channel.ready():
        try:
            warm_up(tp=True)
        except Exception as e:  # noqa: BLE001 - an optimisation: the check imports what it needs itself
            log.debug("plan-time check: worker could not warm up TP (%s)", e)
    # Whether the model runs on meta, found while no plan waits (`Prepared.probe_meta`): the checks of a model
    # that does not (Hugging Face's, Whisper's 0.14 s of its 0.64) skip that run.
    if prepared is not None and not channel.ready():
        started = time.perf_counter()
        try:
            with user_code(model_path, "Checking that the plan runs", None), each_scan_once(mixer_stand_in("cuda")):
                prepared.probe_meta(channel.ready, discover_structure(prepared.meta_model).roots)
            log.debug(
                "plan-time check: worker ran the model on meta ahead (%s) in %.2f s",
                "fails" if prepared.fails_on_meta else "runs", time.perf_counter() - started,
            )
        except Cancelled:
            log.debug("plan-time check: worker stopped its run on meta after %.2f s", time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - an optimisation: each check runs the model on meta itself
            log.debug("plan-time check: worker could not run the model on meta ahead (%s)", e)
    pending: deque[Request] = deque()
    served = False
    while True:
        if not pending and prepared is not None and not channel.ready():
            # The model as written, built on meta for the next check of a plan without a traced pipeline, while
            # no plan waits (Prepared.build_spare: a large model's check takes it instead of building its own).
            try:
                with user_code(model_path, "Checking that the plan runs", None):
                    prepared.build_spare()
            except Exception as e:  # noqa: BLE001 - an optimisation: the check builds the model itself
                log.debug("plan-time check: worker could not build the model ahead (%s)", e)
            if served and not channel.ready():
                # The trace a traced pipeline's check takes, while no plan waits. It cannot be interrupted (a plan
                # sent meanwhile waits for it), so it waits for the first plan, the search's first guess
                # (planner.search's on_guess, sent before any candidate is solved): a guess without a pipeline is
                # checked first (the trace is no use to it), one with a pipeline takes the prepared model and
                # traces it itself.
                # (the trace's values of a Mamba mixer are its output's shape, the same from the fused stand-in
                # as from its reference scan, which takes seconds on meta: any plan's check can take this trace)
                try:
                    with user_code(model_path, "Checking that the plan runs", None), each_scan_once(
                        mixer_stand_in("cuda")
                    ):
                        prepared.trace_ahead(_experts_of)
                except Exception as e:  # noqa: BLE001 - an optimisation: the check traces itself without it
                    log.debug("plan-time check: worker could not trace ahead (%s)", e)
        if not pending:
            try:
                pending.append(channel.receive())
            except EOFError:
                return
        while channel.ready(AHEAD_SETTLE_S if pending[-1][2] else 0.0):
            pending.append(channel.receive())
        skipped, (number, inputs, ahead) = _next_request(pending)
        served = True
        for n in skipped:
            channel.send((n, "skipped", None))
        answer: tuple[str, Any]
        # A plan sent ahead stops at the check's next step once a newer request comes (the search found a better
        # plan): dropped, as one that never started.
        # What is alive now (the prepared model, the warm-ups' imports) outside the collector's sight too: its
        # passes over the model's modules and torch's objects slowed a check of Llama-3-70B by a third.
        gc.freeze()
        started = time.perf_counter()
        try:
            with user_code(model_path, "Checking that the plan runs", None):
                answer = ("ok", check_runs(inputs, prepared, cancel=channel.ready if ahead else None))
        except Cancelled:
            answer = ("skipped", None)
        except PlannerError as e:
            answer = ("error", e)
        except Exception as e:  # noqa: BLE001 - not the user's error: the parent reruns the check itself
            answer = ("failed", f"{type(e).__name__}: {e}")
        took = time.perf_counter() - started
        log.debug("plan-time check: worker checked plan %d (%s) in %.2f s", number, answer[0], took)
        try:
            channel.send((number, *answer))
        except Exception as e:  # noqa: BLE001 - an error that does not pickle: the parent reruns the check
            channel.send((number, "failed", f"unpicklable answer ({e})"))
        channel.flush()


def _experts_of(model: Any) -> frozenset[str]:
    """The experts modules a traced pipeline of `model` keeps as calls (the analysis' units' experts, which
    the plan names: planner.pipeline._kept_experts)."""
    from planner.model.moe import find_moe_layers

    return frozenset(layer.experts for layer in find_moe_layers(model))


def _next_request(pending: deque[Request]) -> tuple[list[int], Request]:
    """The next request to check, taken from `pending` (not empty), and the numbers of those dropped before it:
    a plan sent ahead that a newer request follows was the search's best only for a while."""
    skipped = []
    while pending[0][2] and len(pending) > 1:
        skipped.append(pending.popleft()[0])
    return skipped, pending.popleft()
