"""torch's async TP as a searched, costed choice the script applies: where the search turns it on, what the cost
model leaves exposed, how plan.json and train.py carry it, and the runtime's refusal off CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from e2e.plans import make_plan
from synthetic import make_graph, make_unit

from planner.codegen.render import render, runtime_objects
from planner.cost.model import Candidate, async_tp_exposed, tp_comm_times, unit_cost
from planner.hardware.load import load_cluster
from planner.plan import ParallelConfig
from planner.runtime.errors import LayoutError, RunError
from planner.runtime.layout import Layout, Stage
from planner.runtime.parallel import apply_async_tp
from planner.search.space import ASYNC_TP_DOMINATED, Pins, enumerate_space

H100 = load_cluster("h100-sxm5-80gb", 1)
CPU = load_cluster("cpu", 1, gpus_per_node=4)


def _graph():
    return make_graph([make_unit(f"b{i}", "blk", 10**6, 1e9, 10**6, 10**5) for i in range(4)])


def test_searched_on_nvidia_gpus_with_sequence_parallelism_only():
    space = enumerate_space(_graph(), H100, 8, Pins(tp=2, pp=1))
    sp = [c for c in space.candidates if c.sequence_parallel]
    assert sp and all(c.tp_overlap for c in sp)
    assert not any(c.tp_overlap for c in space.candidates if not c.sequence_parallel)
    assert any(why == ASYNC_TP_DOMINATED for (_, why) in space.rejected)
    # pinned off: eager TP, nothing counted as dominated
    off = enumerate_space(_graph(), H100, 8, Pins(tp=2, pp=1, tp_overlap=False))
    assert off.candidates and not any(c.tp_overlap for c in off.candidates)
    # on a CPU cluster it is never searched, and a pin is refused with the reason
    cpu = enumerate_space(_graph(), CPU, 8, Pins(tp=2, pp=1, sequence_parallel=True))
    assert cpu.candidates and not any(c.tp_overlap for c in cpu.candidates)
    pinned = enumerate_space(_graph(), CPU, 8, Pins(tp=2, pp=1, sequence_parallel=True, tp_overlap=True))
    assert not pinned.candidates
    assert any("CUDA symmetric memory" in why for (_, why) in pinned.rejected)
    no_sp = enumerate_space(_graph(), H100, 8, Pins(tp=2, pp=1, sequence_parallel=False, tp_overlap=True))
    assert not no_sp.candidates and any("needs sequence parallelism" in why for (_, why) in no_sp.rejected)


def test_exposed_tp_communication_is_one_chunk_plus_what_the_matmuls_cannot_hide():
    unit = make_unit("b", "blk", 10**6, 1e9, 10**6, 10**5)
    cand = Candidate(dp=1, tp=4, pp=1, virtual_stages=1, micro_batch_size=2, num_micro_batches=1,
                     schedule="1f1b", zero_stage=0, sequence_parallel=True)
    tf, tb = tp_comm_times(unit, 2, 4, True, H100)
    ef, eb = async_tp_exposed(unit, tf, tb, cand, H100, "bf16")
    assert tf / 4 <= ef <= tf and tb / 4 <= eb <= tb
    # big matmuls hide everything but the first chunk's transfer
    big = unit.model_copy(update={"matmul_flops": 1e15, "bwd_matmul_flops": 2e15, "tp_shardable_flops": 1e15 + 1e8})
    ef, eb = async_tp_exposed(big, tf, tb, cand, H100, "bf16")
    assert ef == pytest.approx(tf / 4) and eb == pytest.approx(tb / 4)
    # no matmul to hide behind: all of it
    none = unit.model_copy(update={"matmul_flops": 0.0, "bwd_matmul_flops": 0.0})
    assert async_tp_exposed(none, tf, tb, cand, H100, "bf16") == pytest.approx((tf, tb))
    # the unit's costs: shorter forward and backward, the TP figure the exposed part
    eager = unit_cost(unit, cand, H100, "bf16")
    overlap = unit_cost(unit, dataclasses.replace(cand, tp_overlap=True), H100, "bf16")
    assert overlap.fwd < eager.fwd and all(overlap.bwd[m] < eager.bwd[m] for m in eager.bwd)
    assert overlap.tp_comm_fwd < eager.tp_comm_fwd


def test_plan_json_carries_it_only_when_on():
    base = dict(dp=1, tp=2, pp=1, micro_batch_size=1, num_micro_batches=1, global_batch_size=1, sequence_parallel=True)
    assert "tp_overlap" not in ParallelConfig(**base).model_dump()  # earlier plans' files stay byte-identical
    on = ParallelConfig(**base, tp_overlap=True)
    assert on.model_dump()["tp_overlap"] is True
    assert ParallelConfig.model_validate_json(on.model_dump_json()).tp_overlap
    with pytest.raises(ValueError, match="needs tp > 1 with sequence_parallel"):
        ParallelConfig(**{**base, "sequence_parallel": False}, tp_overlap=True)


def test_train_py_applies_it():
    plan = make_plan("llama", tp=2, dp=2, zero_stage=3, sequence_parallel=True)
    plan = plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"tp_overlap": True})})
    text = render(plan)["train.py"][0]
    assert "ASYNC_TP = True" in text and "async_tp=ASYNC_TP" in text
    assert runtime_objects(plan)[0].async_tp
    plain = render(make_plan("llama", tp=2, dp=2, zero_stage=3, sequence_parallel=True))["train.py"][0]
    assert "ASYNC_TP" not in plain


def test_runtime_refuses_it_off_cuda_with_the_reason():
    with pytest.raises(LayoutError, match="needs TP > 1"):
        Layout(pp=1, dp=2, tp=1, micro_batch_size=1, num_micro_batches=1, stages=(Stage(0, ("m",)),), async_tp=True)
    with pytest.raises(RunError, match="CUDA symmetric memory"):
        apply_async_tp(torch.nn.Linear(2, 2), None, torch.device("cpu"))  # type: ignore[arg-type]
