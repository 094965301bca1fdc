"""The cost model's terms, each written once.

Every term is an affine function of its first argument (bytes, parameters or seconds), built from +, -
and * or / by constants only, so one function evaluates on floats (`planner.cost.model`), on numpy arrays
(`planner.search.bounds`) and on `pulp.LpAffineExpression`s (the ILP, `planner.search.ilp`). The ILP
adds only its linearisation of the maxima (epigraph variables); `tests/test_cost_terms.py` evaluates
each term both ways. Guards such as "no bytes, no latency" apply to plain numbers only
(`is_nonpositive`); an expression always pays the constant part, as the ILP always has.

Sources: ring collectives and p2p in `planner.cost.collectives`; ZeRO (Rajbhandari et al. 2020, sec. 7);
pipeline fill/drain (Narayanan et al., SC21; Tarnawski et al. 2020); memory in `planner.cost.memory`.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from planner.cost import collectives as coll
from planner.cost.candidate import Candidate, CostOptions
from planner.cost.memory import StateBytes, model_state_bytes_per_param
from planner.hardware.spec import ClusterSpec

# float, numpy array or pulp.LpAffineExpression (pulp has no type information)
Affine: TypeAlias = Any

# Bytes an Adam step reads and writes per parameter: fp32 master weights, gradients and two moments
# read and written, plus the bf16 copy written (~30); in fp32 training 16 read + 16 written.
def optimizer_step_bytes_per_param(dtype: str) -> float:
    return 32.0 if dtype == "fp32" else 30.0


# Bytes per parameter of the weights ZeRO-1/2/3 all-gather (the training dtype) and of the gradients
# reduced (fp32).
GRAD_BYTES_PER_PARAM = 4.0


def weight_bytes_per_param(dtype: str) -> float:
    return 4.0 if dtype == "fp32" else 2.0


# ---------------------------------------------------------------------------------------------- links


def crosses_nodes(cand: Candidate, cluster: ClusterSpec) -> tuple[bool, bool]:
    """(dp groups cross nodes, some pair of consecutive pp ranks sits on different nodes) for mesh (pp, dp, tp),
    or (pp, dp, cp, tp) with context parallelism.

    pp rank r holds global ranks [r*dp*cp*tp, (r+1)*dp*cp*tp): when dp*cp*tp is smaller than a node, several pp
    ranks share one and the hop out of the node's last one crosses to the next node as soon as the pipeline spans
    more than one node (dp*cp*tp*pp > gpus per node). Every micro-batch passes every hop, so that slowest hop
    is the pipeline's link. The gradient sync runs over the dp x cp ranks of a pp rank (`Candidate.dp_shard`).
    """
    g = cluster.gpus_per_node
    span = cand.dp * cand.cp * cand.tp
    return span > g, cand.pp > 1 and span * cand.pp > g


def _link(cluster: ClusterSpec, inter_node: bool) -> tuple[float, float]:
    topo = cluster.topology
    eff = cluster.gpu.efficiency.network
    if inter_node:
        return topo.inter_node_bandwidth * eff, topo.inter_node_latency
    return topo.intra_node_bandwidth * eff, topo.intra_node_latency


def ep_crosses_nodes(cand: Candidate, cluster: ClusterSpec) -> bool:
    """Whether an expert-parallel group spans nodes: it is ep consecutive dp ranks of the (pp, dp, tp) mesh,
    so ep * tp consecutive global ranks, inside a node while that is at most the GPUs per node."""
    return cand.ep * cand.tp > cluster.gpus_per_node


def ep_link(cand: Candidate, cluster: ClusterSpec) -> tuple[float, float]:
    """(bandwidth, latency) of the expert-parallel group's all-to-all."""
    return _link(cluster, ep_crosses_nodes(cand, cluster))


def cp_link(cand: Candidate, cluster: ClusterSpec) -> tuple[float, float]:
    """(bandwidth, latency) of the context-parallel group: cp ranks of stride tp in the (pp, dp, cp, tp) mesh,
    so cp * tp consecutive global ranks, inside a node while that is at most the GPUs per node."""
    return _link(cluster, cand.cp * cand.tp > cluster.gpus_per_node)


def p2p_link(cand: Candidate, cluster: ClusterSpec) -> tuple[float, float]:
    """(bandwidth, latency) of the link between consecutive pipeline ranks."""
    return _link(cluster, crosses_nodes(cand, cluster)[1])


