"""Each cost term of planner/cost/terms.py evaluated two ways: on floats (as the cost model does) and as a
pulp.LpAffineExpression with its variable fixed (as the ILP does), and its `linear_form` (as the bounds
read it). The three must agree for every candidate, or the ILP optimises a different model from the one
the plan reports."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import numpy as np
import pulp
import pytest
from hypothesis import given, settings

from planner.cost import terms
from planner.cost.candidate import Candidate, CostOptions
from planner.cost.memory import model_state_bytes_per_param
from planner.hardware.load import load_cluster
from planner.names import SCHEDULES

CLUSTERS = {name: load_cluster(name, nodes=4) for name in ("a100-sxm-80gb", "h100-sxm-80gb")}
OPTIONS = (
    CostOptions(),
    CostOptions(overlap_dp_comm=False, fragmentation=0.1, workspace_bytes=2.0 * 2**30),
    CostOptions(overlap_param_gather=True),
)


@st.composite
def candidates(draw) -> Candidate:
    schedule = draw(st.sampled_from(SCHEDULES))
    v = {"gpipe": 1, "1f1b": 1, "zero-bubble": 2}.get(schedule) or draw(st.integers(2, 4))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    return Candidate(
        dp=draw(st.sampled_from([1, 2, 3, 16, 64])),
        tp=tp,
        pp=draw(st.integers(1, 8)),
        virtual_stages=v,
        micro_batch_size=draw(st.integers(1, 8)),
        num_micro_batches=draw(st.integers(1, 32)),
        schedule=schedule,
        zero_stage=draw(st.integers(0, 3)),
        sequence_parallel=draw(st.booleans()) and tp > 1,
        cp=draw(st.sampled_from([1, 1, 2, 4])),
    )


def both_ways(term, x: float) -> tuple[float, float, float]:
    """(term on the float x, the term's expression with its variable fixed at x, its linear form at x)."""
    var = pulp.LpVariable("x")
    expr = term(pulp.LpAffineExpression(var))
    var.setInitialValue(x)
    as_expr = float(pulp.value(expr)) if isinstance(expr, pulp.LpAffineExpression) else float(expr)
    coef, const = terms.linear_form(term)
    return float(term(x)), as_expr, coef * x + const


def check(term, x: float) -> None:
    on_float, on_expr, on_form = both_ways(term, x)
    assert on_expr == pytest.approx(on_float, rel=1e-12, abs=1e-15)
    assert on_form == pytest.approx(on_float, rel=1e-12, abs=1e-15)
    # numpy arrays (the bounds' vectorised form) agree element by element
    arr = term(np.array([x, 2.0 * x]))
    assert np.allclose(np.broadcast_to(arr, (2,)), [on_float, float(term(2.0 * x))], rtol=1e-12, atol=1e-15)


PROPS = settings(max_examples=150, deadline=None)
POSITIVE = st.floats(1e3, 1e11)


@PROPS
@given(c=candidates(), x=POSITIVE, gpu=st.sampled_from(sorted(CLUSTERS)), dtype=st.sampled_from(["bf16", "fp32"]))
def test_time_terms_agree_on_floats_and_expressions(c, x, gpu, dtype):
    cl = CLUSTERS[gpu]
    check(lambda b: terms.p2p_time(b, c, cl), x)
    check(lambda p: terms.dp_sync_time(p, c, cl, dtype), x)
    check(lambda p: terms.zero3_gather_time(p, c, cl, dtype), x)
    check(lambda p: terms.optimizer_step_time(p, c, cl, dtype), x)
    check(lambda kv: terms.cp_kv_exchange_time(kv, c, cl), x)


@PROPS
@given(c=candidates(), x=POSITIVE, o=st.sampled_from(OPTIONS), largest=st.floats(0, 1e10))
def test_overlap_and_memory_terms_agree_on_floats_and_expressions(c, x, o, largest):
    state = model_state_bytes_per_param("bf16", c.zero_stage, c.dp_shard)
    check(lambda t: terms.sync_overlap_window(t, c, o), x * 1e-12)
    check(lambda p: terms.model_state_bytes(p, state), x)
    check(lambda b: terms.comm_buffer_bytes(b, c, o, largest), x)
    check(lambda s: terms.rank_peak_bytes(s, 3.0 * x, o), x)
    check(lambda a: terms.rank_peak_bytes(2.0 * x, a, o), x)


@PROPS
@given(c=candidates(), ts=st.lists(st.floats(1e-6, 1.0), min_size=5, max_size=5))
def test_pipeline_term_agrees_with_its_epigraph_form(c, ts):
    """The ILP passes epigraph variables for the maxima; fixed at the maxima they give the float figure."""
    total, z, y, f, p2p = ts
    names = ["sum", "Z", "Y", "F", "p2p"]
    vars_ = {n: pulp.LpVariable(n) for n in names}
    expr = terms.pipeline_time(c, *(pulp.LpAffineExpression(vars_[n]) for n in names))
    for n, t in zip(names, ts, strict=True):
        vars_[n].setInitialValue(t)
    assert pulp.value(expr) == pytest.approx(terms.pipeline_time(c, total, z, y, f, p2p), rel=1e-12)


def test_guards_apply_to_plain_numbers_only():
    c = Candidate(
        dp=8,
        tp=1,
        pp=2,
        virtual_stages=1,
        micro_batch_size=1,
        num_micro_batches=4,
        schedule="1f1b",
        zero_stage=1,
        sequence_parallel=False,
    )
    cl = CLUSTERS["a100-sxm-80gb"]
    assert terms.p2p_time(0.0, c, cl) == 0.0  # nothing to send, no latency
    _, lat = terms.p2p_link(c, cl)
    assert terms.linear_form(lambda b: terms.p2p_time(b, c, cl))[1] == pytest.approx(lat)
    # a single replica has no gradient sync, however it is evaluated
    one = dataclasses.replace(c, dp=1)
    assert terms.linear_form(lambda p: terms.dp_sync_time(p, one, cl, "bf16")) == (0.0, 0.0)


def test_linear_form_reads_the_latency_of_each_zero_stage():
    """The sync's constant is the ring's latency count: 2(n-1) for all-reduce and for reduce-scatter +
    all-gather, (m+1)(n-1) under ZeRO-2, (n-1) under ZeRO-3."""
    cl = CLUSTERS["h100-sxm-80gb"]
    n, m = 16, 4
    for zero, steps in {0: 2 * (n - 1), 1: 2 * (n - 1), 2: (m + 1) * (n - 1), 3: n - 1}.items():
        c = Candidate(
            dp=n,
            tp=1,
            pp=1,
            virtual_stages=1,
            micro_batch_size=1,
            num_micro_batches=m,
            schedule="1f1b",
            zero_stage=zero,
            sequence_parallel=False,
        )
        _, lat = terms.dp_link(c, cl)
        assert terms.linear_form(lambda p, c=c: terms.dp_sync_time(p, c, cl, "bf16"))[1] == pytest.approx(steps * lat)


def test_optimizer_step_bytes_are_written_once():
    """16 + 16 bytes per parameter in fp32, 30 in mixed precision: the same figure the ILP and bounds use."""
    assert terms.optimizer_step_bytes_per_param("fp32") == 32.0
    assert terms.optimizer_step_bytes_per_param("bf16") == 30.0


@PROPS
@given(c=candidates(), ep=st.sampled_from([1, 2, 4]), x=st.floats(0, 2**31), gpu=st.sampled_from(sorted(CLUSTERS)))
def test_nccl_reserve_agrees_both_ways_and_counts_the_groups_of_more_than_one_rank(c, ep, x, gpu):
    """NCCL's buffers per process group of more than one rank (dp, tp, pp, and with experts ep and the experts'
    replicas): the ILP's memory row, the bounds' budget (`rank_capacity`) and the plan's reserve read one term."""
    c = dataclasses.replace(c, dp=c.dp * ep, ep=ep, cp=1)
    check(lambda b: terms.comm_reserve_bytes(b, c), x + 1.0)
    groups = terms.group_sizes(c.dp, c.tp, c.pp, c.ep)
    expected = [n for n, k in (("dp", c.dp), ("tp", c.tp), ("pp", c.pp)) if k > 1]
    if ep > 1:
        expected += ["ep"] + (["expert dp"] if c.dp // ep > 1 else [])
    assert list(groups) == expected and all(k > 1 for k in groups.values())
    assert terms.comm_reserve_bytes(x, c) == pytest.approx(x * len(expected))
    spec = CLUSTERS[gpu]
    per_group = spec.gpu.memory_reserve.nccl_gib_per_group * 2**30
    cl = spec.within_reserve()  # what the search plans against
    assert per_group > 0 and cl.nccl_bytes_per_group == per_group
    assert terms.rank_capacity(cl, c) == pytest.approx(cl.gpu.memory_bytes - per_group * len(expected))
    whole = spec.fixed_reserve_bytes + terms.comm_reserve_bytes(per_group, c)
    assert spec.memory_reserve_bytes(len(groups)) == pytest.approx(whole, abs=1)
    # --memory-reserve is the whole reserve: no NCCL share on top of it
    fixed = spec.with_memory_reserve(1.0).within_reserve()
    assert terms.rank_capacity(fixed, c) == fixed.gpu.memory_bytes


@pytest.mark.parametrize("options", OPTIONS)
@given(parts=st.lists(st.floats(0, 2**40, allow_nan=False), min_size=5, max_size=5))
@settings(max_examples=40, deadline=None)
def test_memory_report_is_the_peak_of_a_rank_of_one_stage(options, parts):
    """memory_report, the one sum of a stage's memory (plan.json's breakdown), equals the peak the search
    constrains (`terms.rank_peak_bytes`) for a rank holding that one stage, and its states are what the rank's
    peak counts beside the activations."""
    from types import SimpleNamespace

    from planner.cost.memory import held_states, memory_report

    weights, gradients, optimizer, activations, buffers = parts
    stage = SimpleNamespace(
        weights=weights, gradients=gradients, optimizer=optimizer, activations=activations, comm_buffers=buffers
    )
    report = memory_report(stage, options)
    assert report.states == weights + gradients + optimizer + buffers
    assert held_states(stage) == report.states  # the search's sum (rank_memory), the same float
    assert report.workspace >= options.workspace_bytes
    peak = terms.rank_peak_bytes(report.states, activations, options)
    assert report.total == pytest.approx(peak, rel=1e-12, abs=1e-3)
@pytest.mark.parametrize("tp, rails", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_dp_ring_across_nodes_runs_on_one_rail_per_gpu_of_its_group_in_the_node(tp, rails):
    """A data-parallel group spanning nodes holds 8/tp of its ranks on each node, each with its own NIC: NCCL's
    rings cross nodes on all of them, so the ring's bandwidth is that many NICs' (up to NVLink); inside a node,
    NVLink's."""
    cl = CLUSTERS["h100-sxm-80gb"]
    topo, eff = cl.topology, cl.gpu.efficiency.network
    c = Candidate(dp=32 // tp, tp=tp, pp=1, virtual_stages=1, micro_batch_size=1, num_micro_batches=1,
                  schedule="1f1b", zero_stage=3, sequence_parallel=False)
    bw, lat = terms.dp_link(c, cl)
    assert bw == pytest.approx(min(topo.intra_node_bandwidth, rails * topo.inter_node_bandwidth) * eff)
    assert lat == topo.inter_node_latency
    inside = dataclasses.replace(c, dp=8 // tp)
    assert terms.dp_link(inside, cl) == (topo.intra_node_bandwidth * eff, topo.intra_node_latency)


def test_zero3_unit_gather_shows_only_past_the_prefetch_and_its_copy_out():
    """FSDP2 hides a unit's all-gather behind the unit before it: what is left is the excess over that compute,
    plus the copy-out (one read and write of the unit's weights) on the compute stream; nothing without ZeRO-3."""
    cl = CLUSTERS["h100-sxm-80gb"]
    c = Candidate(dp=16, tp=1, pp=1, virtual_stages=1, micro_batch_size=1, num_micro_batches=1,
                  schedule="1f1b", zero_stage=3, sequence_parallel=False)
    params = 1e9
    gather = terms.zero3_gather_time(params, c, cl, "bf16") / 2
    copy = 2 * 2 * params / (cl.gpu.memory_bandwidth * cl.gpu.efficiency.memory)
    assert terms.zero3_unit_exposed_time(params, params, 10.0, c, cl, "bf16") == pytest.approx(copy)
    assert terms.zero3_unit_exposed_time(params, params, 0.0, c, cl, "bf16") == pytest.approx(gather + copy)
    for other in (dataclasses.replace(c, zero_stage=2), dataclasses.replace(c, dp=1)):
        assert terms.zero3_unit_exposed_time(params, params, 0.0, other, cl, "bf16") == 0.0
