"""A simulated pipeline iteration as a Chrome trace (the Trace Event Format torch.profiler writes), for Perfetto.

Open timeline.trace.json at https://ui.perfetto.dev or chrome://tracing: one process per pipeline rank, with
a compute track (each forward, backward and weight-gradient action of each micro-batch, its stage in args)
and a communication track (the rank's point-to-point sends). Times are microseconds, as the format wants,
written with fixed precision so that equal inputs give byte-identical files.
"""

from __future__ import annotations

import json
from typing import Any

from planner.cost.simulate import KIND_NAMES, SimResult

COMPUTE_TID = 0
COMM_TID = 1
_NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(sim: SimResult, title: str, stage_labels: list[str] | None = None) -> str:
    """The trace of `sim` as JSON text: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}."""
    n_stages = sim.p * sim.v
    if stage_labels is not None and len(stage_labels) != n_stages:
        raise ValueError(f"stage_labels has {len(stage_labels)} entries; expected one per stage ({n_stages})")
    events: list[dict[str, Any]] = []
    for r in range(sim.p):
        stages = [s for s in range(n_stages) if sim.stage_ranks[s] == r]
        held = ", ".join(stage_labels[s] if stage_labels else f"stage {s}" for s in stages)
        events += [
            {"ph": "M", "name": "process_name", "pid": r, "tid": COMPUTE_TID, "args": {"name": f"pp rank {r}"}},
            {"ph": "M", "name": "process_sort_index", "pid": r, "tid": COMPUTE_TID, "args": {"sort_index": r}},
            {"ph": "M", "name": "thread_name", "pid": r, "tid": COMPUTE_TID, "args": {"name": f"compute ({held})"}},
            {"ph": "M", "name": "thread_name", "pid": r, "tid": COMM_TID, "args": {"name": "p2p send"}},
        ]
    for r, log in enumerate(sim.log):
        for k, s, j, a, b in log:
            kind = KIND_NAMES[k]
            args: dict[str, Any] = {"stage": s, "micro_batch": j}
            if stage_labels:
                args["stage_name"] = stage_labels[s]
            events.append({"ph": "X", "name": f"{kind}{j}", "cat": _NAMES[kind], "pid": r, "tid": COMPUTE_TID,
                           "ts": _us(a), "dur": _us(b - a), "args": args})
    for t in sim.transfers:
        what = "activation" if t.kind == "F" else "gradient"
        events.append({"ph": "X", "name": f"send {what} {t.microbatch}", "cat": "p2p", "pid": t.src_rank,
                       "tid": COMM_TID, "ts": _us(t.start), "dur": _us(t.end - t.start),
                       "args": {"stage": t.stage, "micro_batch": t.microbatch, "to_rank": t.dst_rank}})
    other = {
        "title": title, "schedule": sim.schedule, "pp": sim.p, "micro_batches": sim.m, "virtual_stages": sim.v,
        "iteration_ms": round(sim.iteration_time * 1e3, 6), "bubble_fraction": round(sim.bubble_fraction, 6),
    }
    lines = [json.dumps(e, sort_keys=True, separators=(",", ":")) for e in events]
    head = json.dumps({"displayTimeUnit": "ms", "otherData": other}, sort_keys=True, separators=(",", ":"))
    return head[:-1] + ',"traceEvents":[\n' + ",\n".join(lines) + "\n]}\n"