def dp_link(cand: Candidate, cluster: ClusterSpec) -> tuple[float, float]:
    """(bandwidth, latency) of the data-parallel group's ring.

    A group that spans nodes holds k = gpus per node / tp of its ranks on each node, each with its own NIC
    (one rail per GPU). NCCL runs one ring per channel and sends each channel's node-crossing hop through a
    different NIC, so the k rails carry the ring in parallel and its bus bandwidth is k times one NIC's, up
    to the NVLink bandwidth inside the node (NCCL's rail-local rings; nccl-tests' multi-node all-reduce bus
    bandwidth on DGX A100, about 8 x 25 GB/s x 0.9, is the known case). With tp = gpus per node (k = 1) it
    is one NIC's, as before.
    """
    inter = crosses_nodes(cand, cluster)[0]
    bw, lat = _link(cluster, inter)
    g = cluster.gpus_per_node
    if inter and cand.tp <= g and g % cand.tp == 0:
        rails = g // cand.tp
        bw = min(cluster.topology.intra_node_bandwidth * cluster.gpu.efficiency.network, rails * bw)
    return bw, lat


# ----------------------------------------------------------------------------------------- time terms


def p2p_time(boundary_bytes: Affine, cand: Candidate, cluster: ClusterSpec) -> Affine:
    """One activation (or gradient) send between consecutive stages, per micro-batch.

    With sequence parallelism the boundary tensor is already split across the TP group, so each rank
    sends 1/t of it (Narayanan et al. 2021, scatter/gather optimisation).
    """
    bw, lat = p2p_link(cand, cluster)
    nbytes = boundary_bytes * cand.micro_batch_size / (cand.tp if cand.sequence_parallel else 1)
    if cand.cp > 1:  # each cp rank sends its share of the sequence to the same cp rank of the next stage
        nbytes = nbytes / cand.cp
    return coll.p2p_time(nbytes, bw, lat)


def cp_kv_exchange_time(kv_bytes: Affine, cand: Candidate, cluster: ClusterSpec) -> Affine:
    """Context parallelism's key/value exchange of a unit per micro-batch, forward or backward (each pays it
    once); 0 without context parallelism.

    `kv_bytes` (per sample) are the keys and values the unit's scaled_dot_product_attention calls read over
    the whole sequence (`Unit.sdpa_kv_bytes`), their heads split by tp. Each cp rank holds 1/cp of them and
    all-gathers the rest before its attention (torch's context parallelism with
    `set_rotate_method("allgather")`, torchtitan's default; Llama 3, Dubey et al. 2024, sec. 3.3.2: "all-gather
    based context parallelism"): (cp-1)/cp of the bytes per rank, a ring all-gather; backward reduce-scatters
    the keys' and values' gradients, the same volume. torch's all-gather variant does not overlap it with the
    attention, so it is charged in full (the ring variant, `set_rotate_method("alltoall")`, would hide each
    step behind one chunk's attention: Liu et al. 2023, Ring Attention).
    """
    if cand.cp <= 1:
        return 0.0
    bw, lat = cp_link(cand, cluster)
    return coll.allgather_time(kv_bytes * cand.micro_batch_size / cand.tp, cand.cp, bw, lat)


def alltoall_time(nbytes: Affine, n: int, bw: float, lat: float) -> Affine:
    """All-to-all of `nbytes` per rank over n ranks, pairwise exchange: each rank keeps 1/n and sends the
    other (n-1)/n, one peer per step: (n-1)/n * bytes / bw + (n-1) * latency (Thakur et al. 2005, sec. 4.5)."""
    if n <= 1:
        return 0.0
    return nbytes * ((n - 1) / n) / bw + (n - 1) * lat


def moe_alltoall_time(dispatch_bytes: Affine, cand: Candidate, cluster: ClusterSpec) -> Affine:
    """Expert-parallel token exchange of a unit per micro-batch, forward or backward (each pays it once).

    `dispatch_bytes` (per sample, summed over the unit's MoE layers) is top_k x hidden per token: forward
    sends each routed token to its expert's rank and the expert output back (dispatch + combine, two
    all-to-alls over the ep group); backward sends their gradients the opposite way (two more). Routing is
    taken as balanced (each rank receives what it sends on average); no token is dropped (GShard,
    Lepikhin et al. 2020; Megatron-LM's alltoall token dispatcher). 0 without expert parallelism.
    """
    if cand.ep <= 1:
        return 0.0
    bw, lat = ep_link(cand, cluster)
    return 2.0 * alltoall_time(dispatch_bytes * cand.micro_batch_size, cand.ep, bw, lat)


