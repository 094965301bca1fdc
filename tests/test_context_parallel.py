"""Context parallelism: its cost term, the search's degrees and refusals, plan.json, and the runtime's sharded
attention against whole-sequence attention on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from synthetic import make_graph, make_unit

from planner.cost import collectives as coll
from planner.cost.candidate import Candidate
from planner.cost.model import unit_cost
from planner.cost.terms import cp_kv_exchange_time, crosses_nodes, dp_sync_time, group_sizes
from planner.errors import ConfigError
from planner.hardware.load import load_cluster
from planner.runtime.context import is_next_token_loss, next_token_labels, positions
from planner.search.space import (
    CP_ASYNC_TP_REFUSAL,
    CP_MIN_SEQ,
    CP_ZB_REFUSAL,
    Pins,
    enumerate_space,
)

H100 = load_cluster("h100-sxm-80gb", nodes=2)


def cand(**kw) -> Candidate:
    base = dict(dp=2, tp=1, pp=1, virtual_stages=1, micro_batch_size=2, num_micro_batches=4, schedule="1f1b",
                zero_stage=1, sequence_parallel=False)
    return Candidate(**{**base, **kw})


def sdpa_graph(seq: int = CP_MIN_SEQ, blocks: int = 4, flash: bool = True, trace: str = "fx"):
    units = [
        make_unit(f"blocks.{i}", "b", 10_000_000, 1e12, 10**8, 10**7).model_copy(
            update={"uses_flash_attention": flash, "sdpa_kv_bytes": 4 * seq * 1024}
        )
        for i in range(blocks)
    ]
    return make_graph(units).model_copy(
        update={"tokens_per_sample": seq, "sample_input_shapes": [[1, seq]], "trace_method": trace}
    )


# ------------------------------------------------------------------------------------------------ cost


def test_kv_exchange_is_a_ring_all_gather_of_the_rank_keys_and_values():
    kv = 3.0e6
    bw = H100.topology.intra_node_bandwidth * H100.gpu.efficiency.network
    lat = H100.topology.intra_node_latency
    c = cand(cp=4, tp=2)
    want = (4 - 1) / 4 * (kv * 2 / 2) / bw + 3 * lat
    assert cp_kv_exchange_time(kv, c, H100) == pytest.approx(want)
    assert cp_kv_exchange_time(kv, cand(), H100) == 0.0
    # cp x tp = 16 > 8 GPUs per node: the cp group spans nodes
    across = cp_kv_exchange_time(kv, cand(cp=8, tp=2), H100)
    inter = H100.topology.inter_node_bandwidth * H100.gpu.efficiency.network
    assert across == pytest.approx(coll.allgather_time(kv * 2 / 2, 8, inter, H100.topology.inter_node_latency))


def test_cp_divides_compute_and_activations_and_adds_the_exchange():
    graph = sdpa_graph()
    u = graph.units[0]
    one = unit_cost(u, cand(dp=4), H100, "bf16")
    two = unit_cost(u, cand(dp=2, cp=2), H100, "bf16")
    kv = cp_kv_exchange_time(u.sdpa_kv_bytes, cand(dp=2, cp=2), H100)
    assert kv > 0
    # the compute and TP communication halve; the exchange is paid forward and backward
    assert two.fwd == pytest.approx(one.fwd / 2 + kv)
    assert two.bwd["none"] == pytest.approx(one.bwd["none"] / 2 + kv)
    gathered = u.sdpa_kv_bytes * 2 / 2  # the other rank's keys and values, kept for the backward
    assert two.act["none"] == pytest.approx(one.act["none"] / 2 + gathered)
    assert two.act["full"] == pytest.approx(one.act["full"] / 2)
    assert two.params_local == one.params_local  # weights replicated over the cp ranks


def test_gradients_sync_over_dp_times_cp():
    """The cp ranks hold the same weights: dp2 x cp2 syncs like dp4 on the same span of ranks."""
    for zero in range(4):
        a, b = cand(dp=2, cp=2, zero_stage=zero), cand(dp=4, zero_stage=zero)
        assert a.dp_shard == 4
        assert dp_sync_time(1e9, a, H100, "bf16") == pytest.approx(dp_sync_time(1e9, b, H100, "bf16"))
    assert crosses_nodes(cand(dp=4, cp=2, tp=2), H100) == (True, False)
    assert crosses_nodes(cand(dp=2, cp=2, tp=2), H100) == (False, False)
    assert group_sizes(2, 1, 1, 1, 2) == {"dp": 2, "cp": 2, "dp x cp": 4}
    assert group_sizes(1, 2, 1, 1, 1) == {"tp": 2}


# ---------------------------------------------------------------------------------------------- search


def test_free_search_takes_cp_only_on_long_sequences():
    short = enumerate_space(sdpa_graph(seq=4096), H100, 32, Pins(micro_batch_size=1))
    assert {c.cp for c in short.candidates} == {1}
    assert not any("cp=" in region for region, _ in short.rejected)
    long = enumerate_space(sdpa_graph(seq=CP_MIN_SEQ), H100, 32, Pins(micro_batch_size=1))
    cps = {c.cp for c in long.candidates}
    assert {1, 2, 4, 8} <= cps
    for c in long.candidates:
        assert c.dp * c.cp * c.tp * c.pp == 16
        # cp with tp takes sequence parallelism (tp without it is dominated, as at cp 1), eagerly
        assert not (c.cp > 1 and c.tp > 1 and not c.sequence_parallel)
        assert not (c.cp > 1 and c.tp_overlap)
        assert not (c.cp > 1 and c.pp > 1 and c.schedule == "zero-bubble")
    assert any(c.cp > 1 and c.tp > 1 and c.sequence_parallel for c in long.candidates)
    reasons = {why for _, why in long.rejected}
    assert CP_ZB_REFUSAL in reasons


def test_cp2_tp2_with_sp_plans_and_its_costs_divide_by_cp_then_tp():
    """cp first (each rank holds seq/cp tokens), then sequence parallelism over tp on that local sequence: the
    activations outside the attention divide by cp and by tp, the tp reduce-scatter / all-gather carry the local
    sequence, the K/V exchange is the one without sp."""
    graph = sdpa_graph(seq=128)
    space = enumerate_space(graph, H100, 8, Pins(cp=2, tp=2, micro_batch_size=1))
    got = {(c.cp, c.tp, c.sequence_parallel, c.tp_overlap) for c in space.candidates}
    assert got == {(2, 2, True, False)}  # without sp: dominated; async TP: refused under cp
    assert any("without sp" in region for region, _ in space.rejected)
    pinned = enumerate_space(graph, H100, 8, Pins(cp=2, tp=2, sequence_parallel=True, tp_overlap=True))
    assert not pinned.candidates and CP_ASYNC_TP_REFUSAL in {why for _, why in pinned.rejected}

    u = graph.units[0]
    sp1 = unit_cost(u, cand(dp=4, tp=2, sequence_parallel=True), H100, "bf16")
    sp2 = unit_cost(u, cand(dp=2, cp=2, tp=2, sequence_parallel=True), H100, "bf16")
    tp2 = unit_cost(u, cand(dp=2, cp=2, tp=2), H100, "bf16")
    kv = cp_kv_exchange_time(u.sdpa_kv_bytes, cand(dp=2, cp=2, tp=2), H100)
    assert kv > 0
    assert cp_kv_exchange_time(u.sdpa_kv_bytes, cand(dp=2, cp=2, tp=2, sequence_parallel=True), H100) == kv
    # tp communication: the reduce-scatter + all-gather of seq/cp tokens, half of cp 1's
    assert sp2.tp_comm_fwd == pytest.approx(sp1.tp_comm_fwd / 2) and sp2.tp_comm_fwd > 0
    assert sp2.fwd == pytest.approx(sp1.fwd / 2 + kv)
    # activations: cp 1's under sp halved, plus the gathered keys and values (micro-batch 2, split by heads over
    # tp 2, the other cp rank's half)
    gathered = u.sdpa_kv_bytes * 2 / 2 * (2 - 1) / 2
    for mode in ("none", "selective", "full"):
        extra = gathered if mode != "full" else 0.0
        assert sp2.act[mode] == pytest.approx(sp1.act[mode] / 2 + extra)
        assert sp2.act[mode] < tp2.act[mode]  # sp splits the norms' and residuals' tokens over tp too
    # the unit's input, all full recomputation keeps: divided by cp x tp
    assert sp2.act["full"] == pytest.approx(u.input_bytes * 2 / 4)


def test_cp_with_sp_is_refused_where_tp_does_not_divide_the_local_sequence_or_the_graph_fixes_it():
    # 24 tokens: 8 chunks of 3 for cp 4; each rank's 6 do not split over tp 4 (24 does)
    space = enumerate_space(sdpa_graph(seq=24), H100, 16, Pins(cp=4, tp=4, sequence_parallel=True))
    assert not space.candidates
    assert any("each cp rank's 6 tokens" in why for _, why in space.rejected)
    no_sp = enumerate_space(sdpa_graph(seq=24), H100, 16, Pins(cp=4, tp=4, micro_batch_size=1))
    assert {c.sequence_parallel for c in no_sp.candidates} == {False}  # not taken as dominated
    meta = enumerate_space(sdpa_graph(seq=128, trace="fx-meta"), H100, 8, Pins(cp=2, tp=2, sequence_parallel=True))
    assert not meta.candidates and any("fixes the whole sequence" in why for _, why in meta.rejected)


def test_cp_pin_is_planned_on_short_sequences_and_checked():
    space = enumerate_space(sdpa_graph(seq=128), H100, 8, Pins(cp=2, micro_batch_size=1))
    assert space.candidates and {c.cp for c in space.candidates} == {2}
    with pytest.raises(ConfigError, match="--cp 3 does not divide the 16 GPUs"):
        enumerate_space(sdpa_graph(seq=128), H100, 8, Pins(cp=3))
    with pytest.raises(ConfigError, match=r"--dp 2 x --tp 2 x --pp 2 x --cp 4 = 32"):
        enumerate_space(sdpa_graph(seq=128), H100, 8, Pins(dp=2, tp=2, pp=2, cp=4))
    # dp x tp x pp x cp = world
    ok = enumerate_space(sdpa_graph(seq=128), H100, 8, Pins(dp=2, tp=2, pp=2, cp=2))
    assert {(c.dp, c.tp, c.pp, c.cp) for c in ok.candidates} == {(2, 2, 2, 2)}


@pytest.mark.parametrize(
    ("graph", "pins", "reason"),
    [
        (sdpa_graph(seq=128, flash=False), Pins(cp=2), "does not call torch.nn.functional.scaled_dot"),
        (sdpa_graph(seq=132), Pins(cp=4), "must split into 2 x cp = 8 equal chunks"),
        (sdpa_graph(seq=128).model_copy(update={"units": [u.model_copy(update={"sdpa_masked": True})
                                                         for u in sdpa_graph(seq=128).units]}),
         Pins(cp=2), "blocks.0 passes an attn_mask"),
        (sdpa_graph(seq=128, trace="fx-meta"), Pins(cp=2, pp=2), "fixes the sequence length"),
        (sdpa_graph(seq=128).model_copy(update={"sample_input_shapes": [[1, 128], [1, 128]]}), Pins(cp=2),
         "one [batch, seq] token tensor"),
        (sdpa_graph(seq=128).model_copy(update={"tokens_per_sample": None}), Pins(cp=2),
         "one [batch, seq] token tensor"),
    ],
)
def test_attention_that_cannot_be_sharded_is_refused_with_the_reason(graph, pins, reason):
    space = enumerate_space(graph, H100, 8, dataclasses.replace(pins, micro_batch_size=1))
    assert not space.candidates
    reasons = {why for _, why in space.rejected}
    assert any(reason in why for why in reasons), reasons


# ------------------------------------------------------------------------------------------------- plan


def test_plan_json_writes_cp_only_where_it_is_used():
    from planner.plan import ParallelConfig

    one = ParallelConfig(dp=2, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1, global_batch_size=2)
    assert "cp" not in one.model_dump(mode="json")
    two = ParallelConfig(dp=2, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1, global_batch_size=2, cp=2,
                         mesh_dims=["pp", "dp", "cp", "tp"])
    assert two.model_dump(mode="json")["cp"] == 2 and two.world_size == 4
    with pytest.raises(ValueError, match="mesh_dims"):
        ParallelConfig(dp=2, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1, global_batch_size=2, cp=2)


# ---------------------------------------------------------------------------------------------- runtime


def test_head_tail_positions_cover_the_sequence_once():
    seq, cp = 24, 3
    parts = [positions(seq, cp, r) for r in range(cp)]
    assert parts[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    assert next_token_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]
    # the order torch's context parallelism shards in (its ring kernels assume it on GPUs)
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    torch_order = balancer._HeadTailLoadBalancer(seq, cp, torch.device("cpu"))._generate_indices()
    assert torch_order.flatten().tolist() == torch.cat(parts).tolist()


def test_a_loss_fn_is_recognised_as_the_next_token_loss_by_what_it_computes():
    def next_token(out, tokens):
        return F.cross_entropy(out[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())

    def last_only(out, tokens):
        return F.cross_entropy(out[:, -1].float(), tokens[:, -1])

    assert is_next_token_loss(next_token)
    assert not is_next_token_loss(last_only)
    assert not is_next_token_loss(lambda out, tokens, target: out.mean())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attention_rank(rank: int, port: int, causal: bool, out: dict) -> None:
    import torch.distributed as dist

    from planner.runtime.context import ContextParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        seq, cp = 8, 2
        q, k, v = (torch.randn(1, 2, seq, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, 2, seq, 4, generator=g, dtype=torch.float64)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        full.backward(grad)
        want = (full.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
        pos = positions(seq, cp, rank)
        lq, lk, lv = (t.detach()[..., pos, :].clone().requires_grad_() for t in (q, k, v))
        with ContextParallel(dist.group.WORLD, cp, rank, seq, torch.device("cpu")):
            local = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
            # positions: an arange over the sequence gives this rank's
            assert torch.arange(seq).tolist() == pos.tolist()
        local.backward(grad[..., pos, :])
        assert torch.allclose(local, want[0][..., pos, :])
        assert torch.allclose(lq.grad, want[1][..., pos, :])
        # keys' and values' gradients: summed over the ranks whose queries read them
        assert torch.allclose(lk.grad, want[2][..., pos, :])
        assert torch.allclose(lv.grad, want[3][..., pos, :])
        dist.barrier()  # every collective done on both ranks before the group goes (see test_titan_tp._worker)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [True, False])
def test_sharded_attention_matches_whole_sequence_attention(causal):
    import torch.multiprocessing as mp

    mp.spawn(_attention_rank, args=(_free_port(), causal, {}), nprocs=2, join=True)


def test_a_plan_with_cp_records_schema_minor_4_and_round_trips(tmp_path):
    from e2e.plans import make_plan

    from planner.plan import SCHEMA_MINOR, load_plan

    plan = make_plan("gpt", dp=2)
    assert plan.schema_minor == 3 and '"cp"' not in plan.to_json()  # plans without cp as minor 3 wrote them
    par = plan.parallel.model_copy(update={"dp": 1, "cp": 2, "mesh_dims": ["pp", "dp", "cp", "tp"],
                                           "num_micro_batches": plan.parallel.num_micro_batches * 2})
    with_cp = type(plan).model_validate({**json.loads(plan.to_json()), "parallel": par.model_dump(mode="json")})
    assert with_cp.schema_minor == 4 <= SCHEMA_MINOR  # the least minor that holds cp (5 added block recomputation)
    (tmp_path / "plan.json").write_text(with_cp.to_json())
    back = load_plan(tmp_path)
    assert back.parallel.cp == 2 and back.to_json() == with_cp.to_json()


def test_search_with_cp_finds_the_brute_force_minimum_and_its_bounds_hold():
    """Random small instances with SDPA units, cp pinned to 2: the search's choice is at most every candidate's
    least reported figure over all partitions (brute force), and every candidate's queue bound is below it."""
    from test_reported_exact import candidate_minimum, instance, reported
    from test_search_exact import full_space

    from planner.cost.candidate import CostOptions
    from planner.errors import InfeasibleError
    from planner.search.bounds import backward_share, comm_bound, lower_bounds, reported_bound
    from planner.search.ilp import block_run
    from planner.search.problem import PartitionProblem
    from planner.search.search import CostTable, search, search_modes

    for seed in range(24):
        graph, cl, batch, pin_dp = instance(seed)
        graph = graph.model_copy(
            update={"units": [u.model_copy(update={"uses_flash_attention": True, "sdpa_kv_bytes": u.output_bytes})
                              for u in graph.units]}
        )
        table, modes = CostTable(graph, cl, None), search_modes(graph)
        best = None
        for c in full_space(graph, cl, batch, pin_dp, cp=2):
            assert c.cp == 2
            cm = tuple(m for m in modes if not (c.schedule == "zero-bubble" and m == "selective"))
            costs = table.units(c)
            low = candidate_minimum(graph, cl, c, costs, cm)
            if low is None:
                continue
            pb = PartitionProblem(graph, cl, c, costs, cm, CostOptions.for_cluster(cl))
            b = lower_bounds(pb, joint=True)
            comm = comm_bound(pb, block_run(graph)) if c.stages > 1 else 0.0
            key = reported_bound(pb, b.time, backward_share(costs, c), comm, b.block or b.interval)
            assert key <= low * (1 + 1e-9), (seed, c, key, low)
            best = low if best is None else min(best, low)
        pins = Pins(dp=pin_dp, cp=2)
        if best is None:
            with pytest.raises(InfeasibleError):
                search(graph, cl, batch, pins=pins, top_k=2)
            continue
        got = search(graph, cl, batch, pins=pins, top_k=2)
        assert got.best.cand.cp == 2
        assert reported(got.best, graph, cl) <= best * (1 + 1e-9), seed


def test_the_runtime_takes_cp_with_sp_where_tp_divides_each_cp_rank_share():
    """The script's own checks, as the planner's: sp over tp 4 of a cp 4 rank's 6 tokens (of 24) is refused with
    the numbers; async TP (compiled units) with cp is refused by the layout."""
    from planner.runtime import Layout, RunError
    from planner.runtime.errors import LayoutError
    from planner.runtime.parallel import sequence_parallel

    base = dict(pp=1, dp=1, tp=4, micro_batch_size=1, num_micro_batches=1, stages=[(0, ["a"])], cp=4,
                mesh_dims=("pp", "dp", "cp", "tp"), sequence_parallel=True)
    layout = Layout(**base)
    assert layout.sp_enabled and layout.cp_enabled
    with pytest.raises(RunError, match=r"length 24, 6 tokens on each of the 4 cp ranks\) over tp=4"):
        sequence_parallel(None, {}, (torch.zeros(1, 24, dtype=torch.long),), None, layout)
    with pytest.raises(LayoutError, match="without expert parallelism, async TP"):
        Layout(**base, async_tp=True)
