"""Mixture of experts: routed FLOPs counted on meta against the real routed work, the expert-parallel cost
terms (floats and PuLP expressions), the search choosing ep, the plan schema and the runtime's Layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pulp
import pytest
import torch

from planner.cost.candidate import Candidate
from planner.cost.terms import (
    alltoall_time,
    ep_link,
    expert_state_params,
    expert_sync_params,
    linear_form,
    moe_alltoall_time,
)
from planner.errors import ConfigError
from planner.hardware.load import load_cluster
from planner.model.graph import ModelGraph, ModelSource, TPPair, Unit
from planner.search.space import Pins, enumerate_space

MODELS = Path(__file__).resolve().parent / "fixtures" / "models"


def _cand(**kw) -> Candidate:
    base = dict(dp=8, tp=1, pp=1, virtual_stages=1, micro_batch_size=2, num_micro_batches=4, schedule="1f1b",
                zero_stage=1, sequence_parallel=False, ep=4)
    return Candidate(**{**base, **kw})


# ------------------------------------------------------------------------------------------ FLOPs


def _cpu_routed_flops(module, hidden, *args) -> tuple[float, float]:
    """Forward and backward FLOPs torch's FlopCounterMode counts running `module` on real CPU data."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fwd:
        out = module(hidden, *args)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return float(fwd.get_total_flops()), float(bwd.get_total_flops())


def test_mixtral_expert_flops_equal_the_routed_work_of_a_cpu_run():
    """Meta counts no expert (its grouped kernel has no FLOP formula, and the loop over experts is data):
    the analysis must add exactly what an eager CPU run of the experts computes on real routed tokens."""
    pytest.importorskip("transformers")
    import torch

    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file
    from planner.model.moe import find_moe_layers

    loaded = load_model_file(MODELS / "hf_tiny.py", {"arch": "mixtral"}, dtype="fp32")
    torch.manual_seed(0)
    model = loaded.module.build_model(arch="mixtral")
    model.config._experts_implementation = "eager"
    block = model.model.layers[0].mlp
    block.experts.config = model.config
    tokens = 2 * 16
    hidden = torch.randn(tokens, 64, requires_grad=True)
    _, weights, index = block.gate(hidden)
    fwd, bwd = _cpu_routed_flops(block.experts, hidden, index, weights.detach())
    (layer,) = find_moe_layers(block, "model.layers.0.mlp")
    assert (layer.num_experts, layer.top_k, layer.hidden) == (4, 2, 64)
    assert layer.routed_fwd_flops(tokens) == fwd == tokens * 2 * (2 * 64 * 192 + 2 * 96 * 64)
    assert 2 * layer.routed_fwd_flops(tokens) == bwd

    graph = analyse_model(loaded)
    unit = graph.unit("model.layers.0")
    seq = graph.tokens_per_sample
    attention_and_router = 2 * seq * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 4) + 4 * 4 * seq * seq * 16
    assert unit.fwd_flops == attention_and_router + layer.routed_fwd_flops(seq)
    assert unit.expert_params == 4 * (192 * 64 + 64 * 96)
    assert unit.experts == {"model.layers.0.mlp.experts": 4} and unit.ep_granularity == 4
    assert unit.moe_dispatch_bytes == seq * 2 * 64 * 4


