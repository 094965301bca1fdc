"""The plan-time check in a forked worker (planner/codegen/worker.py): `planner plan` writes the same files and
reports the same errors as with the check in its own process, falls back to that check where the worker dies,
and starts no worker beside other threads. The check's start made ahead (runtime.check.Prepared) gives the
same answers as a check from scratch and is taken only by a check of the same model file and seed."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

import pytest
from e2e.plans import make_plan

from planner.codegen.check import CheckInputs, check_plan_runs, check_runs
from planner.codegen.render import model_file
from planner.codegen.worker import (
    Channel,
    CheckWorker,
    _next_request,
    _stop_tqdm_monitor,
    prepared_serves,
    tp_likely,
    worker_allowed,
)
from planner.errors import PlanError
from planner.runtime import stages
from planner.runtime.check import Cancelled, Prepared

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny_gpt.py"
GPT = ROOT / "sample_models" / "gpt.py"
CPU4 = ["--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", "8", "--quiet"]

PROBE = ROOT / "tests" / "fixtures" / "models" / "worker_probe.py"  # behaves otherwise in the worker

needs_fork = pytest.mark.skipif(
    sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2, reason="the worker forks on Linux with 2+ CPUs"
)


def _plan(
    out: Path, *args: str, worker: bool | str = True, model: Path = TINY, probe: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "PLANNER_NO_CACHE": "1", "TEST_PID": str(os.getpid()),
        "PLANNER_CHECK_WORKER": worker if isinstance(worker, str) else "wait" if worker else "0", **(probe or {}),
    }
    cmd = [sys.executable, "-m", "planner.cli.main", "--debug", "plan", str(model), *CPU4, "--out", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@needs_fork
@pytest.mark.parametrize(
    ("model", "pins"), [(TINY, ("--pp", "2")), (GPT, ("--tp", "2", "--sequence-parallel"))], ids=["pp2", "tp2-sp"]
)
def test_the_worker_checks_the_plan_and_the_files_are_the_same(tmp_path, model, pins):
    forked = _plan(tmp_path / "forked", *pins, model=model)
    here = _plan(tmp_path / "here", *pins, worker=False, model=model)
    assert forked.returncode == 0 and here.returncode == 0, forked.stderr[-3000:] + here.stderr[-3000:]
    assert "gets ready while the model is analysed and searched" in forked.stderr
    assert "the worker answered (ok)" in forked.stderr
    assert "the worker was sent this plan ahead, during the search" in forked.stderr  # the search's last best
    assert "worker" not in here.stderr
    assert _files(tmp_path / "forked") == _files(tmp_path / "here")


@needs_fork
def test_with_the_progress_display_the_worker_is_forked_between_its_two_parts(tmp_path):
    """On a terminal (rich's FORCE_COLOR) the display runs a refresh thread: it ends after loading the model file
    and starts again after the fork, so the worker is forked and answers."""
    args = [a for a in CPU4 if a != "--quiet"]
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "PLANNER_NO_CACHE": "1", "PLANNER_CHECK_WORKER": "wait",
        "FORCE_COLOR": "1",
    }
    cmd = [sys.executable, "-m", "planner.cli.main", "--debug", "plan", str(TINY), *args, "--pp", "2",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Solving stage partitions" in done.stderr  # the display ran
    assert "gets ready while the model is analysed and searched" in done.stderr
    assert "the worker answered (ok)" in done.stderr


@needs_fork
def test_a_model_that_fails_the_check_is_reported_the_same_through_the_worker(tmp_path):
    args = ("--pp", "2", "--loss-fn", "loss_fn")
    vector = {"PROBE_LOSS": "vector"}  # not a scalar
    forked = _plan(tmp_path / "forked", *args, model=PROBE, probe=vector)
    here = _plan(tmp_path / "here", *args, model=PROBE, probe=vector, worker=False)
    assert forked.returncode == here.returncode == 2
    assert "the worker answered (error)" in forked.stderr

    def error(stderr: str) -> str:
        return stderr[stderr.index("Error: ") :].strip()

    assert "floating-point scalar" in error(forked.stderr) and error(forked.stderr) == error(here.stderr)
    assert not (tmp_path / "forked").exists() or not any((tmp_path / "forked").iterdir())


@needs_fork
def test_the_outputs_rendered_while_the_worker_checks_are_the_files_written(tmp_path):
    """Where the worker's answer has not come when the search ends, the planner renders the plan's outputs
    while it waits (`check_plan`'s meanwhile): the files are those of a plan checked in its own process."""
    args = ("--pp", "2", "--loss-fn", "loss_fn")
    slow = {"PROBE_LOSS": "slow"}
    forked = _plan(tmp_path / "forked", *args, model=PROBE, probe=slow)
    here = _plan(tmp_path / "here", *args, model=PROBE, probe=slow, worker=False)
    assert forked.returncode == here.returncode == 0, forked.stderr[-3000:] + here.stderr[-3000:]
    assert "outputs rendered while the worker checks" in forked.stderr
    assert "the worker answered (ok)" in forked.stderr
    assert _files(tmp_path / "forked") == _files(tmp_path / "here")


@needs_fork
def test_a_worker_that_dies_gives_way_to_the_check_in_process(tmp_path):
    args = ("--pp", "2", "--loss-fn", "loss_fn")
    forked = _plan(tmp_path / "forked", *args, model=PROBE, probe={"PROBE_LOSS": "kill"})
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert "worker gave no answer" in forked.stderr and "the worker answered" not in forked.stderr
    assert _plan(tmp_path / "here", *args, model=PROBE, worker=False).returncode == 0
    assert _files(tmp_path / "forked") == _files(tmp_path / "here")


def test_no_worker_is_forked_beside_another_thread():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not worker_allowed()
    finally:
        stop.set()
        other.join()


def test_no_worker_is_forked_once_cuda_is_initialised(monkeypatch):
    import torch

    monkeypatch.setattr(threading, "active_count", lambda: 1)  # as in a planner process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("PLANNER_CHECK_WORKER", raising=False)
    assert worker_allowed()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not worker_allowed()


def test_tqdms_monitor_thread_is_stopped_for_good():
    from tqdm import tqdm

    from planner.runtime.stages import ValueRecorder  # an fx Interpreter: each run opens a tqdm bar

    tqdm(total=1, disable=True).close()
    _stop_tqdm_monitor()
    assert tqdm.monitor is None
    import torch
    from torch import fx, nn

    ValueRecorder(fx.symbolic_trace(nn.Linear(2, 2, device="meta"))).run(torch.empty(1, 2, device="meta"))
    assert tqdm.monitor is None and not any(t.name == "tqdm_monitor" for t in threading.enumerate())


def _traces(monkeypatch) -> list[object]:
    calls: list[object] = []
    original = stages.BufferTracer.trace

    def counted(self, *args, **kwargs):
        calls.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(stages.BufferTracer, "trace", counted)
    return calls


@pytest.mark.parametrize("micro_batch_size", [1, 2], ids=["same-inputs", "other-shapes"])
def test_a_prepared_check_traces_nothing_more_and_answers_the_same(monkeypatch, micro_batch_size):
    plan = make_plan("gpt", pp=2, micro_batch_size=micro_batch_size)
    scratch = check_plan_runs(plan)
    prepared = Prepared(model_file(plan.model), plan.training.seed)
    prepared.trace_ahead()
    traces = _traces(monkeypatch)
    assert check_plan_runs(plan, prepared) == scratch == "fx"
    assert traces == []  # the graph traced ahead was taken
    assert check_plan_runs(plan, prepared) == scratch and len(traces) == 1  # taken once: traced again


def test_a_prepared_check_of_another_seed_or_model_is_not_taken(monkeypatch):
    plan = make_plan("gpt", pp=2)
    spec = model_file(plan.model)
    other_args = dataclasses.replace(spec, model_args={**spec.model_args, "layers": 6})
    for prepared in (Prepared(spec, plan.training.seed + 1), Prepared(other_args, plan.training.seed)):
        prepared.trace_ahead()
        traces = _traces(monkeypatch)
        assert check_plan_runs(plan, prepared) == "fx"
        assert len(traces) == 1


def test_a_check_of_the_model_as_written_builds_its_own():
    """A plan without a traced pipeline runs the model as written: not one whose forward was traced ahead."""
    plan = make_plan("gpt", dp=2)
    prepared = Prepared(model_file(plan.model), plan.training.seed)
    assert check_plan_runs(plan, prepared) == "module"
    assert prepared.take(model_file(plan.model), plan.training.seed) is prepared  # still there, not taken


@needs_fork
def test_a_worker_not_ready_when_the_search_ends_is_not_waited_for(tmp_path):
    """A worker still preparing (here its build_model sleeps) when the search ends is not waited for where its
    preparation does not serve the plan (a model run as written: no pipeline): the check runs in this process
    and the plan is the same."""
    args = ("--dp", "4", "--loss-fn", "loss_fn")
    forked = _plan(tmp_path / "forked", *args, model=PROBE, probe={"PROBE_BUILD": "sleep"}, worker="1")
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert "gets ready while the model is analysed and searched" in forked.stderr
    assert "not ready when the search ended; checking in this process" in forked.stderr
    assert "the worker answered" not in forked.stderr
    assert _plan(tmp_path / "here", *args, model=PROBE, worker=False).returncode == 0
    assert _files(tmp_path / "forked") == _files(tmp_path / "here")


def test_the_worker_is_waited_for_where_its_preparation_serves_the_plan():
    fx_pp2 = make_plan("gpt", pp=2)
    assert prepared_serves(fx_pp2)
    assert prepared_serves(make_plan("gpt", tp=2, sequence_parallel=True))
    assert not prepared_serves(make_plan("gpt", dp=2))  # the model as written: built afresh, never traced
    meta_mbs2 = fx_pp2.model_copy(update={"trace_method": "fx-meta"})  # shapes fixed for a micro-batch of 2
    assert not prepared_serves(meta_mbs2)
    mbs1 = fx_pp2.parallel.model_copy(update={"micro_batch_size": 1})
    assert prepared_serves(meta_mbs2.model_copy(update={"parallel": mbs1}))


def test_the_tp_runtime_is_warmed_up_where_tp_is_likely():
    gib80 = 80 * 2**30
    assert tp_likely(None, 175_000_000_000, gib80)  # GPT-3's training state holds 2.8 TB
    assert not tp_likely(None, 1_000_000, gib80)
    assert tp_likely(2, 1_000_000, gib80) and not tp_likely(1, 175_000_000_000, gib80)  # pinned


class _NotRebuilt(Exception):
    def __init__(self, a: str, b: str) -> None:
        super().__init__(a)


def test_the_channel_sends_without_blocking_and_receives_whole_messages():
    """A message larger than the pipe holds is queued, not blocked on; the other side sees no message until it is
    whole, then exactly what was sent, in order."""
    a_r, b_w = os.pipe()
    b_r, a_w = os.pipe()
    a, b = Channel(a_r, a_w), Channel(b_r, b_w)
    try:
        big = ("plan", "x" * (1 << 20))
        a.send(big)  # 1 MiB into a pipe of 64 KiB: returns at once
        a.send(("next", 2))
        assert b.receive(block=False) is None and not b.ready()  # a part has arrived, not the whole
        got = []
        while len(got) < 2:
            a._pump(0)  # the sender writes more as the pipe drains (in the planner: its next send or its wait)
            message = b.receive(block=False)
            if message is not None:
                got.append(message)
        assert got == [big, ("next", 2)]
        a.send(_NotRebuilt("a", "b"))  # pickles, but its arguments do not rebuild it: a broken message
        a.send(("after", 3))
        with pytest.raises(pickle.UnpicklingError, match="did not unpickle"):
            b.receive()
        assert b.receive() == ("after", 3)  # the next message is read whole
        a.close()
        with pytest.raises(EOFError):
            b.receive()
    finally:
        b.close()


def test_a_plan_sent_ahead_is_dropped_where_a_newer_request_follows_it():
    request = ("inputs",)
    pending = deque([(0, request, True), (1, request, True), (2, request, False), (3, request, True)])
    assert _next_request(pending) == ([0, 1], (2, request, False))  # asked for, never dropped
    assert _next_request(pending) == ([], (3, request, True))  # the last one sent ahead is checked
    alone = deque([(4, request, False), (5, request, False)])
    assert _next_request(alone) == ([], (4, request, False))


def test_the_answer_to_a_plan_sent_ahead_is_the_final_checks_and_a_dropped_one_is_asked_again():
    """The parent's side against a scripted worker: the final plan's check takes the answer to the same plan sent
    ahead; where the worker dropped it (a newer best came first), the plan is sent again and that answer taken;
    a plan not sent ahead is sent when checked."""
    plan_a, plan_b = make_plan("gpt", pp=2), make_plan("gpt", dp=2)
    to_worker_r, to_worker_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    stand_in = subprocess.Popen(["sleep", "60"])  # the worker's pid, which close() ends
    worker = CheckWorker(stand_in.pid, Channel(to_parent_r, to_worker_w))
    scripted = Channel(to_worker_r, to_parent_w)
    try:
        worker.ahead(plan_a)
        worker.ahead(plan_a)  # the same inputs: not sent twice
        worker.ahead(plan_b)
        assert [scripted.receive()[:1] for _ in range(2)] == [(0,), (1,)]
        assert scripted.receive(block=False) is None
        scripted.send(("ready",))
        scripted.send((0, "skipped", None))
        scripted.send((1, "ok", "module"))
        scripted.send((2, "ok", "fx"))  # the answer to plan_a asked again (number 2), ready before it is asked
        assert worker.check(plan_b) == "module"
        assert worker.check(plan_a) == "fx"
        number, inputs, ahead = scripted.receive()
        assert (number, ahead) == (2, False) and inputs == CheckInputs.of(plan_a)
        plan_c = make_plan("gpt", pp=2, micro_batch_size=1)
        scripted.send((3, "error", PlanError("The plan cannot run: scripted")))
        with pytest.raises(PlanError, match="scripted"):
            worker.check(plan_c)
        assert scripted.receive()[0] == 3
    finally:
        worker.close()
        scripted.close()
    # ended by close(): killed, and reaped once gone (by close itself where it is gone already, else here)
    assert stand_in.wait(timeout=60) in (-9, 0)  # 0: Popen found it reaped already
    with pytest.raises(ProcessLookupError):
        os.kill(stand_in.pid, 0)


def test_a_check_stops_at_its_next_checkpoint_once_its_caller_says_so_and_leaves_nothing_behind():
    """The worker stops the check of a plan sent ahead once a newer plan comes (its `cancel` callback): no
    answer (not a refusal, which the check's own handlers would make of an error), and the next check runs as
    one from scratch."""
    plan = make_plan("gpt", tp=2, sequence_parallel=True, pp=2)
    calls: list[int] = []

    def stop_at_the_third() -> bool:
        calls.append(1)
        return len(calls) >= 3

    with pytest.raises(Cancelled):
        check_runs(CheckInputs.of(plan), cancel=stop_at_the_third)
    assert len(calls) == 3
    assert check_runs(CheckInputs.of(plan), cancel=lambda: False) == "fx"
    assert check_plan_runs(plan) == "fx"


def test_a_moe_trace_made_ahead_keeps_the_experts_as_calls_and_is_taken(tmp_path, monkeypatch):
    """The worker traces ahead with the experts modules as calls (a traced pipeline's graph keeps them so: the
    plan's `experts`), so a MoE pipeline's check takes that trace instead of tracing again (traced through,
    transformers' experts loop over every expert: seconds at Qwen3-30B-A3B's 48 x 128)."""
    from planner.codegen.worker import _experts_of
    from planner.plan import load_plan

    out = tmp_path / "plan"
    done = _plan(out, "--pp", "2", "--dp", "2", "--ep", "2", model=ROOT / "tests" / "fixtures" / "models" /
                 "deepseek_moe.py", worker=False)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = load_plan(out / "plan.json")
    assert plan.experts
    prepared = Prepared(model_file(plan.model), plan.training.seed)
    prepared.trace_ahead(_experts_of)
    assert prepared.traced is not None
    called = {n.target for n in prepared.traced.gm.graph.nodes if n.op == "call_module"}
    assert set(plan.experts) <= called
    traces = _traces(monkeypatch)
    assert check_plan_runs(plan, prepared) == check_plan_runs(plan)
    assert len(traces) == 1  # the second check's own: the first took the trace made ahead
    through = Prepared(model_file(plan.model), plan.training.seed)
    through.trace_ahead()  # the experts traced through: not the graph the check needs, which it traces itself
    assert len(traces) == 2
    assert check_plan_runs(plan, through) and len(traces) == 3


def test_a_stopped_display_thread_still_ending_is_waited_for_before_the_fork():
    """rich's Live sets its refresh thread's `done` on stop without joining it; on a loaded machine that thread
    can still be alive when the planner counts threads to decide whether it may fork (the worker was then not
    started: a flaky miss of the progress-display test under the full suite). It is joined first."""
    import time

    import rich.live

    from planner.codegen.worker import _join_stopped_display

    class SlowToEnd(rich.live._RefreshThread):
        def run(self) -> None:
            self.done.wait()
            time.sleep(0.3)

    thread = SlowToEnd(None, 1.0)  # type: ignore[arg-type]
    thread.start()
    thread.stop()
    assert thread.is_alive()
    _join_stopped_display()
    assert not thread.is_alive()


def _probe_check(monkeypatch, fails_on_meta: bool, *, item: bool = True, loss: str = "") -> tuple[str, int]:
    """The runtime's check of a dp 2 plan of the probe model (counted as large), with a Prepared that says the
    model fails on meta or not: (its answer or error, how many forward-loss-backward runs it made)."""
    from planner.runtime import check
    from planner.runtime.layout import Layout, ModelFile, Stage, Training

    monkeypatch.setattr(check, "SMALL", 0)
    monkeypatch.setenv("PROBE_ITEM", "1" if item else "")
    monkeypatch.setenv("PROBE_LOSS", loss)
    monkeypatch.setenv("TEST_PID", str(os.getppid()))  # this process is not the probe's worker
    spec = ModelFile(str(PROBE), "build_model", "example_inputs", "loss_fn", None, {})
    prepared = Prepared(spec, 0)
    prepared.fails_on_meta = fails_on_meta
    runs: list[int] = []
    original = check.CheckCase.loss_backward
    monkeypatch.setattr(check.CheckCase, "loss_backward", lambda *a, **k: runs.append(1) or original(*a, **k))
    modules = ("proj_in", "layers.0", "layers.1", "layers.2", "layers.3", "out")
    layout = Layout(pp=1, dp=2, tp=1, micro_batch_size=2, num_micro_batches=1, stages=(Stage(0, modules),))
    try:
        answer = check.check_plan_runs(layout, spec, Training(), "cpu", prepared)
    except Exception as e:  # noqa: BLE001 - compared as text
        answer = f"{type(e).__name__}: {e}"
    return answer, len(runs)


def test_the_meta_run_ahead_finds_a_model_that_fails_on_meta_and_stops_when_told(monkeypatch):
    from planner.model.grouping import discover_structure
    from planner.runtime import check
    from planner.runtime.layout import ModelFile

    monkeypatch.setenv("TEST_PID", str(os.getppid()))
    spec = ModelFile(str(PROBE), "build_model", "example_inputs", "loss_fn", None, {})
    for item, small, fails in [
        ("1", 0, True),  # .item() on meta: noted
        ("", 0, False),  # runs on meta
        ("1", check.SMALL, False),  # a small model's check goes to the CPU, not to fake tensors: not probed
    ]:
        monkeypatch.setenv("PROBE_ITEM", item)
        monkeypatch.setattr(check, "SMALL", small)
        prepared = Prepared(spec, 0)
        prepared.probe_meta(lambda: False, discover_structure(prepared.meta_model).roots)
        assert prepared.fails_on_meta is fails, (item, small)
    monkeypatch.setenv("PROBE_ITEM", "1")
    monkeypatch.setattr(check, "SMALL", 0)
    prepared = Prepared(spec, 0)
    with pytest.raises(Cancelled):
        prepared.probe_meta(lambda: True, discover_structure(prepared.meta_model).roots)  # at the first module call
    assert not prepared.fails_on_meta


def test_a_check_of_a_model_known_to_fail_on_meta_answers_the_same_with_one_run(monkeypatch):
    known, known_runs = _probe_check(monkeypatch, True)
    assert (known, known_runs) == ("module", 1)  # on fake tensors at once
    assert _probe_check(monkeypatch, False) == ("module", 2)  # on meta, failing, then on fake tensors
    # A loss that is no scalar: the same error either way.
    failing = _probe_check(monkeypatch, True, loss="vector")
    assert failing[0] == _probe_check(monkeypatch, False, loss="vector")[0]
    assert failing[0].startswith("RunError: The loss must be a floating-point scalar"), failing


def test_the_fake_tensor_run_makes_no_entries_in_torchs_fake_cache(monkeypatch):
    """The check's fake-tensor run has MetaMemo for a cache: torch's own cache of fake results is off there
    (its entries cost more to make than a one-off run gains), and the check answers as before."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    assert _probe_check(monkeypatch, True) == ("module", 1)  # the fake-tensor run, at once
    assert not FakeTensorMode.cache, len(FakeTensorMode.cache)
    with FakeTensorMode():  # where the cache is on, the same ops make entries: the test can tell
        torch.ones(4, 8, device="meta") @ torch.ones(8, 2, device="meta")
    assert FakeTensorMode.cache


def test_a_model_built_ahead_is_taken_once_by_a_check_of_the_model_as_written(monkeypatch):
    """Prepared.build_spare: the check of a plan without a traced pipeline (a large model's) takes the model
    built ahead instead of building one, once, for its own model file and seed only, and answers the same."""
    from planner.runtime import check
    from planner.runtime.layout import Layout, ModelFile, Stage, Training

    monkeypatch.setattr(check, "SMALL", 0)  # the probe model counts as large
    monkeypatch.setenv("PROBE_ITEM", "")
    monkeypatch.setenv("PROBE_LOSS", "")
    monkeypatch.setenv("TEST_PID", str(os.getppid()))
    spec = ModelFile(str(PROBE), "build_model", "example_inputs", "loss_fn", None, {})
    modules = ("proj_in", "layers.0", "layers.1", "layers.2", "layers.3", "out")
    layout = Layout(pp=1, dp=2, tp=1, micro_batch_size=2, num_micro_batches=1, stages=(Stage(0, modules),))
    builds: list[int] = []
    original = check.build_model
    monkeypatch.setattr(check, "build_model", lambda *a, **k: builds.append(1) or original(*a, **k))

    scratch = check.check_plan_runs(layout, spec, Training(), "cpu")
    built_from_scratch = len(builds)
    assert built_from_scratch >= 1
    prepared = Prepared(spec, 0)
    prepared.build_spare()
    spare = prepared.spare
    assert spare is not None and spare[0] is not prepared.user  # the file loaded again, as a check loads it
    builds.clear()
    assert check.check_plan_runs(layout, spec, Training(), "cpu", prepared) == scratch == "module"
    assert len(builds) == built_from_scratch - 1  # the one it would have built was the spare
    assert prepared.spare is None  # taken
    builds.clear()
    assert check.check_plan_runs(layout, spec, Training(), "cpu", prepared) == scratch
    assert len(builds) == built_from_scratch  # taken once: built again
    prepared.build_spare()
    assert prepared.take_spare(spec, 1) is None and prepared.take_spare(dataclasses.replace(spec, model_args={"x": 1}),
                                                                        0) is None
    assert prepared.take_spare(spec, 0) is not None and prepared.take_spare(spec, 0) is None


def test_no_model_is_built_ahead_for_a_small_model(monkeypatch):
    """A small model's check may run it on the CPU, whose random draws follow its build: it builds its own."""
    from planner.runtime import check

    plan = make_plan("gpt", dp=2)
    prepared = Prepared(model_file(plan.model), plan.training.seed)
    builds: list[int] = []
    original = check.build_model
    monkeypatch.setattr(check, "build_model", lambda *a, **k: builds.append(1) or original(*a, **k))
    prepared.build_spare()
    assert prepared.spare is None
    prepared.build_spare()  # and nothing is built to be dropped, however often it is asked
    assert prepared.spare is None and builds == []


def test_an_ended_process_not_waited_for_is_reaped_by_the_next_fork_or_end():
    """processes.end(pid, wait=False) kills and leaves the reaping to the next fork or end (the check worker's
    close: the kernel frees its memory while the planner writes its files)."""
    from planner import processes

    pids = [processes.fork(lambda: __import__("time").sleep(60)) for _ in range(2)]
    processes.end(pids[0], wait=False)
    processes.end(pids[1])  # waits: for both
    for pid in pids:
        with pytest.raises(ChildProcessError):  # reaped already
            os.waitpid(pid, os.WNOHANG)
    assert processes._unreaped == []
