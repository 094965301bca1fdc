"""The outer search space: degrees, micro-batching, schedule, ZeRO stage, sequence parallelism.

Every candidate that breaks a hard rule is rejected with a reason (tp exceeds a node, batch not
divisible, more stages than units, a schedule torch refuses); the rest are ranked by a valid lower bound
on their iteration time so that the ILP runs only on candidates that could still win.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from math import gcd

from planner.cost.model import Candidate
from planner.cost.placement import schedule_violation
from planner.errors import ConfigError, InfeasibleError
from planner.hardware.spec import ClusterSpec
from planner.model.graph import ModelGraph
from planner.names import SCHEDULES
from planner.runtime.layout import runs_traced_graph, sizes_in_code

SCHEDULE_NAMES = SCHEDULES  # kept for callers of this module; defined in planner.names


# Stages per rank the free search tries on models without repeated blocks (any count may be pinned).
SEARCHED_VIRTUAL_STAGES = 8


def max_virtual_stages(pp: int, n_units: int) -> int:
    """The most stages per rank an interleaved schedule may take: every one of the pp x v stages holds at
    least one unit. torch's ScheduleInterleaved1F1B takes any count, and so does a pin (--virtual-stages).
    Stages need not hold equal numbers of blocks: torch's schedules run any split, and uneven ones are what
    an embedding and a head on the first and last stages call for (Llama 3 405B: 126 layers on 16 ranks)."""
    return n_units // pp


def searched_virtual_stages(pp: int, n_units: int, blocks: int) -> list[int]:
    """The v values the free search enumerates, up to `max_virtual_stages` (12 in Megatron-LM's tuned GPT-3
    175B recipe: 96 layers on 8 ranks): those where pp x v chunks split the blocks evenly with the embedding
    and the head each counted as a block or not (Megatron-LM's --account-for-embedding-in-pipeline-split and
    --account-for-loss-in-pipeline-split: Llama 3 405B's 126 layers + 2 on 8 x 2 stages). The partition
    within a candidate stays free. Other values are planned when pinned: each adds a full set of candidates
    whose bounds sit close together, and searching every v took a 1T model on 3072 GPUs from 2.7 to 39 s
    without changing its plan. Without repeated blocks: 2 .. 8."""
    top = max_virtual_stages(pp, n_units)
    if not blocks:
        return list(range(2, min(SEARCHED_VIRTUAL_STAGES, top) + 1))
    return [v for v in range(2, top + 1) if any((blocks + extra) % (pp * v) == 0 for extra in (0, 1, 2))]


@dataclass(frozen=True)
class Pins:
    """Dimensions the user fixed on the command line (None = search it)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    virtual_stages: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    zero_stage: int | None = None
    sequence_parallel: bool | None = None
    recompute: str | None = None
    ep: int | None = None
    cp: int | None = None
    tp_overlap: bool | None = None  # torch's async TP (`async_tp_refusal`)
    # Megatron-LM's block recomputation: the first N blocks of every stage recomputed fully (`search.blocks`)
    recompute_blocks: int | None = None


@dataclass
class Space:
    candidates: list[Candidate]
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)  # (region, reason) -> count


# Bounds on the search's inputs: far above any real job, low enough that every loop below stays small.
MAX_GLOBAL_BATCH = 10**15
MAX_WORLD_SIZE = 2**20  # GPUs in the cluster (a million: beyond today's largest jobs by ~10x)
MAX_CANDIDATES = 200_000  # outer-search candidates; each costs a bound and maybe an ILP
# Micro-batches per replica: the schedule simulation and the generated script step through each one, so
# m is bounded (Megatron-LM's largest published runs use a few hundred).
MAX_MICRO_BATCHES = 4096