def test_module_list_experts_count_routed_work_not_the_dense_form():
    """The DeepSeek-style fixture computes every expert on every token (weights 0 where not routed): meta
    counts 4 experts per token, the analysis the 2 a real routed run computes, plus the shared expert
    and the router, which every token runs."""
    from planner.model.analysis import analyse_model
    from planner.model.load import load_model_file

    graph = analyse_model(load_model_file(MODELS / "deepseek_moe.py", dtype="fp32"))
    unit = graph.unit("layers.0")
    s, h = 16, 32
    routed = s * 2 * 3 * (2 * h * 48)
    shared = s * 3 * (2 * h * 64)
    router = s * 2 * h * 4
    attention = s * 2 * (h * 3 * h + h * h) + 4 * 4 * s * s * (h // 4)
    assert unit.matmul_flops + unit.attention_flops == routed + shared + router + attention
    assert unit.bwd_matmul_flops + unit.bwd_attention_flops == 2 * (routed + shared + router + attention)
    assert unit.expert_params == 4 * 3 * h * 48
    assert "MoE MoE in layers.0.mlp: 4 experts, top-2" in " ".join(graph.structure)


# ------------------------------------------------------------------------------------- cost terms


def test_alltoall_term_on_floats_and_pulp_expressions():
    cluster = load_cluster("h100-sxm5-80gb", 8)
    inside, across = _cand(ep=4), _cand(dp=64, ep=16)
    assert ep_link(inside, cluster)[0] == pytest.approx(
        cluster.topology.intra_node_bandwidth * cluster.gpu.efficiency.network
    )
    assert ep_link(across, cluster)[0] == pytest.approx(
        cluster.topology.inter_node_bandwidth * cluster.gpu.efficiency.network
    )
    for cand in (inside, across):
        bw, lat = ep_link(cand, cluster)
        nbytes = 3.0e6
        want = 2 * (nbytes * 2 * (cand.ep - 1) / cand.ep / bw + (cand.ep - 1) * lat)
        assert moe_alltoall_time(nbytes, cand, cluster) == pytest.approx(want)
        x = pulp.LpVariable("x")
        expr = moe_alltoall_time(x, cand, cluster)
        x.varValue = nbytes
        assert pulp.value(expr) == pytest.approx(want)
        coef, const = linear_form(lambda v, c=cand: moe_alltoall_time(v, c, cluster))
        assert coef * nbytes + const == pytest.approx(want)
    assert moe_alltoall_time(1e6, _cand(ep=1), cluster) == 0.0
    assert alltoall_time(1e6, 1, 1e9, 1e-6) == 0.0


def test_expert_states_are_divided_by_ep_and_sharded_over_the_replicas():
    from planner.cost.memory import model_state_bytes_per_param
    from planner.cost.terms import model_state_bytes

    for zero in range(4):
        cand = _cand(zero_stage=zero)
        experts = 8.0e9
        eq = expert_state_params(experts, cand, "bf16")
        want = experts / 4 * model_state_bytes_per_param("bf16", zero, 2).total
        assert model_state_bytes(eq, model_state_bytes_per_param("bf16", zero, 8)) == pytest.approx(want)
        x = pulp.LpVariable("e")
        x.varValue = experts
        assert pulp.value(expert_state_params(x, cand, "bf16")) == pytest.approx(eq)
    assert expert_state_params(5.0, _cand(ep=1), "bf16") == 5.0


def test_expert_gradients_reduce_over_the_dp_over_ep_replicas_only():
    """Hand computation, one node of 8 H100 (NVLink 450 GB/s at the spec's network efficiency, 2 us): dp 8,
    ep 4, so each expert shard has r = 2 replicas. A stage of 1e9 dense and 8e9 expert parameters (2e9 on each
    rank) syncs the dense ones over 8 ranks and the experts over 2; the ring's latency is the dense ring's."""
    from planner.cost.model import dp_comm_time

    cluster = load_cluster("h100-sxm5-80gb", 1)
    bw, lat = 450e9 * cluster.gpu.efficiency.network, 2e-6  # NVLink at the spec's (held, not fitted) efficiency
    dense, experts = 1e9, 8e9
    local = experts / 4  # this rank's experts
    for zero in range(4):
        cand = _cand(zero_stage=zero)
        sync, gather = dp_comm_time(dense + expert_sync_params(experts, cand), cand, cluster, "bf16")
        grads = 4 * (7 / 8 * dense + 1 / 2 * local) / bw  # fp32 gradients, (n-1)/n of the bytes per ring
        weights = 2 * (7 / 8 * dense + 1 / 2 * local) / bw  # bf16 weights gathered
        want_sync = {
            0: 2 * grads + 2 * 7 * lat,  # all-reduce
            1: grads + 7 * lat + weights + 7 * lat,  # reduce-scatter + all-gather
            2: 4 * (grads + 7 * lat) + weights + 7 * lat,  # a reduce-scatter per micro-batch (4)
            3: grads + 7 * lat,
        }[zero]
        assert sync == pytest.approx(want_sync, rel=1e-12), zero
        assert gather == pytest.approx(2 * (weights + 7 * lat) if zero == 3 else 0.0, rel=1e-12), zero
        # Before: the experts counted as their state-equivalent parameters over all 8 ranks.
        old = dp_comm_time(dense + expert_state_params(experts, cand, "bf16"), cand, cluster, "bf16")[0]
        assert old > sync
    # dp = ep: no replica holds the same experts, nothing to reduce; without ep the experts are dense.
    assert expert_sync_params(8e9, _cand(dp=4, ep=4)) == 0.0
    assert expert_sync_params(8e9, _cand(ep=1)) == 8e9
    # On a PuLP expression and through its linear form, the same count.
    x = pulp.LpVariable("e")
    x.varValue = experts
    assert pulp.value(expert_sync_params(x, _cand())) == pytest.approx(expert_sync_params(experts, _cand()))
    assert linear_form(lambda e: expert_sync_params(e, _cand())) == pytest.approx((local / 2 / (7 / 8) / experts, 0.0))


def test_unit_costs_carry_the_ring_count_and_the_stage_syncs_with_it():
    """The cost model's stage sync is dp_sync_time of the ring count (dense + `expert_sync_params`), not of
    the state-equivalent `params_local`; dense units and ep = 1 keep one count."""
    from planner.cost.model import CostOptions, dp_sync_time, stage_costs, unit_cost

    graph = mixtral_8x7b_graph(layers=2)
    cluster = load_cluster("h100-sxm5-80gb", 8)
    cand = _cand(dp=64, ep=8, micro_batch_size=1, num_micro_batches=4, zero_stage=1)
    costs = [unit_cost(u, cand, cluster, "bf16") for u in graph.units]
    block = graph.units[1]
    dense = block.params - block.expert_params
    assert costs[1].sync_params == pytest.approx(dense + block.expert_params / 8 * (7 / 8) / (63 / 64))
    assert costs[1].sync_params < costs[1].params_local
    assert costs[0].sync_params == costs[0].params_local  # the embedding has no experts
    # Only units holding MoE layers pay the all-to-all: a pipeline stage without them pays none.
    assert costs[0].ep_comm == 0.0 and costs[-1].ep_comm == 0.0 and costs[1].ep_comm > 0.0
    (stage,) = stage_costs(graph, cluster, cand, [[0, 1, 2, 3]], ["none"], costs, CostOptions())
    assert stage.dp_sync == pytest.approx(dp_sync_time(sum(c.sync_params for c in costs), cand, cluster, "bf16"))
    no_ep = [unit_cost(u, dataclasses.replace(cand, ep=1), cluster, "bf16") for u in graph.units]
    assert all(c.sync_params == c.params_local for c in no_ep)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_weights_per_rank_fall_as_one_over_ep(zero):
    """The stage's weights, gradients and optimizer states split exactly: the experts' weights on a rank are
    E/ep (2/3 at ep 2 and 1/2 at ep 4 before, the state-equivalent count priced as weights), their gradients
    and optimizer shards over the dp/ep replicas; the total is the state-equivalent count's."""
    from planner.cost.memory import model_state_bytes_per_param
    from planner.cost.model import CostOptions, stage_costs, unit_cost

    graph = mixtral_8x7b_graph(layers=2)
    cluster = load_cluster("h100-sxm5-80gb", 8)
    block = graph.units[1]
    dense_params = block.params - block.expert_params
    totals = {}
    for ep in (1, 2, 4, 8):
        cand = _cand(dp=64, ep=ep, micro_batch_size=1, num_micro_batches=4, zero_stage=zero)
        costs = [unit_cost(u, cand, cluster, "bf16") for u in graph.units]
        (stage,) = stage_costs(graph, cluster, cand, [[1]], ["none"], costs, CostOptions())
        dense = model_state_bytes_per_param("bf16", zero, 64)
        rep = model_state_bytes_per_param("bf16", zero, 64 // ep)
        held = block.expert_params / ep
        assert stage.weights == pytest.approx(dense_params * dense.weights + held * rep.weights)
        assert stage.gradients == pytest.approx(dense_params * dense.gradients + held * rep.gradients)
        assert stage.optimizer == pytest.approx(dense_params * dense.optimizer + held * rep.optimizer)
        states = stage.weights + stage.gradients + stage.optimizer
        assert states == pytest.approx(costs[1].params_local * (dense.weights + dense.gradients + dense.optimizer))
        totals[ep] = stage.weights - dense_params * dense.weights
    for ep in (2, 4, 8):  # the experts' weight bytes per rank: exactly 1/ep of ep 1's (ZeRO-3: E/dp at any ep)
        assert totals[ep] == pytest.approx(totals[1] / ep if zero < 3 else totals[1])


# ------------------------------------------------------------------------------ space and search


def mixtral_8x7b_graph(layers: int = 32) -> ModelGraph:
    """Mixtral-8x7B's shapes (h 4096, 8 experts of 3 x 4096 x 14336, top-2, GQA 32/8 heads, seq 4096,
    vocab 32000) as units, with the per-sample figures the analysis gives for them."""
    h, inner, experts, s, vocab = 4096, 14336, 8, 4096, 32000
    attn_params = 2 * h * h + 2 * h * 1024
    expert_params = experts * 3 * h * inner
    block_params = attn_params + expert_params + experts * h + 2 * h
    mm = s * (2 * attn_params + 2 * 2 * 3 * h * inner + 2 * h * experts)
    attn = 4 * s * s * h
    act = s * h * 2 * 40

    def unit(name: str, params: int, fwd_mm: float, fwd_attn: float, kind: str, **kw) -> Unit:
        return Unit(
            name=name, modules=[name], kind=kind, signature=kind, params=params, param_bytes=2 * params,
            fwd_flops=fwd_mm + fwd_attn, bwd_flops=2 * (fwd_mm + fwd_attn), matmul_flops=fwd_mm,
            attention_flops=fwd_attn, memory_bound_bytes=s * h * 2 * 20, bwd_matmul_flops=2 * fwd_mm,
            bwd_attention_flops=2 * fwd_attn, bwd_memory_bound_bytes=s * h * 2 * 40, activation_bytes=act,
            input_bytes=s * h * 2, output_bytes=s * h * 2, gemm_dim=h, uses_flash_attention=True, **kw,
        )

    units = [unit("embed", vocab * h, 0.0, 0.0, "other")]
    for i in range(layers):
        units.append(
            unit(f"layers.{i}", block_params, mm, attn, "block", expert_params=expert_params,
                 experts={f"layers.{i}.mlp.experts": experts}, ep_granularity=experts,
                 moe_dispatch_bytes=s * 2 * h * 2, tp_granularity=8, tp_shardable_params=attn_params,
                 tp_shardable_flops=s * 2 * attn_params + attn,
                 tp_pairs=[TPPair(column=[f"layers.{i}.q"], row=f"layers.{i}.o", allreduce_bytes=s * h * 2)])
        )
    units.append(unit("head", vocab * h + h, 2.0 * s * h * vocab, 0.0, "other"))
    return ModelGraph(
        source=ModelSource(path="/mixtral.py", file_sha256="0" * 64), model_class="MixtralForCausalLM",
        trace_method="export", units=units, total_params=sum(u.params for u in units), tokens_per_sample=s,
        sample_input_shapes=[[1, s]], distinct_blocks=3, dtype_bytes=2,
    )


def test_ep_degrees_divide_dp_and_the_expert_count_and_refuse_tp():
    graph = mixtral_8x7b_graph(layers=4)
    cluster = load_cluster("h100-sxm5-80gb", 2)
    space = enumerate_space(graph, cluster, 64, Pins(micro_batch_size=1, zero_stage=1))
    eps = {(c.dp, c.tp, c.pp, c.ep) for c in space.candidates}
    assert (16, 1, 1, 8) in eps and (16, 1, 1, 1) in eps
    assert all(c.dp % c.ep == 0 and 8 % c.ep == 0 for c in space.candidates)
    assert not any(c.ep > 1 and c.tp > 1 for c in space.candidates)
    reasons = " ".join(why for (_, why) in space.rejected)
    assert "shards experts only without tensor parallelism" in reasons and "expert tensor parallelism" in reasons
    # Each pipeline stage keeps its experts as calls (torch.fx or torch.export): ep runs alongside pp.
    assert (8, 1, 2, 8) in {(c.dp, c.tp, c.pp, c.ep) for c in space.candidates}
    assert not any(c.ep > 1 and c.pp > 1 and c.schedule == "zero-bubble" for c in space.candidates)
    assert "split backward frees its saved tensors" in " ".join(why for (_, why) in space.rejected)


def test_ep_pin_is_checked_with_the_rule_and_the_fix():
    graph = mixtral_8x7b_graph(layers=2)
    cluster = load_cluster("h100-sxm5-80gb", 1)
    with pytest.raises(ConfigError, match="does not divide the model's expert count"):
        enumerate_space(graph, cluster, 8, Pins(ep=3))
    with pytest.raises(ConfigError, match="does not divide --dp 2"):
        enumerate_space(graph, cluster, 8, Pins(ep=4, dp=2))
    dense = graph.model_copy(
        update={"units": [u.model_copy(update={"experts": {}, "ep_granularity": 0, "expert_params": 0})
                          for u in graph.units]}
    )
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        enumerate_space(dense, cluster, 8, Pins(ep=2))
    assert {c.ep for c in enumerate_space(dense, cluster, 8, Pins()).candidates} == {1}


def test_search_chooses_expert_parallelism_for_mixtral_8x7b_on_64_h100():
    """Without ep every rank holds all 8 experts of each layer: 45B expert parameters fit 80 GB only under
    ZeRO-3, whose weight gathers of all experts over 64 ranks every micro-batch cost more than the compute.
    With ep = 8 inside a node each rank holds one expert per layer, whose gradients reduce (and ZeRO shards
    gather) over its 8 replicas only, and the weights fit without ZeRO-3: sharding gradients and optimizer
    states (ZeRO-2) then beats ZeRO-3, whose per-unit gathers FSDP's prefetch does not wholly hide."""
    from planner.search.search import search

    graph = mixtral_8x7b_graph()
    cluster = load_cluster("h100-sxm5-80gb", 8)
    result = search(graph, cluster, 256, Pins(tp=1, pp=1, micro_batch_size=1), top_k=3)
    best = result.best.cand
    assert (best.dp, best.ep, best.zero_stage) == (64, 8, 2), best.label()
    assert any("ep=" not in region and "out of memory" in why for region, why in result.rejected)
    no_ep = search(graph, cluster, 256, Pins(tp=1, pp=1, micro_batch_size=1, ep=1), top_k=1)
    assert no_ep.best.cand.zero_stage == 3
    # 2.19 s vs 3.19 s: the ring over 64 ranks crosses nodes on all 8 rails (terms.dp_link), so without ep the
    # gathers of every expert are costly but not prohibitive (was 2x before the rail-parallel rings)
    assert result.best.objective < 0.75 * no_ep.best.objective


# ------------------------------------------------------------------------------ plan and runtime


def test_plan_round_trips_ep_and_old_plans_still_load(tmp_path):
    from e2e.plans import make_plan

    from planner.errors import PlanError
    from planner.plan import SCHEMA_MINOR, load_plan

    plan = make_plan("gpt", dp=2)
    moe = plan.model_copy(
        update={"parallel": plan.parallel.model_copy(update={"ep": 2}), "experts": {"blocks.0.mlp.experts": 4}}
    )
    (tmp_path / "plan.json").write_text(moe.to_json())
    back = load_plan(tmp_path)
    assert back.parallel.ep == 2 and back.experts == {"blocks.0.mlp.experts": 4}
    assert back.schema_minor == moe.schema_minor <= SCHEMA_MINOR and back.to_json() == moe.to_json()

    old = json.loads(plan.to_json())
    del old["schema_minor"], old["parallel"]["ep"], old["experts"], old["predicted"]["comm"]["expert_parallel_s"]
    (tmp_path / "plan.json").write_text(json.dumps(old))
    assert load_plan(tmp_path).parallel.ep == 1

    newer = json.loads(plan.to_json())
    newer["schema_minor"] = SCHEMA_MINOR + 1
    (tmp_path / "plan.json").write_text(json.dumps(newer))
    with pytest.raises(PlanError, match="newer than this planner"):
        load_plan(tmp_path)

    bad = json.loads(moe.to_json())
    bad["parallel"]["ep"] = 3
    (tmp_path / "plan.json").write_text(json.dumps(bad))
    with pytest.raises(PlanError, match="ep"):
        load_plan(tmp_path)


def test_layout_validates_ep():
    from planner.runtime.errors import LayoutError
    from planner.runtime.layout import Layout, Stage

    def layout(**kw):
        base = dict(pp=1, dp=4, tp=1, micro_batch_size=1, num_micro_batches=1, stages=(Stage(0, ("m",)),),
                    ep=2, experts={"layers.{0-1}.mlp.experts": 4})
        return Layout(**{**base, **kw})

    assert layout().experts == {"layers.0.mlp.experts": 4, "layers.1.mlp.experts": 4}
    assert layout().describe()["ep"] == 2
    with pytest.raises(LayoutError, match="must divide DP"):
        layout(ep=3)
    with pytest.raises(LayoutError, match="does not divide"):
        layout(experts={"e": 3})
    with pytest.raises(LayoutError, match="names no experts"):
        layout(experts={})
    with pytest.raises(LayoutError, match="without tensor parallelism"):
        layout(dp=2, tp=2)
    # With a pipeline (experts sharded inside each stage's dp group), except under zero-bubble.
    two = (Stage(0, ("m",)), Stage(1, ("n",)))
    assert layout(pp=2, dp=2, stages=two).ep_enabled
    with pytest.raises(LayoutError, match="zero-bubble"):
        layout(pp=2, dp=2, schedule="zero-bubble", stages=(*two, Stage(1, ("o",)), Stage(0, ("p",))),
               virtual_stages=2)


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("interface", ["hf", "torchtitan"])
def test_a_pipeline_trace_keeps_the_experts_as_module_calls(method, interface):
    """Under expert parallelism a traced stage must call its experts modules (to swap them for this rank's
    slice): torch.fx keeps them as leaves; torch.export's graph gets them back from an opaque op. Either
    way no expert weight is read by the graph, and the experts' code is not inlined. The call keeps the
    model's arguments: HF's (hidden, top_k_index, top_k_weights), torchtitan's routed_experts (x, scores,
    expert_ids, tokens_per_expert)."""
    from torch import nn

    from planner.runtime.stages import _export_keeping, trace

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 8, 8))

        def forward(self, hidden, index, weights, *counts):
            return torch.einsum("th,thk->tk", hidden, self.w[index[:, 0]]) * weights[:, :1]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = Experts()

        def forward(self, x):
            w, i = torch.topk(self.gate(x).softmax(-1), 2)
            if interface == "hf":
                return x + self.experts(x, i, w)
            return x + self.experts(x, i, w, torch.nn.functional.one_hot(i, 4).sum(dim=(0, 1)))

    model = nn.Sequential(Block(), nn.Linear(8, 8)).to("meta")
    x = torch.randn(5, 8, device="meta")
    leaves = frozenset({"0.experts"})
    if method == "fx":
        gm, values, got = trace(model, (x,), leaves=leaves)
        assert got == "fx"
    else:
        gm = _export_keeping(model, (x,), leaves)
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "0.experts"]
    assert len(calls) == 1 and len(calls[0].args) == (3 if interface == "hf" else 4)
    assert not any(n.op == "get_attr" and str(n.target).startswith("0.experts.") for n in gm.graph.nodes)
    assert not any("einsum" in str(n.target) for n in gm.graph.nodes)
    assert gm(x).shape == (5, 8)
    assert model[0].experts.forward.__func__ is Experts.forward  # the model's own forward is back


