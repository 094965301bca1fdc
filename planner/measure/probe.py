"""Timers inside a plan's own training run, for `planner validate --refit`.

torchrun starts this module in place of the plan's train.py (``-m planner.measure.probe train.py ARGS``).
It imports the plan's own copy of the runtime (planner_runtime/ beside train.py), wraps three of its
functions and then runs train.py unchanged:

- ``parallelize`` (called once per local stage, after which the stage's module is final): a forward
  pre-hook and hook on the stage's module time each micro-batch's forward.
- backward: with a pipeline, torch's ``PipelineStage.backward_one_chunk`` (one micro-batch of one stage,
  the loss's backward included on the last stage); without one, ``Tensor.backward`` (the step's only
  backward call is the micro-batch loss's, `planner_runtime.loop.accumulate`).
- ``peak_memory_bytes`` (every rank calls it once, after the last step and before the metrics are
  gathered): the collectives the cost model counts are run there on the run's own process groups, with
  the run's message sizes (given by the parent in the PLANNER_PROBE file), and each rank writes its
  timings to ``<out>.rank<R>.json``.

The collectives are re-run after the steps rather than caught inside them: FSDP2 and replicate issue
theirs asynchronously from C++ hooks, where no Python timer can see when each one ends; the same
groups, backend and sizes give the time each would take alone.

Not timed: the zero-bubble (ZBV) schedule's separate weight-gradient pass (``backward_weight_one_chunk``), so
its stages' backward reads low; the other schedules run the whole backward in ``backward_one_chunk``.

Timing: CUDA events on a GPU (not exercised here: no GPU in CI, the path is code-reviewed only),
``time.perf_counter`` on a CPU. This module imports only the standard library and torch, like the runtime.
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROBE_ENV = "PLANNER_PROBE"
WARMUP_STEPS = 1  # matches planner.cli.validate: the first step pays for lazy init and connection set-up


class _Clock:
    """Start/stop pairs on this rank's device: perf_counter on a CPU, CUDA events on a GPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.pending: list[tuple[str, int, Any, Any]] = []  # (kind, stage, start, end)

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, kind: str, stage: int, start: Any, end: Any) -> None:
        self.pending.append((kind, stage, start, end))

    def seconds(self) -> list[tuple[str, int, float]]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return [(k, s, a.elapsed_time(b) / 1e3) for k, s, a, b in self.pending]
        return [(k, s, b - a) for k, s, a, b in self.pending]