_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller-Rabin below 3.3 * 10**24


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first twelve prime bases: exact for every n < 3.3 * 10**24."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_rho(n: int) -> int:
    """A non-trivial factor of the odd composite n (Pollard's rho, Floyd cycle; fixed seeds: deterministic)."""
    for c in range(1, n):
        x = y = 2
        d = 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = gcd(abs(x - y), n)
        if d != n:
            return d
    raise ArithmeticError(f"no factor found for {n}")  # unreachable for a composite n


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of n >= 1: small primes by trial division, the rest by Pollard's rho."""
    if n < 1:
        raise ValueError(f"prime_factors needs n >= 1, got {n}")
    out: dict[int, int] = {}
    for p in range(2, 1000):
        if p * p > n:  # what is left is 1 or a prime
            break
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            out[m] = out.get(m, 0) + 1
        else:
            f = _pollard_rho(m)
            stack += [f, m // f]
    return dict(sorted(out.items()))


def divisors(n: int) -> list[int]:
    """All divisors of n in increasing order, built from its prime factorisation (not by scanning 1..n)."""
    return list(_divisors(n))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """`divisors` (the search asks for the same few numbers' divisors thousands of times)."""
    divs = [1]
    for p, e in prime_factors(n).items():
        divs = [d * p**k for d in divs for k in range(e + 1)]
    return tuple(sorted(divs))


def check_bounds(world: int, global_batch: int) -> None:
    """Refuse inputs that would make the search space unreasonably large, with the bound and the fix."""
    if global_batch > MAX_GLOBAL_BATCH:
        raise ConfigError(
            f"--global-batch-size {global_batch} is above the planner's limit of {MAX_GLOBAL_BATCH:.0e} samples "
            "per step (no training job comes near it). Pass the samples per optimizer step over all replicas."
        )
    if world > MAX_WORLD_SIZE:
        raise ConfigError(
            f"The cluster has {world} GPUs, above the planner's limit of {MAX_WORLD_SIZE}. Check --nodes and "
            "--gpus-per-node."
        )


def tp_limit(graph: ModelGraph) -> int:
    """Largest tensor-parallel degree every sharded unit supports (gcd of their shardable sizes)."""
    g = 0
    for u in graph.units:
        if u.tp_granularity:
            g = gcd(g, u.tp_granularity)
    return g or 1


def enumerate_space(graph: ModelGraph, cluster: ClusterSpec, global_batch: int, pins: Pins) -> Space:
    """All candidates consistent with the cluster, the batch and the pins; rejections counted by reason."""
    world = cluster.world_size
    gpn = cluster.gpus_per_node
    check_bounds(world, global_batch)
    n_units = len(graph.units)
    space = Space(candidates=[])
    rej = space.rejected
    if pins.schedule is not None and pins.schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"Unknown schedule {pins.schedule!r}; use one of {', '.join(SCHEDULE_NAMES)}.")
    for name, val in (("tp", pins.tp), ("pp", pins.pp), ("dp", pins.dp), ("cp", pins.cp)):
        if val is not None and (val < 1 or world % val):
            raise ConfigError(
                f"--{name} {val} does not divide the {world} GPUs ({cluster.nodes} nodes x {gpn}). "
                f"Pick a divisor of {world}: {', '.join(map(str, divisors(world)[:12]))}..."
            )
    pinned = [v for v in (pins.tp, pins.pp, pins.dp) if v is not None]
    prod = 1
    for v in pinned:
        prod *= v
    if len(pinned) == 3 and prod * (pins.cp or 1) != world:
        cp_text = f" x --cp {pins.cp}" if pins.cp is not None else ""
        raise ConfigError(
            f"--dp {pins.dp} x --tp {pins.tp} x --pp {pins.pp}{cp_text} = {prod * (pins.cp or 1)}, but the cluster has "
            f"{world} GPUs. Make the product equal the GPU count or leave one degree free."
        )
    check_ep_pin(graph, pins)
    max_tp = tp_limit(graph)
    traced_tp_refusal = runtime_traced_tp_refusal(graph)
    head_counts = any(sizes_in_code(u.tp_head_attrs, u.tp_fused) for u in graph.units)
    meta_traced = graph.trace_method == "fx-meta"
    has_tp = any(u.tp_pairs for u in graph.units)
    blocks = sum(1 for u in graph.units if u.kind == "block")
    for tp in divisors(world):
        if pins.tp is not None and tp != pins.tp:
            continue
        if tp > gpn:
            rej[(f"tp={tp}", f"tensor parallelism must stay inside a node ({gpn} GPUs per node)")] += 1
            continue
        if tp > 1 and not has_tp:
            first = next((r for u in graph.units for r in u.tp_refused), "")
            pair_note = (f" (first refused: {first})" if first else
                   " (a pair is a Linear whose output reaches another Linear through elementwise operations only,"
                   " split by columns then by rows; here every Linear feeds a norm, a reduction, a recurrence or"
                   " the output instead); leave --tp unpinned or set --tp 1")
            rej[(f"tp={tp}", "the model has no Linear pairs that tensor parallelism can shard" + pair_note)] += 1
            continue
        if tp > 1 and max_tp % tp:
            rej[(f"tp={tp}", f"the model's heads/hidden sizes split only into divisors of {max_tp}")] += 1
            continue
        for pp, cp in ((p, c) for p in divisors(world // tp) for c in divisors(world // (tp * p))):
            if pins.pp is not None and pp != pins.pp:
                continue
            if not context_parallel_searched(graph, cp, tp, pp, pins, rej):
                continue
            dp = world // (tp * pp * cp)
            if pins.dp is not None and dp != pins.dp:
                continue
            if pp > n_units:
                rej[(f"pp={pp}", f"more pipeline stages than the model's {n_units} units")] += 1
                continue
            if global_batch % dp:
                rej[(f"dp={dp}", f"global batch {global_batch} is not divisible by dp={dp}")] += 1
                continue
            per_replica = global_batch // dp
            for mbs in divisors(per_replica):
                if pins.micro_batch_size is not None and mbs != pins.micro_batch_size:
                    continue
                if mbs < graph.min_micro_batch:
                    rej[(f"mbs={mbs}", MIN_MICRO_BATCH_REFUSAL.format(least=graph.min_micro_batch))] += 1
                    continue
                m = per_replica // mbs
                if m > MAX_MICRO_BATCHES:
                    rej[
                        (
                            f"dp={dp} mbs<={per_replica // MAX_MICRO_BATCHES}",
                            f"more than {MAX_MICRO_BATCHES} micro-batches per replica (the schedule steps through "
                            "each one); a larger micro-batch size is needed",
                        )
                    ] += 1
                    continue
                for schedule in SCHEDULE_NAMES:
                    if pins.schedule is not None and schedule != pins.schedule:
                        continue
                    if pp == 1 and schedule != "1f1b":
                        continue  # one stage: plain gradient accumulation, schedule is moot
                    if schedule == "gpipe" and pins.schedule is None and m >= pp:
                        rej[
                            (
                                f"gpipe pp={pp}",
                                "dominated by 1F1B: the same iteration time, and each stage "
                                "holds at most p - s micro-batches of activations instead of all m",
                            )
                        ] += 1
                        continue
                    if schedule in ("gpipe", "1f1b"):
                        vs = [1]
                    elif schedule == "zero-bubble":
                        vs = [2]
                    elif pins.virtual_stages is not None:
                        vs = [pins.virtual_stages]  # checked below, so that a pin too large is rejected with why
                    else:
                        vs = searched_virtual_stages(pp, n_units, blocks)
                    for v in vs:
                        if pins.virtual_stages is not None and v != pins.virtual_stages:
                            continue
                        if pp * v > n_units:
                            rej[(f"pp={pp} v={v}", f"more stages than the model's {n_units} units")] += 1
                            continue
                        why = schedule_violation(schedule, pp, m, v)
                        if why:
                            rej[(f"{schedule} pp={pp} m={m}", why)] += 1
                            continue
                        if cp > 1 and pp > 1 and schedule == "zero-bubble":
                            rej[(f"cp={cp} zero-bubble", CP_ZB_REFUSAL)] += 1
                            continue
                        for zero in range(4) if dp * cp > 1 else [0]:
                            if pins.zero_stage is not None and zero != pins.zero_stage:
                                continue
                            if pins.zero_stage is None and zero == 0 and dp * cp > 1:
                                rej[
                                    (
                                        f"dp={dp} zero=0",
                                        "dominated by ZeRO-1: same compute, less memory, "
                                        "reduce-scatter + all-gather move less than an fp32 all-reduce",
                                    )
                                ] += 1
                                continue
                            if schedule == "zero-bubble" and zero == 3:
                                rej[
                                    (
                                        "zero-bubble zero=3",
                                        "torch's split backward (ZBV) computes weight gradients "
                                        "after FSDP's post-backward: ZeRO-3 cannot reshard; use ZeRO-1/2",
                                    )
                                ] += 1
                                continue
                            no_sp = sequence_refusal(graph, tp)
                            cp_no_sp = context_sequence_refusal(graph, cp, tp)
                            for sp in (False, True) if tp > 1 else (False,):
                                if pins.sequence_parallel is not None and sp != pins.sequence_parallel:
                                    continue
                                if sp and no_sp:
                                    rej[(f"tp={tp} with sp", no_sp)] += 1
                                    continue
                                if sp and cp_no_sp:
                                    rej[(f"cp={cp} x tp={tp} with sp", cp_no_sp)] += 1
                                    continue
                                # The generated script must be able to run what is costed (issue 10): refuse
                                # what its tensor parallelism cannot shard in a traced stage, with the reason.
                                if tp > 1 and runs_traced_graph(pp, tp, sp, head_counts) and traced_tp_refusal:
                                    where = "pp" if pp > 1 else "sp" if sp else "head counts read in forward"
                                    rej[(f"tp={tp} with {where}", traced_tp_refusal)] += 1
                                    continue
                                if sp and meta_traced and pins.sequence_parallel is None:
                                    rej[(f"tp={tp} with sp", SP_META_TRACED)] += 1
                                    continue
                                if (
                                    pins.sequence_parallel is None and tp > 1 and not sp and not traced_tp_refusal
                                    and not meta_traced and not no_sp and not cp_no_sp
                                ):
                                    rej[
                                        (
                                            f"tp={tp} without sp",
                                            "dominated by sequence parallelism: same "
                                            "communication volume, activations and norms split by tp",
                                        )
                                    ] += 1
                                    continue
                                overlaps = tp_overlaps(cluster, tp, sp, pins, rej, cp)
                                eps = ep_degrees(graph, dp, tp, pp, sp, pins, rej, schedule, cp) if overlaps else []
                                for ep in eps:
                                    for ov in overlaps:
                                        space.candidates.append(
                                            Candidate(dp, tp, pp, v, mbs, m, schedule, zero, sp, ep, cp, ov)
                                        )
                                if len(space.candidates) > MAX_CANDIDATES:
                                    raise ConfigError(
                                        f"The search space holds more than {MAX_CANDIDATES} candidates (global "
                                        f"batch {global_batch} has {len(divisors(global_batch))} divisors, "
                                        f"{world} GPUs). Pin some dimensions (--micro-batch-size, --pp, --tp, "
                                        "--schedule) to narrow it."
                                    )
    if not space.candidates and not rej:
        # Every candidate was skipped by a pin, none by a rule: say which pins exclude each other.
        given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(pins).items() if v is not None)
        raise InfeasibleError(
            f"The pins {given or '(none)'} leave no configuration on {world} GPUs: they contradict each other "
            "or the model (gpipe and 1f1b take 1 virtual stage, interleaved-1f1b 2 or more, zero-bubble exactly "
            "2; pp x virtual stages must not exceed the model's units; sequence parallelism needs tp > 1; the "
            "micro-batch size must divide the batch per replica). Drop or change one of them."
        )
    return space


ASYNC_TP_DOMINATED = (
    "dominated by torch's async TP: the same all-gathers and reduce-scatters, hidden behind the matmuls they "
    "feed (torch.compile with torch._inductor.config._micro_pipeline_tp); pin --no-async-tp for eager TP"
)


def async_tp_refusal(cluster: ClusterSpec, tp: int, sp: bool, cp: int = 1) -> str | None:
    """Why torch's async TP cannot run here, if it cannot."""
    if cp > 1:
        return CP_ASYNC_TP_REFUSAL
    if tp <= 1:
        return "async TP overlaps tensor-parallel communication: it needs tp > 1"
    if not sp:
        return (
            "torch's async TP decomposes sequence parallelism's all-gather -> matmul and matmul -> reduce-scatter: "
            "it needs sequence parallelism (--sequence-parallel)"
        )
    if cluster.gpu.vendor != "NVIDIA":
        return (
            f"torch's async TP runs on CUDA symmetric memory, which {cluster.gpu.display_name} "
            f"({cluster.gpu.vendor}) does not have"
        )
    return None


def tp_overlaps(
    cluster: ClusterSpec, tp: int, sp: bool, pins: Pins, rej: Counter[tuple[str, str]], cp: int = 1
) -> list[bool]:
    """The async-TP settings searched for (tp, sp, cp): on where it runs (eager TP is dominated: counted), else
    off; a pin keeps its own value, or nothing where async TP is pinned but cannot run (counted with why)."""
    why = async_tp_refusal(cluster, tp, sp, cp)
    if pins.tp_overlap is False:
        return [False]
    if why:
        if pins.tp_overlap:
            rej[(f"tp={tp}{'+sp' if sp else ''} with async TP", why)] += 1
            return []
        return [False]
    if pins.tp_overlap is None:
        rej[(f"tp={tp}+sp without async TP", ASYNC_TP_DOMINATED)] += 1
    return [True]


def ep_granularity(graph: ModelGraph) -> int:
    """gcd of the expert counts of every MoE layer (0: the model has no experts); ep must divide it."""
    g = 0
    for u in graph.units:
        if u.ep_granularity:
            g = gcd(g, u.ep_granularity)
    return g


def sequence_refusal(graph: ModelGraph, tp: int) -> str | None:
    """Why sequence parallelism cannot split this model's sequence over tp ranks; None if it can."""
    seq = graph.sample_input_shapes[0][1] if len(graph.sample_input_shapes[0]) >= 2 else 0
    if not graph.has_sequence or not seq:
        return (
            "the model has no sequence dimension for sequence parallelism to split: no activation is [batch, seq, "
            f"...] with the first input's dimension 1 ({seq or 'none'}) as its seq"
        )
    if seq % tp:
        return f"sequence parallelism splits the sequence ({seq}) over tp={tp} ranks, which must divide it"
    return None


# Why a micro-batch below the model's smallest (ModelGraph.min_micro_batch) is refused.
MIN_MICRO_BATCH_REFUSAL = (
    "the model's batch norm sees one value per channel in a sample and computes its training statistics over the "
    "micro-batch, so it needs at least {least} samples per micro-batch (PyTorch raises 'Expected more than 1 value "
    "per channel when training' otherwise); use --micro-batch-size {least} or more"
)


# Why ep > 1 with tp > 1 is refused, and what running it would take.
EP_TP_REFUSAL = (
    "the generated script shards experts only without tensor parallelism; ep with tp would need either the "
    "experts' FFN weights sharded by tp inside each expert (torchtitan's expert tensor parallelism: a (ep, tp) "
    "mesh, the routed tokens gathered over tp before the all-to-all over ep and reduce-scattered after it) or "
    "the attention over tp and the experts over ep x tp ranks (the all-to-all over that larger group), with "
    "cost terms for either; neither is implemented, so use tp = 1 with ep, or ep = 1 with tp"
)


# Why ep > 1 is refused with the zero-bubble schedule.
EP_ZB_REFUSAL = (
    "zero-bubble splits each backward into an input-gradient and a weight-gradient pass; the experts' "
    "all-to-all (a collective inside autograd) belongs to both, and torch's split backward frees its saved "
    "tensors after the first; use 1f1b or interleaved-1f1b with ep"
)


def ep_degrees(
    graph: ModelGraph, dp: int, tp: int, pp: int, sp: bool, pins: Pins, rej: Counter[tuple[str, str]],
    schedule: str = "1f1b", cp: int = 1,
) -> list[int]:
    """Expert-parallel degrees for one (dp, tp, pp, sp): divisors of dp that divide every MoE layer's
    expert count (each rank of an ep group holds whole experts), where the generated script can run them:
    tp = 1 (with a pipeline, each stage's traced graph keeps its experts as module calls and swaps them for
    its slices; the ep group is ep consecutive ranks of the stage's dp group). Without experts only
    ep = 1; a pin keeps just its value (checked in `check_ep_pin`)."""
    experts = ep_granularity(graph)
    out = []
    for ep in divisors(gcd(dp, experts)) if experts else [1]:
        if pins.ep is not None and ep != pins.ep:
            continue
        if ep > 1 and tp > 1:
            rej[(f"ep={ep} tp={tp}", EP_TP_REFUSAL)] += 1
            continue
        if ep > 1 and pp > 1 and schedule == "zero-bubble":
            rej[(f"ep={ep} zero-bubble", EP_ZB_REFUSAL)] += 1
            continue
        if ep > 1 and cp > 1:
            rej[(f"ep={ep} cp={cp}", EP_CP_REFUSAL)] += 1
            continue
        out.append(ep)
    return out


def check_ep_pin(graph: ModelGraph, pins: Pins) -> None:
    """A pinned --ep the model or the pinned dp cannot take: a ConfigError naming the rule and the fix."""
    if pins.ep is None or pins.ep == 1:
        return
    experts = ep_granularity(graph)
    if not experts:
        raise ConfigError(
            f"--ep {pins.ep} asks for expert parallelism, but the model has no mixture-of-experts layers "
            "(a module holding an `experts` module and a top-k). Drop --ep."
        )
    if experts % pins.ep:
        raise ConfigError(
            f"--ep {pins.ep} does not divide the model's expert count ({experts}, the gcd over its MoE layers): "
            f"each rank must hold whole experts. Pick a divisor of {experts}: "
            f"{', '.join(map(str, divisors(experts)))}."
        )
    if pins.dp is not None and pins.dp % pins.ep:
        raise ConfigError(
            f"--ep {pins.ep} does not divide --dp {pins.dp}: experts are sharded over a sub-group of the "
            "data-parallel ranks. Pick ep dividing dp."
        )


# A graph traced with meta values has the whole sequence's length in its reshapes; the rewrite for sequence
# parallelism follows the ones it can tell apart (parallel.plan_sequence_parallel), and the plan-time check runs
# the result, but the search does not count on it: it tries sequence parallelism there only when asked.
SP_META_TRACED = (
    "only torch.fx with meta values traces the model, which fixes the sequence length in its graph: sequence "
    "parallelism is tried only when pinned (--sequence-parallel)"
)


def runtime_traced_tp_refusal(graph: ModelGraph) -> str | None:
    """Why tensor parallelism cannot run in a traced (pipelined or sequence-parallel) stage; None if it can.

    With pp = 1, no sequence parallelism and no head count read in forward, the script runs the model as
    written and shards its modules; otherwise it runs the traced graph, with the sizes of the sharded dimension
    made each rank's (runtime.tp_graph: head counts, split widths, and every shape of a graph traced with meta
    values) and HF's Conv1D kept as a call. That needs a torch.fx graph: torch.export's fixes every shape of
    every lowered op.
    """
    if graph.trace_method == "export":
        return "only torch.export could trace the model, which fixes every shape in a traced stage's graph"
    return None


# --------------------------------------------------------------------------------------- context parallelism

# The free search tries context parallelism (cp > 1) only on sequences at least this long; shorter ones take
# it when pinned (--cp). Below it the K/V all-gather and GEMMs of s/cp tokens lose to more data parallelism,
# and real runs keep cp for long contexts (Llama 3: cp 2 from 8K tokens, cp 16 at 128K; torchtitan's
# long-context recipes). It also keeps the search of every shorter model exactly as it was.
CP_MIN_SEQ = 8192

# Why cp > 1 is refused under the zero-bubble schedule.
CP_ZB_REFUSAL = (
    "zero-bubble splits each backward into an input-gradient and a weight-gradient pass; the key/value "
    "all-gather of context parallelism (a collective inside autograd) belongs to both, and torch's split backward "
    "frees its saved tensors after the first; use 1f1b or interleaved-1f1b with cp"
)

# Why torch's async TP is refused with cp > 1.
CP_ASYNC_TP_REFUSAL = (
    "async TP compiles each unit (torch.compile), and context parallelism routes the units' attention and "
    "positions through a torch-function mode (runtime.context.ContextParallel) that compiled units have not been "
    "run under; use cp with eager sequence parallelism (--no-async-tp)"
)

# Why ep > 1 is refused with cp > 1.
EP_CP_REFUSAL = (
    "the experts' gradients would sync over the dp/ep x cp ranks holding the same experts (torchtitan's "
    "`dp_shard_mod_ep` with cp), which neither the cost terms nor the generated script model; use ep or cp"
)


def context_refusal(graph: ModelGraph, cp: int, tp: int, pp: int) -> str | None:
    """Why the model's attention cannot run over a sequence sharded across cp ranks; None if it can.

    The generated script shards each sample's tokens (and labels) over the cp ranks in torch's head-tail
    load-balanced order (2 x cp chunks, rank r holding chunks r and 2cp-1-r) and all-gathers keys and values
    inside every scaled_dot_product_attention call (`planner.runtime.context`). That needs: integer tokens
    [batch, seq] as the one input, activations that carry that sequence, every attention through SDPA (a
    hand-written softmax(q k^T) would see only the rank's keys), the sequence divisible by 2 x cp, and shapes
    taken from the tensors at run time where a traced graph runs (pp > 1: a graph traced with meta values or by
    torch.export fixes them).
    """
    shapes = graph.sample_input_shapes
    seq = shapes[0][1] if shapes and len(shapes[0]) == 2 else 0
    if len(shapes) != 1 or not seq or graph.tokens_per_sample is None or not graph.has_sequence:
        return (
            "context parallelism shards a sequence of integer tokens: the model must take one [batch, seq] token "
            f"tensor whose seq its activations carry (it takes {shapes})"
        )
    if not any(u.uses_flash_attention for u in graph.units):
        return (
            "the model's attention does not call torch.nn.functional.scaled_dot_product_attention, where context "
            "parallelism gathers the other ranks' keys and values; a hand-written attention would see only its own"
        )
    masked = next((u.name for u in graph.units if u.sdpa_masked), None)
    if masked:
        return (
            f"{masked} passes an attn_mask to scaled_dot_product_attention: a mask over the whole sequence's pairs, "
            "which context parallelism cannot shard (only is_causal or no mask); build the model's attention with "
            "is_causal=True"
        )
    if seq % (2 * cp):
        return (
            f"the sequence ({seq}) must split into 2 x cp = {2 * cp} equal chunks (torch's load-balanced causal "
            "context parallelism gives each rank one chunk from each end)"
        )
    if pp > 1 and graph.trace_method != "fx":
        return (
            f"a pipeline runs the graph traced by {graph.trace_method}, which fixes the sequence length in its "
            "shapes; each cp rank runs a shorter one"
        )
    return None


def context_sequence_refusal(graph: ModelGraph, cp: int, tp: int) -> str | None:
    """Why sequence parallelism cannot split the cp ranks' share of the sequence over tp ranks; None if it can
    (or cp = 1).

    With both, cp divides first: each cp rank holds seq / cp tokens (chunks r and 2cp-1-r), and sequence
    parallelism splits that local sequence over the tp ranks between the tensor-parallel regions (torchtitan's
    order: the tp plan inside the context_parallel region of the cp mesh dimension). Sequence parallelism runs the
    traced graph, which must take its sequence length from the tensors at run time (a graph traced with meta
    values or by torch.export fixes the whole sequence's), and tp must divide the local length.
    """
    if cp <= 1:
        return None
    if graph.trace_method != "fx":
        return (
            f"sequence parallelism runs the graph traced by {graph.trace_method}, which fixes the whole sequence's "
            "length in its shapes; each cp rank runs 1/cp of it"
        )
    shapes = graph.sample_input_shapes
    seq = shapes[0][1] if shapes and len(shapes[0]) >= 2 else 0
    if seq and (seq // cp) % tp:
        return (
            f"sequence parallelism splits each cp rank's {seq // cp} tokens ({seq} over cp={cp}) over tp={tp} ranks, "
            "which must divide them"
        )
    return None


def context_parallel_searched(
    graph: ModelGraph, cp: int, tp: int, pp: int, pins: Pins, rej: Counter[tuple[str, str]]
) -> bool:
    """Whether the search takes context-parallel degree `cp` with (tp, pp): cp = 1 always where not pinned
    otherwise; cp > 1 where pinned, or in the free search on sequences of `CP_MIN_SEQ` tokens or more, unless
    `context_refusal` says why not (counted as a rejection)."""
    if pins.cp is not None:
        if cp != pins.cp:
            return False
    elif cp > 1 and (graph.tokens_per_sample or 0) < CP_MIN_SEQ:
        return False
    if cp == 1:
        return True
    why = context_refusal(graph, cp, tp, pp)
    if why:
        rej[(f"cp={cp}", why)] += 1
        return False
    return True