def test_report_shows_ep_only_where_a_layout_has_it():
    import io

    from e2e.plans import make_plan
    from rich.console import Console

    from planner.plan import Alternative
    from planner.report.tables import alternatives_table, comm_table, degrees

    def text(renderable) -> str:
        console = Console(file=io.StringIO(), width=200, record=True, color_system=None)
        console.print(renderable)
        return console.export_text()

    dense = make_plan("gpt", dp=2)
    assert "expert parallel" not in text(comm_table(dense))
    moe_par = dense.parallel.model_copy(update={"ep": 2})
    comm = dense.predicted.comm.model_copy(update={"expert_parallel_s": 0.25})
    moe = dense.model_copy(
        update={
            "parallel": moe_par,
            "experts": {"blocks.0.mlp.experts": 4},
            "predicted": dense.predicted.model_copy(update={"comm": comm}),
            "alternatives": [Alternative(parallel=dense.parallel, recompute=["none"], predicted=dense.predicted)],
        }
    )
    def header(plan) -> list[str]:
        return next(line for line in text(alternatives_table(plan)).splitlines() if "dp/tp/pp/v" in line).split()

    assert "ep" in header(moe) and "ep" not in header(dense)
    assert "expert parallel (MoE all-to-all)" in text(comm_table(moe))
    assert degrees(moe_par).startswith("dp 2 (ep 2) / tp 1")


