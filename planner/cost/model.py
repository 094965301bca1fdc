"""The analytic cost model: per-unit time and memory for a configuration, and a whole plan's figures.

Compute is a roofline per op class: dense matmuls against peak FLOP/s times a GEMM efficiency that grows
with the GEMM's size, attention against peak times an attention efficiency, and every other op (norms,
elementwise, softmax, embedding gathers) by its bytes against memory bandwidth. Communication uses the ring
formulas of `collectives`, memory the formulas of `memory`, pipelines the schedules of `schedules` and,
for the final figures, the discrete-event simulator. Every time carries its source: `measured` when a
profile of the target GPU supplied it, else `estimated`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost import collectives as coll
from planner.cost.candidate import Candidate, CostOptions, GiB
from planner.cost.memory import activation_bytes, held_states, model_state_bytes_per_param
from planner.cost.placement import stage_rank
from planner.cost.schedules import in_flight_microbatches, rank_peak_activations
from planner.cost.terms import (
    Affine,
    comm_buffer_bytes,
    cp_kv_exchange_time,
    crosses_nodes,
    dp_link,
    dp_sync_time,
    expert_state_params,
    expert_sync_params,
    frozen_state_params,
    moe_alltoall_time,
    optimizer_step_time,
    p2p_link,
    p2p_time,
    pipeline_time,
    rank_peak_bytes,
    sync_overlap_window,
    zero3_gather_time,
    zero3_unit_exposed_time,
)
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph, Unit
from planner.names import RECOMPUTE_MODES

# Re-exported: the terms were defined here before planner.cost.terms; callers still import them from here.
optimizer_time = optimizer_step_time
__all__ = ["GiB", "Candidate", "CostOptions", "crosses_nodes", "dp_link", "optimizer_time", "p2p_link", "p2p_time"]


@dataclass(frozen=True)
class UnitTimes:
    """Measured or estimated times of one unit per micro-batch on one GPU at a TP degree."""

    fwd: float
    bwd: float
    source: str = "estimated"


@dataclass
class Profile:
    """Measured unit times by (unit signature, micro-batch size, tp); empty means all estimated."""

    device: str = ""
    times: dict[tuple[str, int, int], UnitTimes] = field(default_factory=dict)
    # achieved / roofline-estimated time on the local device, to scale estimates for other GPUs
    efficiency_scale: float = 1.0


@dataclass
class UnitCost:
    """A unit's per-micro-batch costs under one candidate, for each recomputation mode."""

    fwd: float  # compute + TP communication
    bwd: dict[str, float]  # backward incl. recomputation and TP communication, per mode
    act: dict[str, float]  # activation bytes kept per micro-batch, per mode
    params_local: float  # parameters on one GPU (after TP)
    tp_comm_fwd: float
    tp_comm_bwd: float
    largest_param_bytes: float
    source: str
    ep_comm: float = 0.0  # expert-parallel all-to-all per micro-batch, forward + backward
    # parameters as the data-parallel ring terms count them (gradient sync, ZeRO-3 gathers); None: params_local.
    # They differ only for experts, which reduce over the dp/ep replicas (`terms.expert_sync_params`).
    sync_params_or_none: float | None = None
    # the experts' share: parameters a rank holds (E/ep) and their count in params_local (`expert_state_params`),
    # so the states split into weights, gradients and optimizer exactly (`expert_state_split`)
    experts_held: float = 0.0
    experts_counted: float = 0.0
    # frozen parameters on one GPU (after TP): weights only. params_local counts them by
    # `terms.frozen_state_params`, so that `model_state_bytes(params_local)` is exact.
    frozen_local: float = 0.0

    @property
    def sync_params(self) -> float:
        return self.params_local if self.sync_params_or_none is None else self.sync_params_or_none


def gemm_efficiency(cluster: ClusterSpec, dim: float) -> float:
    """Fraction of peak a GEMM reaches: matmul * d / (d + d_half), d its smallest dimension (`gemm_dim_at`)."""
    e = cluster.gpu.efficiency
    if dim <= 0:
        return e.matmul
    return e.matmul * dim / (dim + e.gemm_half_dim)