class Probe:
    """What one rank records: per stage forward/backward samples tagged with the step they ran in."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.clock: _Clock | None = None
        self.step = 0
        self.mesh: Any = None
        self.device: Any = None
        self.samples: list[tuple[str, int, int, Any, Any]] = []  # kind, stage, step, start, end
        self.active_stage: list[int] = []
        self.calls_per_step = 0

    # ---------------------------------------------------------------------------------- instrumenting

    def install(self, loop: Any) -> None:
        import torch
        from torch.distributed.pipelining import stage as pipelining_stage

        probe = self
        original_init, original_parallelize, original_peak = (
            loop.init_distributed,
            loop.parallelize,
            loop.peak_memory_bytes,
        )

        def init_distributed(*args: Any, **kwargs: Any) -> Any:
            device, mesh = original_init(*args, **kwargs)
            probe.device, probe.mesh = device, mesh
            probe.clock = _Clock(device.type == "cuda")
            return device, mesh

        def parallelize(stage: Any, mesh: Any, layout: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_parallelize(stage, mesh, layout, *args, **kwargs)
            index = probe._stage_index(stage, layout)
            starts: list[Any] = []

            def pre(_module: Any, _inputs: Any) -> None:
                starts.append(probe.clock.now() if probe.clock else time.perf_counter())

            def post(_module: Any, _inputs: Any, _output: Any) -> None:
                if starts and probe.clock is not None:
                    probe._record("forward", index, starts.pop(), probe.clock.now())

            stage.register_forward_pre_hook(pre)
            stage.register_forward_hook(post)
            stage._planner_probe_index = index
            return out

        def peak_memory_bytes(device: Any) -> Any:
            probe.finish()
            return original_peak(device)

        loop.init_distributed, loop.parallelize = init_distributed, parallelize
        loop.peak_memory_bytes = peak_memory_bytes

        base = pipelining_stage._PipelineStageBase
        original_backward_chunk = base.backward_one_chunk

        def backward_one_chunk(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = probe.clock.now() if probe.clock else None
            out = original_backward_chunk(self, *args, **kwargs)
            index = getattr(self.submod, "_planner_probe_index", self.stage_index)
            if start is not None and probe.clock is not None:
                probe._record("backward", index, start, probe.clock.now())
            return out

        base.backward_one_chunk = backward_one_chunk  # type: ignore[method-assign]

        original_tensor_backward: Callable[..., Any] = torch.Tensor.backward

        def tensor_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = probe.clock.now() if probe.clock else None
            out = original_tensor_backward(self, *args, **kwargs)
            if start is not None and probe.clock is not None and not probe.config["pipeline"]:
                probe._record("backward", 0, start, probe.clock.now())
            return out

        torch.Tensor.backward = tensor_backward  # type: ignore[method-assign]

        original_step = torch.optim.AdamW.step

        def optimizer_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_step(self, *args, **kwargs)
            probe.step += 1  # the step boundary: samples after it belong to the next step
            return out

        torch.optim.AdamW.step = optimizer_step  # type: ignore[method-assign]

    def _stage_index(self, stage: Any, layout: Any) -> int:
        """The plan's index of a local stage: its position in the layout's stages on this pp rank."""
        mine = getattr(self, "_assigned", 0)
        pp_rank = self.mesh["pp"].get_local_rank() if self.mesh is not None else 0
        local = layout.stages_on(pp_rank)
        self._assigned = mine + 1
        return int(local[mine]) if mine < len(local) else mine

    def _record(self, kind: str, stage: int, start: Any, end: Any) -> None:
        self.samples.append((kind, stage, self.step, start, end))

    # --------------------------------------------------------------------------------------- finishing

    def finish(self) -> None:
        import torch.distributed as dist

        if self.clock is None:
            return
        if self.clock.cuda:
            import torch

            torch.cuda.synchronize()
        timed: dict[str, list[float]] = {}
        for kind, stage, step, start, end in self.samples:
            if step < WARMUP_STEPS:
                continue
            secs = start.elapsed_time(end) / 1e3 if self.clock.cuda else end - start
            timed.setdefault(f"{kind}:{stage}", []).append(secs)
        collectives = self.time_collectives()
        rank = dist.get_rank()
        out = Path(self.config["out"])
        doc = {
            "rank": rank,
            "device": self.device.type,
            "coords": {d: self.mesh[d].get_local_rank() for d in ("pp", "dp", "tp")},
            "compute": timed,
            "collectives": collectives,
        }
        tmp = out.with_name(f".{out.name}.rank{rank}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out.with_name(f"{out.name}.rank{rank}.json"))

    def time_collectives(self) -> dict[str, list[float]]:
        """Each collective of the config on its mesh dimension's group, median of repeats per rank."""
        import torch
        import torch.distributed as dist

        repeats = int(self.config.get("repeats", 5))
        dev = self.device
        results: dict[str, list[float]] = {}

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        for item in self.config.get("collectives", []):
            group = self.mesh[item["dim"]].get_group()
            size = self.mesh[item["dim"]].size()
            n = max(size, int(item["bytes"]) // 4 // size * size)  # fp32 elements, a multiple of the group
            x = torch.ones(n, device=dev)
            samples: list[float] = []
            if item["op"] == "p2p":
                me = self.mesh["pp"].get_local_rank()
                src, dst = int(item["src"]), int(item["dst"])
                peer = dist.get_global_rank(group, dst if me == src else src)
                for i in range(repeats + 1):
                    sync()
                    t0 = time.perf_counter()
                    if me == src:  # ping-pong: the round trip is two one-way sends
                        dist.send(x, peer)
                        dist.recv(x, peer)
                    elif me == dst:
                        dist.recv(x, peer)
                        dist.send(x, peer)
                    sync()
                    if i and me == src:
                        samples.append((time.perf_counter() - t0) / 2)
            else:
                shard = torch.empty(n // size, device=dev)
                op = item["op"]

                def fn(x: Any = x, shard: Any = shard, group: Any = group, op: str = op) -> None:
                    if op == "all_reduce":
                        dist.all_reduce(x, group=group)
                    elif op == "all_gather":
                        dist.all_gather_into_tensor(x, shard, group=group)
                    else:
                        dist.reduce_scatter_tensor(shard, x, group=group)

                try:
                    for i in range(repeats + 1):
                        dist.barrier(group=group)
                        sync()
                        t0 = time.perf_counter()
                        fn()
                        sync()
                        if i:
                            samples.append(time.perf_counter() - t0)
                except (RuntimeError, NotImplementedError):
                    samples = []  # the backend lacks this collective (gloo's reduce_scatter in some torch builds)
            if samples:
                results[item["name"]] = [statistics.median(samples)]
        return results


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m planner.measure.probe train.py [train.py options]")
    script = Path(argv[0]).resolve()
    config = json.loads(Path(os.environ[PROBE_ENV]).read_text())
    sys.path.insert(0, str(script.parent))
    import planner_runtime.loop as loop  # the plan's own copy, beside its train.py

    Probe(config).install(loop)
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