@pytest.mark.parametrize(("memory_gib", "dp"), [(30.0, None), (80.0, None), (30.0, 2), (80.0, 2)])
def test_search_with_experts_equals_brute_force_and_its_bounds_hold(memory_gib, dp):
    """With MoE blocks (ep searched, alongside pp) the ILP's ring rows use the experts' dp/ep count like the
    cost model: the search's optimum is brute force's, and no bound exceeds a candidate's optimum."""
    from synthetic import make_graph, make_unit
    from test_search_exact import brute_force

    from planner.search.search import search

    def moe(unit: Unit) -> Unit:
        return unit.model_copy(update={
            "expert_params": int(unit.params * 0.8), "experts": {f"{unit.name}.mlp.experts": 4},
            "ep_granularity": 4, "moe_dispatch_bytes": 2 * unit.output_bytes,
        })

    units = [make_unit("embed", "pre", 200_000_000, 1e11, 10_000_000, 4_000_000)]
    units += [moe(make_unit(f"blocks.{i}", "blk", 1_500_000_000, 2e12, 400_000_000, 4_000_000)) for i in range(3)]
    units += [make_unit("head", "post", 200_000_000, 4e11, 20_000_000, 4_000_000)]
    graph = make_graph(units)
    cl = load_cluster("a100-sxm4-80gb", 1, 4)
    # the instance is sized for a 5% fragmentation share (30 GiB, dp 2: experts inside pipeline stages just fit)
    reserve = cl.gpu.memory_reserve.model_copy(update={"fragmentation": 0.05})
    cl = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"memory_gib": memory_gib, "memory_reserve": reserve})})
    expected = brute_force(graph, cl, 8, dp)
    assert expected is not None
    got = search(graph, cl, 8, Pins(dp=dp), top_k=2, prefer_simulated=False)
    assert got.status == "optimal"
    assert got.best.objective == pytest.approx(expected[0], rel=1e-9), (got.best.cand, expected[1])
    if (memory_gib, dp) == (30.0, 2):  # the one where experts sharded inside pipeline stages win
        assert (got.best.cand.pp, got.best.cand.ep) == (2, 2), got.best.cand.label()