def gemm_dim_at(unit: Unit, tp: int, mbs: int) -> float:
    """The size of one rank's GEMMs for `gemm_efficiency`: each Linear call runs an M x K x N GEMM (M its
    tokens per micro-batch, K its input and N its output features), of which tensor parallelism divides N for a
    column-parallel (or vocabulary-parallel) Linear and K for a row-parallel one (Shoeybi et al. 2019, sec. 3):
    at tp 8 a GPT block's q/k/v and fc1 keep K = h, only the attention projection's K is h / 8. A GEMM's size is
    its smallest dimension min(M, K, N), the one that limits its tiles and its arithmetic intensity. The unit's
    is their harmonic mean weighted by each GEMM's FLOPs F_i on the rank, under which the summed time of the
    GEMMs at eff = matmul * d / (d + d_half) is exact: sum F_i (1 + d_half / d_i) = F (1 + d_half / d).
    Units without recorded shapes (graphs analysed before them): the FLOP-weighted smallest weight
    dimension divided by tp."""
    if not unit.gemm_shapes:
        return min(unit.gemm_dim, max(1, unit.gemm_dim // tp)) if tp > 1 else unit.gemm_dim
    flops = weighted = 0.0
    for g in unit.gemm_shapes:
        m = g.tokens * mbs
        k = g.in_features / tp if g.split == "rowwise" else g.in_features
        n = g.out_features / tp if g.split == "colwise" else g.out_features
        f = m * k * n
        flops += f
        weighted += f / max(1.0, min(m, k, n))
    return flops / weighted if weighted > 0 else 0.0


def roofline_times(
    unit: Unit, mbs: int, tp: int, sp: bool, cluster: ClusterSpec, dtype: str
) -> tuple[float, float, float]:
    """(forward, backward, attention-core forward) seconds of one micro-batch, compute only."""
    mm_scale, mm_rate, attn_scale, at_rate, mem_scale, bw = roofline_rates(unit, tp, sp, cluster, dtype, mbs)
    fwd = (
        unit.matmul_flops * mm_scale / mm_rate
        + unit.attention_flops * attn_scale / at_rate
        + unit.memory_bound_bytes * mem_scale / bw
    )
    bwd = (
        unit.bwd_matmul_flops * mm_scale / mm_rate
        + unit.bwd_attention_flops * attn_scale / at_rate
        + unit.bwd_memory_bound_bytes * mem_scale / bw
    )
    core = unit.attention_flops * attn_scale / at_rate
    return fwd * mbs, bwd * mbs, core * mbs


def roofline_rates(
    unit: Unit, tp: int, sp: bool, cluster: ClusterSpec, dtype: str, mbs: int
) -> tuple[float, float, float, float, float, float]:
    """(matmul share, matmul FLOP/s, attention share, attention FLOP/s, memory-bound share, bytes/s) of the unit
    on one GPU at micro-batch size `mbs` (its GEMMs' sizes, `gemm_dim_at`), the shares being what tensor
    parallelism leaves it: what `roofline_times` divides its counts by."""
    gpu = cluster.gpu
    e = gpu.efficiency
    peak = gpu.peak_flops(dtype)
    bw = gpu.memory_bandwidth * e.memory
    sharded = bool(unit.tp_pairs or unit.tp_gather_bytes) and tp > 1
    mm_shard = 0.0
    if sharded and unit.matmul_flops > 0:
        mm_shard = min(1.0, max(0.0, (unit.tp_shardable_flops - unit.attention_flops) / unit.matmul_flops))
    mm_scale = (1 - mm_shard) + mm_shard / tp if sharded else 1.0
    attn_scale = 1.0 / tp if sharded and unit.tp_shards_attention else 1.0  # refused attention stays whole
    # Elementwise work inside TP regions shards; with sequence parallelism the rest does too.
    mem_scale = 1.0 / tp if (sp and tp > 1) else ((1 - mm_shard) + mm_shard / tp if sharded else 1.0)
    dim = gemm_dim_at(unit, tp if sharded else 1, mbs)
    mm_rate = peak * gemm_efficiency(cluster, dim)
    at_rate = peak * e.attention
    return mm_scale, mm_rate, attn_scale, at_rate, mem_scale, bw


def op_sac_recompute_share(unit: Unit, cand: Candidate, cluster: ClusterSpec, dtype: str) -> float:
    """The share of a unit's forward compute time that per-op selective checkpointing ("op") re-runs in backward:
    all of it but the attention kernels and the matmuls whose outputs it keeps (`Unit.op_sac_kept_matmul_flops`),
    on the roofline; the same share of a measured forward time."""
    mm_scale, mm_rate, attn_scale, at_rate, mem_scale, bw = roofline_rates(
        unit, cand.tp, cand.sequence_parallel, cluster, dtype, cand.micro_batch_size
    )
    mm, at = mm_scale / mm_rate, attn_scale / at_rate
    fwd = unit.matmul_flops * mm + unit.attention_flops * at + unit.memory_bound_bytes * mem_scale / bw
    if fwd <= 0:
        return 0.0
    kept = min(unit.op_sac_kept_matmul_flops, unit.matmul_flops) * mm + unit.attention_flops * at
    return max(0.0, fwd - kept) / fwd


def loss_parallel(unit: Unit, cand: Candidate) -> bool:
    """Whether the run keeps `unit`'s vocabulary-parallel logits split for the loss (runtime/vocab.py's
    with_loss_parallel: tp > 1, no context parallelism, the next-token cross-entropy on them)."""
    return unit.loss_parallel and cand.tp > 1 and cand.cp == 1


def tp_comm_times(
    unit: Unit, mbs: int, tp: int, sp: bool, cluster: ClusterSpec, sharded_logits: bool = False
) -> tuple[float, float]:
    """Tensor-parallel communication per micro-batch (Shoeybi et al. 2019, Megatron-LM, Fig. 3).

    Each column/row pair all-reduces its output in forward and its input gradient in backward; with
    sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather of the same total
    volume (Korthikanti et al. 2022). A vocab-parallel embedding all-reduces its output in forward.
    TP groups sit inside a node. A vocab-parallel head all-gathers its logits, unless the loss takes them
    split (`sharded_logits`, loss parallelism: its all-reduces of a few numbers per token are left out).
    """
    if tp <= 1:
        return 0.0, 0.0
    topo = cluster.topology
    bw = topo.intra_node_bandwidth * cluster.gpu.efficiency.network
    lat = topo.intra_node_latency
    fwd = bwd = 0.0
    for pair in unit.tp_pairs:
        nbytes = pair.allreduce_bytes * mbs
        if sp:
            t = coll.reduce_scatter_time(nbytes, tp, bw, lat) + coll.allgather_time(nbytes, tp, bw, lat)
        else:
            t = coll.allreduce_time(nbytes, tp, bw, lat)
        fwd += t
        bwd += t
    n_emb = sum(1 for s in unit.tp_styles.values() if s == "rowwise") - len(unit.tp_pairs)
    if n_emb > 0:
        fwd += n_emb * coll.allreduce_time(unit.output_bytes * mbs, tp, bw, lat)
    if unit.tp_gather_bytes and not sharded_logits:  # vocab-parallel head: gather the logits (backward: a slice)
        fwd += coll.allgather_time(unit.tp_gather_bytes * mbs, tp, bw, lat)
    return fwd, bwd


def async_tp_exposed(
    unit: Unit, comm_fwd: float, comm_bwd: float, cand: Candidate, cluster: ClusterSpec, dtype: str
) -> tuple[float, float]:
    """The tensor-parallel communication a unit still waits for under torch's async TP (forward, backward).

    Async TP (Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition";
    torch's micro-pipeline TP under torch.compile, torchtitan's enable_async_tensor_parallel) splits each
    sequence-parallel all-gather -> matmul and matmul -> reduce-scatter into tp steps over symmetric memory:
    step i's transfer runs during step i-1's matmul chunk, so the first (last) chunk's transfer, 1/tp of the
    collective, is exposed and the rest hides behind the sharded matmuls up to their time. The copies run on
    the copy engines, not the SMs. Communication outside the column/row pairs (a vocab-parallel embedding's
    all-reduce, a head's logit gather) stays exposed.
    """
    tp = cand.tp
    pairs_f = pairs_b = 0.0
    topo = cluster.topology
    bw, lat = topo.intra_node_bandwidth * cluster.gpu.efficiency.network, topo.intra_node_latency
    for pair in unit.tp_pairs:
        nbytes = pair.allreduce_bytes * cand.micro_batch_size
        t = coll.reduce_scatter_time(nbytes, tp, bw, lat) + coll.allgather_time(nbytes, tp, bw, lat)
        pairs_f += t
        pairs_b += t
    rest_f, rest_b = comm_fwd - pairs_f, comm_bwd - pairs_b
    gpu = cluster.gpu
    sharded = (
        min(1.0, max(0.0, (unit.tp_shardable_flops - unit.attention_flops) / unit.matmul_flops))
        if unit.matmul_flops > 0 else 0.0
    )
    dim = gemm_dim_at(unit, tp, cand.micro_batch_size)
    rate = gpu.peak_flops(dtype) * gemm_efficiency(cluster, dim)
    mm_f = unit.matmul_flops * sharded / tp / rate * cand.micro_batch_size
    mm_b = unit.bwd_matmul_flops * sharded / tp / rate * cand.micro_batch_size

    def exposed(comm: float, mm: float) -> float:
        return comm / tp + max(0.0, comm * (tp - 1) / tp - mm)

    return rest_f + exposed(pairs_f, mm_f), rest_b + exposed(pairs_b, mm_b)


def math_scores(unit: Unit, cluster: ClusterSpec) -> float:
    """Bytes per sample a unit's SDPA calls keep beyond the fused kernels on this GPU: the s x s probabilities
    where its attention backend (`GPUSpec.attention_backend`) is math, else 0."""
    return float(unit.sdpa_score_bytes) if cluster.gpu.attention_backend == "math" else 0.0


def unit_cost(
    unit: Unit, cand: Candidate, cluster: ClusterSpec, dtype: str, profile: Profile | None = None
) -> UnitCost:
    """Per-micro-batch time and memory of one unit under a candidate, for every recomputation mode."""
    fwd_c, bwd_c, core_c = roofline_times(unit, cand.micro_batch_size, cand.tp, cand.sequence_parallel, cluster, dtype)
    source = "estimated"
    if profile is not None:
        hit = profile.times.get((unit.signature, cand.micro_batch_size, cand.tp))
        if hit is not None:
            fwd_c, bwd_c, source = hit.fwd, hit.bwd, hit.source
            core_c = fwd_c * (unit.attention_flops / unit.fwd_flops if unit.fwd_flops else 0.0)
        elif profile.efficiency_scale != 1.0:
            fwd_c *= profile.efficiency_scale
            bwd_c *= profile.efficiency_scale
            core_c *= profile.efficiency_scale
    tf, tb = tp_comm_times(
        unit, cand.micro_batch_size, cand.tp, cand.sequence_parallel, cluster, loss_parallel(unit, cand)
    )
    if cand.tp_overlap and cand.tp > 1 and cand.sequence_parallel:
        tf, tb = async_tp_exposed(unit, tf, tb, cand, cluster, dtype)
    a2a = moe_alltoall_time(unit.moe_dispatch_bytes, cand, cluster) if unit.experts else 0.0
    kv = 0.0
    if cand.cp > 1:
        # Context parallelism: a rank runs 1/cp of each sample's tokens through every op (its queries against
        # all keys: 1/cp of the attention too, causal or not, with torch's head-tail load balancing) and
        # exchanges keys and values over the cp ranks (`terms.cp_kv_exchange_time`).
        fwd_c, bwd_c, core_c, tf, tb = (t / cand.cp for t in (fwd_c, bwd_c, core_c, tf, tb))
        kv = cp_kv_exchange_time(unit.sdpa_kv_bytes, cand, cluster)
    # Expert parallelism: dispatch + combine in forward, their gradients in backward.
    fwd = fwd_c + tf + a2a + kv
    scores = math_scores(unit, cluster)
    bwd = {
        "none": bwd_c + tb + a2a + kv,
        # selective: re-run the attention core (Korthikanti et al. 2022, sec. 4.1)
        "selective": bwd_c + tb + a2a + kv + (core_c if unit.attention_core_bytes + scores > 0 else 0.0),
        # full: re-run the whole forward, its TP and expert communication included
        "full": bwd_c + tb + a2a + kv + fwd,
        # op (torchtitan's per-op policy): re-run the forward but the kept matmuls and the attention kernels,
        # its TP and expert communication included
        "op": bwd_c + tb + a2a + kv + fwd_c * op_sac_recompute_share(unit, cand, cluster, dtype) + tf + a2a + kv,
    }
    tp_sharded = bool(unit.tp_pairs) or bool(unit.tp_styles)
    act: dict[str, float] = {
        mode: activation_bytes(
            unit.activation_bytes,
            unit.attention_core_bytes,
            unit.input_bytes,
            cand.micro_batch_size,
            mode,
            cand.tp,
            tp_sharded,
            cand.sequence_parallel,
            scores,
            unit.op_sac_bytes,
        )
        for mode in RECOMPUTE_MODES
    }
    if cand.cp > 1:
        # 1/cp of the tokens' activations; the attention keeps the gathered keys and values of the whole
        # sequence for its backward, (cp-1)/cp of them on top of the rank's own share (not under full
        # recomputation, which keeps only the unit's input).
        gathered = unit.sdpa_kv_bytes * cand.micro_batch_size / cand.tp * (cand.cp - 1) / cand.cp
        act = {mode: a / cand.cp + (gathered if mode != "full" else 0.0) for mode, a in act.items()}
    if unit.loss_bytes:
        # The loss on the last unit's output runs outside every checkpointed unit: kept whatever the mode, on the
        # rank's share of the tokens, and under loss parallelism on its share of the vocabulary (a head whose
        # logits another loss reads gathers them: whole on each tp rank). Its backward's peak is counted with it,
        # per micro-batch in flight (1F1B's last stage holds one).
        loss = unit.loss_bytes * cand.micro_batch_size / cand.cp / (cand.tp if loss_parallel(unit, cand) else 1)
        act = {mode: a + loss for mode, a in act.items()}
    shard = unit.tp_shardable_params if cand.tp > 1 else 0
    experts = unit.expert_params  # not TP-sharded; ep divides them (`terms.expert_state_params`)
    dense = (unit.params - experts - shard) + shard / cand.tp
    # Frozen parameters (not experts) are taken as spread like the unit's other dense ones over the tp ranks.
    dense_all = unit.params - experts
    frozen = min(unit.frozen_params, dense_all) * (dense / dense_all) if dense_all else 0.0
    state = model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp_shard)
    params_local = dense - frozen + frozen_state_params(frozen, state) + expert_state_params(experts, cand, dtype)
    sync_params = dense + expert_sync_params(experts, cand) if experts and cand.ep > 1 else None
    if cand.zero_stage == 3 and cand.dp > 1:
        # FSDP2's per-unit gathers: the part the one-ahead prefetch cannot hide, and the copy-out (the recomputed
        # forward of full recomputation shares the backward's gather)
        # (the ring counts the parameters as the stage's gather term does: `UnitCost.sync_params`)
        ring = params_local if sync_params is None else sync_params
        held = dense + experts / cand.ep
        fwd += zero3_unit_exposed_time(ring, held, fwd_c, cand, cluster, dtype)
        bwd = {mode: t + zero3_unit_exposed_time(ring, held, bwd_c, cand, cluster, dtype) for mode, t in bwd.items()}
    return UnitCost(
        fwd=fwd,
        bwd=bwd,
        act=act,
        params_local=params_local,
        tp_comm_fwd=tf,
        tp_comm_bwd=tb,
        largest_param_bytes=unit.param_bytes / (cand.tp if shard else 1),
        source=source,
        ep_comm=2.0 * a2a,
        sync_params_or_none=sync_params,
        experts_held=experts / cand.ep if cand.ep > 1 else 0.0,
        experts_counted=expert_state_params(experts, cand, dtype) if cand.ep > 1 else 0.0,
        frozen_local=frozen,
    )


# ---------------------------------------------------------------------------------------------- layout


def dp_comm_time(sync_params: float, cand: Candidate, cluster: ClusterSpec, dtype: str) -> tuple[float, float]:
    """(per-iteration gradient sync, per-micro-batch ZeRO-3 weight gathers) of one stage's rank
    (`terms.dp_sync_time`, `terms.zero3_gather_time`) for its parameters as the ring counts them
    (`UnitCost.sync_params`)."""
    return dp_sync_time(sync_params, cand, cluster, dtype), zero3_gather_time(sync_params, cand, cluster, dtype)


# ------------------------------------------------------------------------------------- stage figures


@dataclass
class StageCost:
    index: int
    rank: int
    units: list[int]
    recompute: str
    fwd: float
    bwd: float
    p2p: float
    weights: float
    gradients: float
    optimizer: float
    activations: float
    comm_buffers: float
    params_local: float
    dp_sync: float
    zero3_gather: float
    tp_comm: float
    source: str
    # Megatron-LM's block recomputation (`--recompute-method block`): the first `full_blocks` blocks of the stage
    # (`full_block_units`) recomputed fully, the rest at `recompute`; 0: every unit at `recompute`
    full_blocks: int = 0

    @property
    def compute(self) -> float:
        return self.fwd + self.bwd


def block_units(graph: ModelGraph) -> frozenset[int]:
    """The units that are blocks for block recomputation: those whose signature (structure) occurs more than once
    in the model, as Megatron-LM's `--recompute-num-layers` counts transformer layers and not the embedding or the
    head."""
    seen: dict[str, int] = {}
    for u in graph.units:
        seen[u.signature] = seen.get(u.signature, 0) + 1
    return frozenset(i for i, u in enumerate(graph.units) if seen[u.signature] > 1)


def full_block_units(graph: ModelGraph, units: list[int], k: int) -> list[int]:
    """The first `k` blocks (`block_units`) of a stage's units, in execution order: the units Megatron-LM's
    `--recompute-method block --recompute-num-layers k` recomputes fully in that stage. ValueError where the stage
    holds fewer than `k` blocks."""
    blocks = block_units(graph)
    mine = [u for u in units if u in blocks]
    if k > len(mine):
        raise ValueError(f"a stage holding {len(mine)} block(s) cannot recompute {k} of them")
    return mine[:k]


def stage_costs(
    graph: ModelGraph,
    cluster: ClusterSpec,
    cand: Candidate,
    partition: list[list[int]],
    recompute: list[str],
    costs: list[UnitCost],
    options: CostOptions,
    memo: dict[tuple[int, tuple[int, ...], str, int, bool], StageCost] | None = None,
    full_blocks: list[int] | None = None,
) -> list[StageCost]:
    """Per-stage time and memory of a partition (memory per rank when a rank holds several stages).

    `full_blocks`: per stage, how many of its first blocks are recomputed fully whatever its mode (Megatron-LM's
    block method, `full_block_units`): each keeps only its input (`act["full"]`) and re-runs its forward in
    backward (`bwd["full"]`); None: none. `memo`: stage figures already computed for these graph, cluster,
    candidate, costs and options, by (stage index, units, recomputation, full blocks, last stage): a stage's
    figures depend on nothing else, so the partitions of one candidate that share a stage share its figures
    (`PartitionProblem.stage_memo`; never mutated)."""
    out: list[StageCost] = []
    last = len(partition) - 1
    largest: float | None = None
    for s, (units, mode) in enumerate(zip(partition, recompute)):
        k = full_blocks[s] if full_blocks is not None else 0
        key = (s, tuple(units), mode, k, s == last)
        known = memo.get(key) if memo is not None else None
        if known is None:
            if largest is None:
                largest = largest_param_bytes(costs)
            known = stage_cost(graph, cluster, cand, s, units, mode, costs, options, k, s == last, largest)
            if memo is not None:
                memo[key] = known
        out.append(known)
    return out


def largest_param_bytes(costs: list[UnitCost]) -> float:
    """The largest parameter's bytes over the units: the size of the communication buffers (`stage_cost`)."""
    return max(c.largest_param_bytes for c in costs)


def stage_cost(
    graph: ModelGraph,
    cluster: ClusterSpec,
    cand: Candidate,
    s: int,
    units: list[int],
    mode: str,
    costs: list[UnitCost],
    options: CostOptions,
    k: int,
    last: bool,
    largest_param: float,
) -> StageCost:
    """Time and memory of stage `s` holding `units` in recomputation `mode`, its first `k` blocks recomputed
    fully (`stage_costs`); `last`: the partition's last stage (no boundary to send on); `largest_param`:
    `largest_param_bytes(costs)` (the buffers' size), computed once by the caller."""
    dtype = graph.source.dtype
    rank = stage_rank(cand.schedule, cand.pp, cand.virtual_stages, s)
    uc = [costs[u] for u in units]
    params = sum(c.params_local for c in uc)
    weights, gradients, optimizer = stage_state_bytes(
        cand, dtype, params, sum(c.experts_held for c in uc), sum(c.frozen_local for c in uc),
        sum(c.experts_counted for c in uc),
    )
    full = set(full_block_units(graph, units, k)) if k else set()
    modes = ["full" if u in full else mode for u in units]
    fwd = sum(c.fwd for c in uc)
    bwd = sum(c.bwd[r] for c, r in zip(uc, modes))
    boundary = graph.units[units[-1]].output_bytes if not last else 0
    p2p = p2p_time(boundary, cand, cluster) if not last else 0.0
    inflight = in_flight_microbatches(cand.schedule, cand.pp, cand.num_micro_batches, cand.virtual_stages, s)
    act = inflight * sum(c.act[r] for c, r in zip(uc, modes))
    sync, gather = dp_comm_time(sum(c.sync_params for c in uc), cand, cluster, dtype)
    buffers = comm_buffer_bytes(boundary, cand, options, largest_param)
    return StageCost(
        index=s,
        rank=rank,
        units=list(units),
        recompute=mode,
        fwd=fwd,
        bwd=bwd,
        p2p=p2p,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=act,
        comm_buffers=buffers,
        params_local=params,
        dp_sync=sync,
        zero3_gather=gather,
        tp_comm=sum(c.tp_comm_fwd + c.tp_comm_bwd for c in uc),
        source="measured" if uc and all(c.source == "measured" for c in uc) else "estimated",
        full_blocks=k,
    )


def stage_state_bytes(
    cand: Candidate, dtype: str, params: Affine, held: Affine, frozen: Affine, counted: Affine
) -> tuple[Affine, Affine, Affine]:
    """(weights, gradients, optimizer state) bytes of a stage whose units hold `params` parameters locally, of
    which `held` experts' (`counted` as experts in `params`) and `frozen` frozen ones; floats, or arrays of
    stages (the brute force's memory screen, `planner.search.reference`)."""
    state = model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp_shard)
    # Experts under ep: E/ep per rank, their gradients and ZeRO shards over the dp/ep replicas of that slice.
    replica = model_state_bytes_per_param(dtype, cand.zero_stage, max(1, cand.dp // cand.ep))
    # dense trainable parameters: what is neither an expert (split over the dp/ep replicas) nor frozen
    trainable = params - counted - frozen_state_params(frozen, state)
    return (
        (trainable + frozen) * state.weights + held * replica.weights,
        trainable * state.gradients + held * replica.gradients,
        trainable * state.optimizer + held * replica.optimizer,
    )


def stages_by_rank(stages: list[StageCost], pp: int) -> list[list[StageCost]]:
    """Each pipeline rank's stages, in stage order."""
    out: list[list[StageCost]] = [[] for _ in range(pp)]
    for s in stages:
        out[s.rank].append(s)
    return out


def rank_memory(stages: list[StageCost], cand: Candidate, options: CostOptions) -> dict[int, float]:
    """Peak bytes per pipeline rank: its stages' states and activations plus workspace and fragmentation.

    For interleaved and zero-bubble schedules a rank's stages do not peak together: its activations are the
    largest over the schedule's instants of each stage's count there times its activations per micro-batch
    (`rank_stage_counts`), lower than the sum of the stages' own peaks, and lower than the rank's in-flight
    total times its largest stage where the stages differ (the last stage's loss, held for one micro-batch).
    """
    per_rank: dict[int, float] = {}
    for r, mine in enumerate(stages_by_rank(stages, cand.pp)):
        states = sum(held_states(s) for s in mine)
        if cand.virtual_stages > 1:
            p, m, v = cand.pp, cand.num_micro_batches, cand.virtual_stages
            per_mb = [s.activations / max(1, in_flight_microbatches(cand.schedule, p, m, v, s.index)) for s in mine]
            acts = rank_peak_activations(cand.schedule, p, m, v, r, per_mb)
        else:
            acts = sum(s.activations for s in mine)
        per_rank[r] = rank_peak_bytes(states, acts, options)
    return per_rank


# ------------------------------------------------------------------------------------ iteration time


def pipeline_time_linear(
    cand: Candidate, stage_fwd: list[float], stage_total: list[float], stage_p2p: list[float]
) -> float:
    """The search's linear iteration-time model of the pipeline (`terms.pipeline_time` on the stages' sum
    and maxima; the ILP minimises exactly this). The reported figure comes from the discrete-event
    simulator instead."""
    rank_total = [0.0] * cand.pp
    if cand.virtual_stages > 1:
        for s, t in enumerate(stage_total):
            rank_total[stage_rank(cand.schedule, cand.pp, cand.virtual_stages, s)] += t
    out: float = pipeline_time(
        cand, sum(stage_total), max(stage_total), max(rank_total), max(stage_fwd), sum(stage_p2p)
    )
    return out


def rank_tail_parts(
    mine: list[StageCost], cand: Candidate, options: CostOptions, cluster: ClusterSpec, dtype: str
) -> tuple[float, float]:
    """(exposed data-parallel sync, optimizer step) of one pipeline rank holding the stages `mine`.

    Gradient sync overlaps with the last micro-batch's backward of the rank's first stage (the last
    work it runs) when overlap is on (DDP bucketing / FSDP reduce-scatter during backward).
    """
    if not mine:
        return 0.0, 0.0
    sync = sum(s.dp_sync for s in mine)
    window = sync_overlap_window(min(mine, key=lambda s: s.index).bwd, cand, options)
    return max(0.0, sync - window), optimizer_step_time(sum(s.params_local for s in mine), cand, cluster, dtype)


def rank_tail(
    stages: list[StageCost], cand: Candidate, options: CostOptions, cluster: ClusterSpec, dtype: str
) -> float:
    """max over ranks of (exposed data-parallel sync + optimizer step), paid after the pipeline drains."""
    return max(sum(rank_tail_parts(mine, cand, options, cluster, dtype)) for mine in stages_by_rank(stages, cand.pp))


def stage_time_with_gathers(s: StageCost) -> float:
    """A stage's per-micro-batch time when ZeRO-3 gathers must finish: max(compute, gathers)."""
    return max(s.compute, s.zero3_gather)


def iteration_linear(
    stages: list[StageCost],
    cand: Candidate,
    options: CostOptions,
    cluster: ClusterSpec,
    dtype: str,
    tail: float | None = None,
) -> float:
    """The full linear objective: pipeline (with ZeRO-3 gathers) plus the data-parallel/optimizer tail (`tail`:
    `rank_tail` of these stages, where the caller has it)."""
    totals = [stage_time_with_gathers(s) for s in stages]
    pipe = pipeline_time_linear(cand, [s.fwd for s in stages], totals, [s.p2p for s in stages[:-1]])
    return pipe + (rank_tail(stages, cand, options, cluster, dtype) if tail is None else tail)