def expert_state_params(expert_params: Affine, cand: Candidate, dtype: str) -> Affine:
    """The dense-equivalent parameter count of a unit's experts on one rank for the states and the optimizer
    step (`model_state_bytes`, `optimizer_step_time`), which take one parameter count sharded over dp.

    Each rank holds 1/ep of the experts; their gradients and ZeRO shards live on the r = dp/ep replicas of
    that expert shard, so under ZeRO they are sharded over r ranks, not dp. The count returned makes
    `model_state_bytes` exact: (expert / ep) * bytes-per-param over r, divided by the bytes per param
    over dp. (The gradient sync and ZeRO-3 gathers run over r ranks: `expert_sync_params`.)
    """
    if cand.ep <= 1:
        return expert_params
    over_dp = model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp).total
    over_rep = model_state_bytes_per_param(dtype, cand.zero_stage, cand.dp // cand.ep).total
    return expert_params / cand.ep * (over_rep / over_dp)


def frozen_state_params(frozen_params: Affine, state: StateBytes) -> Affine:
    """The trainable-equivalent count of `frozen_params` parameters (requires_grad=False) for
    `model_state_bytes`: they keep their weights but no gradient (autograd makes none, FSDP2 and DDP allocate
    none) and no optimizer state (torch's AdamW creates state only for parameters that have a gradient), so
    each costs weights / (weights + gradients + optimizer) of a trainable one (Hu et al. 2021, LoRA sec. 4:
    optimizer state only for the adapters)."""
    return frozen_params * (state.weights / state.total)


def expert_sync_params(expert_params: Affine, cand: Candidate) -> Affine:
    """The dense-equivalent parameter count of a unit's experts on one rank for the data-parallel ring terms
    (`dp_sync_time`, `zero3_gather_time`), which move (n-1)/n of a stage's bytes over the n = dp ranks.

    The experts' gradients reduce (and their ZeRO shards gather) over the r = dp/ep ranks holding the same
    experts only, each holding expert / ep of them: (r-1)/r * expert/ep bytes-per-param, the same for the
    all-reduce (ZeRO-0), reduce-scatter + all-gather (ZeRO-1/2) and ZeRO-3's gathers. As a count that the
    dp ring's factor (dp-1)/dp multiplies: expert/ep * ((r-1)/r) / ((dp-1)/dp); 0 when r = 1 (no replica).
    The ring's latency is the stage's dense ring's, paid once (Rajbhandari et al. 2020; torchtitan's expert
    FSDP over the dp/ep mesh dimension).
    """
    if cand.ep <= 1 or cand.dp <= 1:
        return expert_params
    r = cand.dp // cand.ep
    return expert_params / cand.ep * (((r - 1) / r) / ((cand.dp - 1) / cand.dp))


def dp_sync_time(params: Affine, cand: Candidate, cluster: ClusterSpec, dtype: str) -> Affine:
    """Per-iteration gradient sync of a stage holding `params` (tensor-parallel-local) parameters (its
    experts counted by `expert_sync_params`).

    ZeRO-0 all-reduces fp32 gradients once per iteration; ZeRO-1 reduce-scatters them and all-gathers
    the updated weights (same volume); ZeRO-2 keeps only a gradient shard, so with m micro-batches it
    reduce-scatters after each of them; ZeRO-3 reduce-scatters once (its gathers: `zero3_gather_time`).
    """
    if cand.dp_shard <= 1:
        return 0.0
    bw, lat = dp_link(cand, cluster)
    grad_b = GRAD_BYTES_PER_PARAM * params
    w_b = weight_bytes_per_param(dtype) * params
    if cand.zero_stage == 0:
        return coll.allreduce_time(grad_b, cand.dp_shard, bw, lat)
    sync = coll.reduce_scatter_time(grad_b, cand.dp_shard, bw, lat)
    if cand.zero_stage == 1:
        return sync + coll.allgather_time(w_b, cand.dp_shard, bw, lat)
    if cand.zero_stage == 2:
        return cand.num_micro_batches * sync + coll.allgather_time(w_b, cand.dp_shard, bw, lat)
    return sync


def zero3_gather_time(params: Affine, cand: Candidate, cluster: ClusterSpec, dtype: str) -> Affine:
    """Per-micro-batch ZeRO-3 (FSDP) weight gathers of a stage: all-gather for forward and again for
    backward (Rajbhandari et al. 2020, sec. 7); 0 without ZeRO-3 over more than one replica. `params` counts
    the experts by `expert_sync_params`."""
    if cand.dp_shard <= 1 or cand.zero_stage != 3:
        return 0.0
    bw, lat = dp_link(cand, cluster)
    return 2.0 * coll.allgather_time(weight_bytes_per_param(dtype) * params, cand.dp_shard, bw, lat)


def zero3_unit_exposed_time(
    sync_params: float, held_params: float, compute: float, cand: Candidate, cluster: ClusterSpec, dtype: str
) -> float:
    """What one unit's ZeRO-3 (FSDP2) weight gather adds to its forward or backward of `compute` seconds.

    FSDP2 prefetches one unit ahead on its own stream (Zhao et al. 2023, sec. 3.3; torch's fully_shard
    implicit prefetching), so a unit's all-gather hides behind the unit before it: what is left is the gather's
    excess over that compute (identical blocks: the unit's own), max(0, gather - compute). Its copy-out (the
    all-gather buffer split into the unsharded parameters) runs on the compute stream: one read and one write
    of the unit's `held_params` weights, memory-bound. 0 without ZeRO-3 over more than one replica. Not affine
    (a maximum): it enters the unit costs, which every evaluation takes as given.
    """
    if cand.dp <= 1 or cand.zero_stage != 3:
        return 0.0
    gather = 0.5 * float(zero3_gather_time(sync_params, cand, cluster, dtype))  # one of the forward / backward pair
    copy_out = 2.0 * weight_bytes_per_param(dtype) * held_params / (
        cluster.gpu.memory_bandwidth * cluster.gpu.efficiency.memory
    )
    return max(0.0, gather - compute) + copy_out


def optimizer_step_time(params: Affine, cand: Candidate, cluster: ClusterSpec, dtype: str) -> Affine:
    """Adam step of `params` local parameters: a memory-bound pass over master weights, gradients and
    moments (`optimizer_step_bytes_per_param`), sharded across dp from ZeRO-1 on."""
    n = params / (cand.dp_shard if cand.zero_stage >= 1 else 1)
    return n * optimizer_step_bytes_per_param(dtype) / (cluster.gpu.memory_bandwidth * cluster.gpu.efficiency.memory)


def sync_overlap_window(first_stage_bwd: Affine, cand: Candidate, options: CostOptions) -> Affine:
    """How much of a rank's gradient sync hides behind compute: the backward of its first stage (the
    last work it runs, DDP bucketing / FSDP reduce-scatter during backward); under ZeRO-2 each
    micro-batch's reduce-scatter hides behind its own backward. With `overlap_param_gather` (Megatron-LM's
    --overlap-param-gather) ZeRO-1/2's all-gather of the updated weights also hides behind the next
    iteration's first forward; the window is shared by the two collectives (their sum is what it hides)."""
    window = first_stage_bwd if options.overlap_dp_comm else 0.0
    if cand.zero_stage == 2:
        window = window * cand.num_micro_batches  # not *=: it would scale the caller's array in place
    if options.overlap_param_gather and cand.zero_stage in (1, 2) and cand.dp_shard > 1:
        # the weights' all-gather hides behind the next iteration's first forward of the stage, at least a
        # third of its backward (a backward is two forwards, three with full recomputation)
        window = window + first_stage_bwd / 3.0
    return window


def pipeline_time(
    cand: Candidate, stage_sum: Affine, stage_max: Affine, rank_max: Affine, fwd_max: Affine, p2p_sum: Affine
) -> Affine:
    """The search's linear iteration-time model of the pipeline, from the sum and the maxima of the stage
    times (the ILP passes its epigraph variables for the maxima).

    GPipe/1F1B with uneven stages: sum_s t_s + (m-1) max_s t_s (the fill-drain bound used by Alpa and
    Tarnawski et al. 2020), which equals (m + p - 1) t for uniform stages (Narayanan et al., SC21).
    Interleaved 1F1B: m max_r T_r + (p-1) max_s t_s, equal to (m + (p-1)/v) T for uniform stages.
    Zero-bubble (ZBV): m max_r T_r + (p-1) max_s f_s, equal to the ZBV closed form m T + (p-1) t_f/2 for
    uniform stages with equal F, B, W. Plus one forward and one backward p2p per stage boundary (fill
    and drain).
    """
    comm = 2.0 * p2p_sum
    if cand.schedule in ("gpipe", "1f1b"):
        return stage_sum + (cand.num_micro_batches - 1) * stage_max + comm
    if cand.schedule == "interleaved-1f1b":
        return cand.num_micro_batches * rank_max + (cand.pp - 1) * stage_max + comm
    return cand.num_micro_batches * rank_max + (cand.pp - 1) * fwd_max + comm


# --------------------------------------------------------------------------------------- memory terms


def model_state_bytes(params: Affine, state: StateBytes) -> Affine:
    """Weights, gradients and optimizer states of `params` local parameters (`memory.StateBytes`)."""
    return params * (state.weights + state.gradients + state.optimizer)


def comm_buffer_bytes(
    boundary_bytes: Affine, cand: Candidate, options: CostOptions, largest_param_bytes: float
) -> Affine:
    """A stage's communication buffers: send and receive buffers of its outgoing boundary (activation
    and gradient); two DDP buckets in flight under ZeRO-0; under ZeRO-3 two unsharded units in flight
    (FSDP prefetch), bounded with the model's largest unit."""
    buffers = 2.0 * boundary_bytes * cand.micro_batch_size * 2 / cand.cp
    if cand.dp_shard > 1 and cand.zero_stage == 0:
        buffers += 2 * options.ddp_bucket_bytes
    if cand.zero_stage == 3:
        buffers += 2 * largest_param_bytes
    return buffers


def group_sizes(dp: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> dict[str, int]:
    """The process groups of more than one rank that a rank of these degrees communicates in, with their
    sizes: data (dp), tensor (tp) and pipeline (pp) parallel, and under expert parallelism the all-to-all
    group (ep) and the experts' replicas (dp/ep), which sync the experts' gradients
    (`planner.runtime.loop`: init_device_mesh over (pp, dp, tp), and (pp, dp/ep, ep, tp) with experts); with
    context parallelism the cp group (the K/V all-gathers) and the dp x cp group the gradients sync over."""
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    if ep > 1:
        sizes |= {"ep": ep, "expert dp": dp // ep}
    if cp > 1:
        sizes |= {"cp": cp, "dp x cp": dp * cp}
    return {name: n for name, n in sizes.items() if n > 1}


def comm_reserve_bytes(per_group_bytes: Affine, cand: Candidate) -> Affine:
    """NCCL's own buffers, which the cost model's peak does not count: `per_group_bytes` (the spec's
    memory_reserve.nccl_gib_per_group, NCCL_BUFFSIZE per peer and channel) for each process group of more
    than one rank the candidate communicates in (`group_sizes`); a group of one rank moves nothing."""
    return per_group_bytes * len(group_sizes(cand.dp, cand.tp, cand.pp, cand.ep, cand.cp))


def rank_capacity(cluster: ClusterSpec, cand: Candidate) -> float:
    """The bytes a rank's peak (`rank_peak_bytes`) may reach: the GPU's capacity (already less the fixed
    reserve, `ClusterSpec.within_reserve`) less the candidate's NCCL buffers (`comm_reserve_bytes`)."""
    out: float = cluster.gpu.memory_bytes - comm_reserve_bytes(cluster.nccl_bytes_per_group, cand)
    return out


def rank_peak_bytes(states: Affine, activations: Affine, options: CostOptions) -> Affine:
    """Peak bytes of a pipeline rank: its states and activations plus fragmentation, plus the workspace."""
    return (states + activations) * (1 + options.fragmentation) + options.workspace_bytes


def memory_budget(capacity: float, options: CostOptions) -> float:
    """The states + activations a rank may hold: `rank_peak_bytes` <= capacity solved for them."""
    return (capacity - options.workspace_bytes) / (1 + options.fragmentation)


class Linear:
    """c * x + k in one symbol x: what a term returns when evaluated on `Linear.symbol()`, so that the
    bounds can read a term's coefficients without building a pulp expression per candidate."""

    __slots__ = ("coef", "const")

    def __init__(self, coef: float, const: float) -> None:
        self.coef, self.const = coef, const

    @classmethod
    def symbol(cls) -> Linear:
        return cls(1.0, 0.0)

    def __add__(self, other: Linear | float) -> Linear:
        if isinstance(other, Linear):
            return Linear(self.coef + other.coef, self.const + other.const)
        return Linear(self.coef, self.const + other)

    __radd__ = __add__

    def __sub__(self, other: Linear | float) -> Linear:
        return self + other * -1.0

    def __rsub__(self, other: float) -> Linear:
        return self * -1.0 + other

    def __mul__(self, k: float) -> Linear:
        return Linear(self.coef * k, self.const * k)

    __rmul__ = __mul__

    def __truediv__(self, k: float) -> Linear:
        return Linear(self.coef / k, self.const / k)


def linear_form(term: Any) -> tuple[float, float]:
    """(coefficient, constant) of an affine term of one argument."""
    e = term(Linear.symbol())
    if isinstance(e, Linear):
        return e.coef, e.const
    return 0.0, float(e)