@pytest.mark.parametrize("layout", ["pp2xdp2", "dp4"])
def test_a_traced_graph_without_ep_still_names_the_experts_it_calls(layout, tmp_path):
    """Without expert parallelism a pipeline stage still calls each experts module as a module (the experts
    then run their own code on the rank's device, not the GPU path a meta trace inlines: transformers' int32
    histc): plan.json and train.py name them. The model as written (dp4) needs no such list."""
    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.codegen.render import runtime_objects
    from planner.plan import load_plan

    out = tmp_path / "plan"
    pins = ["--pp", "2", "--dp", "2", "--schedule", "1f1b"] if layout == "pp2xdp2" else ["--dp", "4"]
    result = CliRunner().invoke(
        app,
        ["plan", str(MODELS / "deepseek_moe.py"), "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4",
         "--global-batch-size", "8", "--micro-batch-size", "2", *pins, "--ep", "1", "--out", str(out), "--quiet"],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    script = (out / "train.py").read_text()
    assert plan.parallel.ep == 1
    if layout == "dp4":
        assert plan.experts == {} and "EXPERTS" not in script
        return
    assert plan.experts and all(n == 4 for n in plan.experts.values())
    assert "EXPERTS = {" in script and "ep=EP, experts=EXPERTS" in script
    layout_obj = runtime_objects(plan)[0]
    assert set(layout_obj.experts) == set(plan.experts) and not layout_obj.ep_enabled


# ------------------------------------------------------------- torchtitan's routed experts under ep


class _TitanGroupedExperts(torch.nn.Module):
    """torchtitan's GroupedExperts (models/common/moe.py): grouped weights [E, out, in] run by
    torch._grouped_mm in bf16 on tokens sorted by expert, with the count of each."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1_EFD = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)
        self.w2_EDF = torch.nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)
        self.w3_EFD = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, w.bfloat16().transpose(-2, -1), offs=offs)

        h = torch.nn.functional.silu(mm(x.bfloat16(), self.w1_EFD)) * mm(x.bfloat16(), self.w3_EFD)
        return mm(h, self.w2_EDF).type_as(x)


class _TitanRoutedExperts(torch.nn.Module):
    """torchtitan's RoutedExperts with its local dispatcher: tokens sorted by expert, the grouped experts, the
    router scores applied in fp32, a scatter-add back to the tokens."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.inner_experts = _TitanGroupedExperts(experts, dim, hidden)
        self.token_dispatcher = object()  # torchtitan's is not a module; shard_experts recognises the pair

    def forward(self, x, scores, ids, counts):
        b, s, d = x.shape
        k = ids.shape[-1]
        flat = x.view(-1, d)
        order = torch.argsort(ids.view(-1), stable=True)
        token = order // k
        y = self.inner_experts(flat[token], counts)
        y = (y.float() * scores.reshape(-1)[order].reshape(-1, 1)).to(y.dtype)
        return torch.zeros_like(flat).scatter_add(0, token.reshape(-1, 1).expand(-1, d), y).view(b, s, d)


def _titan_inputs(rank: int, experts: int, top_k: int, only: int | None):
    """One rank's tokens and routing; `only`: every token routed among the first `only` experts."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 6, 16, generator=g)
    logits = torch.randn(2, 6, experts if only is None else only, generator=g)
    scores, ids = torch.topk(logits.softmax(-1), top_k)
    counts = torch.zeros(2, 6, experts, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=(0, 1))
    return x, scores, ids, counts


def _titan_ep_worker(rank: int, init: str, results: str) -> None:
    import copy

    import torch.distributed as dist

    from planner.runtime.experts import GroupedExpertParallel, shard_experts

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        for only in (None, 2):  # 2: every token goes to rank 0's experts, rank 1 receives none
            torch.manual_seed(0)
            whole = torch.nn.Module()
            whole.moe = _TitanRoutedExperts(4, 16, 32)
            sharded = copy.deepcopy(whole)
            (got,) = shard_experts(sharded, {"moe": 4}, 2, rank, dist.group.WORLD)
            assert isinstance(got, GroupedExpertParallel) and got.local.w1_EFD.shape == (2, 32, 16)
            assert got.local.num_experts == 2
            # The whole experts on both ranks' tokens: this rank's output and input gradients, and the experts'
            # gradients summed over both ranks' tokens.
            mine = None
            for r in range(2):
                x, scores, ids, counts = _titan_inputs(r, 4, 2, only)
                x.requires_grad_(True)
                scores.requires_grad_(True)
                out = whole.moe(x, scores, ids, counts)
                (out * torch.arange(out.numel()).view_as(out).cos()).sum().backward()
                if r == rank:
                    mine = (out.detach(), x.grad, scores.grad)
            x, scores, ids, counts = _titan_inputs(rank, 4, 2, only)
            x.requires_grad_(True)
            scores.requires_grad_(True)
            out = sharded.moe(x, scores, ids, counts)
            (out * torch.arange(out.numel()).view_as(out).cos()).sum().backward()
            torch.testing.assert_close(out, mine[0], rtol=0, atol=0)
            torch.testing.assert_close(x.grad, mine[1], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(scores.grad, mine[2], rtol=1e-6, atol=1e-7)
            for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
                want = whole.moe.inner_experts.get_parameter(name).grad[2 * rank : 2 * rank + 2]
                # The slice's gradient is scaled by 1/ep inside (FSDP's mean over dp/ep replicas then equals
                # the mean over dp): times ep, the sum over both ranks' tokens. The grouped matmul's weight
                # gradient is rounded to bf16 once per call (one call over both ranks' tokens here, two for the
                # whole module): equal within bf16's resolution (2^-8) of the largest entry.
                grad = got.local.get_parameter(name).grad * 2
                assert (grad - want).abs().max() <= 2**-6 * want.abs().max(), (name, only)
                assert bool(grad.any()) == bool(want.any()), (name, only)
        dist.barrier()  # every collective done on both ranks before the group goes (see test_titan_tp._worker)
        if rank == 0:
            Path(results).write_text("ok")
    finally:
        dist.destroy_process_group()


def test_torchtitan_routed_experts_sharded_over_two_ranks_equal_the_whole(tmp_path):
    """shard_experts recognises torchtitan's routed experts (inner_experts beside a token_dispatcher) and
    keeps this rank's half of the grouped weights: on 2 gloo ranks each rank's output and input gradients
    equal the whole module's on its tokens, and each slice's weight gradients the whole one's over both ranks'
    tokens; also when one rank receives no token (its experts' gradients are zeros)."""
    import torch.multiprocessing as mp

    results = tmp_path / "ok"
    mp.spawn(_titan_ep_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(results)), nprocs=2, join=True)
    assert results.read_text() == "ok"


def test_experts_whose_code_cannot_run_on_meta_stay_calls_in_a_trace_with_meta_values():
    """Where plain torch.fx cannot follow the model (Python reads a shape; transformers' decorated forwards) the
    trace with meta values takes over. The experts modules it keeps as calls are given a meta value of their
    hidden input's shape, not run: their code takes the GPU's path on meta (transformers' grouped_mm wants bf16
    there), and running it sent Jamba and Mixtral to torch.export, which inlines Jamba's Mamba mixers (a
    constant made in their scan: no pipeline). The graph module holds a shape stand-in; the model keeps its
    own experts, which a stage fetches by name."""
    from torch import nn

    from planner.runtime.stages import fetch, trace

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 8, 8))

        def forward(self, hidden, index, weights):
            if hidden.is_meta:
                raise RuntimeError("Expected inputs of BF16 type")  # as torch's meta grouped_mm on fp32
            return torch.einsum("th,thk->tk", hidden, self.w[index[:, 0]]) * weights[:, :1]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.experts = Experts()

        def forward(self, x):
            if x.shape[0] > 1:  # plain torch.fx cannot branch on a shape
                x = x * 2
            w, i = torch.topk(self.gate(x).softmax(-1), 2)
            return x + self.experts(x, i, w)

    model = nn.Sequential(Block(), nn.Linear(8, 8))
    meta = nn.Sequential(Block(), nn.Linear(8, 8)).to("meta")
    x = torch.randn(5, 8)
    gm, values, method = trace(meta, (x.to("meta"),), leaves=frozenset({"0.experts"}))
    assert method == "fx-meta"
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "0.experts"]
    assert len(calls) == 1 and values[calls[0]].shape == (5, 8)
    assert not any("einsum" in str(n.target) for n in gm.graph.nodes)
    assert type(meta[0].experts) is Experts and type(gm.get_submodule("0.experts")) is not Experts
    assert fetch(model, gm, "0.experts", torch.device("cpu")) is model[0].experts
    # The graph run with the model's modules computes the model's forward.
    real = torch.fx.GraphModule(model, gm.graph)
    torch.testing.assert_close(real(x), model(x))
