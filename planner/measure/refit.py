"""Refitting a spec's efficiencies to measured times (`planner validate --refit`, bench/fit_published.py).

Every time the cost model predicts is affine in the inverse efficiencies x_k = 1/eff_k (k = matmul,
attention, memory, network; `gemm_half_dim` held fixed): a roofline term is work / (peak * eff), a
collective bytes / (bandwidth * eff) + latency. So each measured term gives one linear equation
``const + sum_k coef_k x_k = measured``, whose coefficients are read off the cost model itself
(`affine_in_inverse_efficiency`: the model evaluated at the spec's efficiencies and once more per
efficiency with x_k doubled; exact, since the terms are affine), and the fit is the least-squares
solution of those equations in relative error, bounded to eff in (0, 1] (`box_least_squares`).

An efficiency that no measured term depends on enough (`MIN_SHARE` of some term's predicted time) is
not identifiable from the measurements and is kept at the spec's value, with that reason recorded.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.hardware.spec import ClusterSpec, Efficiencies
from planner.measure.calibrate import rewrite_spec_yaml

if TYPE_CHECKING:
    from planner.cost.candidate import Candidate
    from planner.cost.model import StageCost
    from planner.model.graph import ModelGraph

FITTED = ("matmul", "attention", "memory", "network")
MIN_SHARE = 0.05  # an efficiency is fitted only if it explains >= 5% of some measured term's prediction
EFF_FLOOR = 1e-4  # eff in [EFF_FLOOR, 1]: x = 1/eff in [1, 1/EFF_FLOOR]
# What a kernel of each class reaches at best on a data-centre GPU (A100, H100), for fits that must stay
# physical (bench/fit_published.py): a fitted value above these would be absorbing another term's error.
PHYSICAL_MAX = {
    "matmul": 0.90,  # cuBLAS bf16 GEMMs at large sizes: ~280 of 312 TFLOP/s on A100, ~800 of 989 on H100 SXM
    "attention": 0.75,  # FlashAttention-3 (Shah et al. 2024): up to 740 of 989 TFLOP/s bf16 forward on H100
    "memory": 0.92,  # streaming kernels (BabelStream copy/triad) reach ~90% of HBM peak bandwidth
    "network": 0.92,  # nccl-tests bus bandwidth: ~90% of the NVLink / InfiniBand link rate at large messages
}


@dataclass
class Term:
    """One measured time and the cost model's prediction of it, affine in the inverse efficiencies."""

    name: str  # e.g. "stage 1 backward", "dp all-reduce 2.3 MiB (stage 0)"
    kind: str  # forward, backward, p2p, all_reduce, all_gather, reduce_scatter, iteration
    measured_s: float
    samples: int
    const: float
    coef: dict[str, float]
    stage: int | None = None

    def predicted(self, eff: Efficiencies) -> float:
        return float(self.const + sum(c / getattr(eff, k) for k, c in self.coef.items()))


def with_efficiency(cluster: ClusterSpec, eff: Efficiencies) -> ClusterSpec:
    return cluster.model_copy(update={"gpu": cluster.gpu.model_copy(update={"efficiency": eff})})


def affine_in_inverse_efficiency(
    predict: Callable[[Efficiencies], Sequence[float]], base: Efficiencies
) -> list[tuple[float, dict[str, float]]]:
    """(const, {k: coef}) of each figure ``predict`` returns, as ``const + sum coef_k / eff_k``."""
    at_base = list(predict(base))
    coefs: list[dict[str, float]] = [{} for _ in at_base]
    for k in FITTED:
        x0 = 1.0 / getattr(base, k)
        # x doubled: eff halved (always valid, eff stays > 0)
        moved = list(predict(base.model_copy(update={k: getattr(base, k) / 2})))
        for i, (a, b) in enumerate(zip(at_base, moved, strict=True)):
            coefs[i][k] = (b - a) / x0
    out = []
    for value, coef in zip(at_base, coefs, strict=True):
        const = value - sum(c / getattr(base, k) for k, c in coef.items())
        out.append((const, coef))
    return out


def box_least_squares(a: np.ndarray, b: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """argmin ||a x - b||^2 subject to lower <= x <= upper, exactly, for a handful of variables.

    The problem is a convex QP: its minimiser is the unconstrained least-squares solution over the
    variables that are not at a bound, with the others at one of their bounds. Every assignment of
    (free, at lower, at upper) is tried (3^n, n <= 5 here) and the best feasible one kept, so the result
    does not depend on a starting point or a tolerance schedule.
    """
    n = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for states in itertools.product((0, 1, 2), repeat=n):
        x = np.where(np.array(states) == 1, lower, upper).astype(float)
        free = [i for i, s in enumerate(states) if s == 0]
        if free:
            rest = b - a[:, [i for i in range(n) if i not in free]] @ x[[i for i in range(n) if i not in free]]
            sol, *_ = np.linalg.lstsq(a[:, free], rest, rcond=None)
            x[free] = sol
            if np.any(x < lower - 1e-9) or np.any(x > upper + 1e-9):
                continue
        cost = float(np.sum((a @ x - b) ** 2))
        if best is None or cost < best[0] - 1e-15:
            best = (cost, x)
    assert best is not None  # every variable at a bound is always feasible
    clipped: np.ndarray = np.clip(best[1], lower, upper)
    return clipped


@dataclass
class Fit:
    """The refitted efficiencies and what each rests on."""

    base: Efficiencies
    efficiency: Efficiencies
    terms: list[Term]
    fitted: dict[str, int] = field(default_factory=dict)  # efficiency -> measured terms it was fitted on
    kept: dict[str, str] = field(default_factory=dict)  # efficiency -> why it kept the spec's value
    at_bound: list[str] = field(default_factory=list)  # fitted efficiencies that ended on a bound of their box

    def error(self, eff: Efficiencies) -> float:
        """Root-mean-square relative error of the terms' predictions under ``eff``."""
        errs = [(t.predicted(eff) - t.measured_s) / t.measured_s for t in self.terms]
        return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else 0.0


def fit_efficiencies(
    base: Efficiencies,
    terms: list[Term],
    min_share: float = MIN_SHARE,
    hold: dict[str, str] | None = None,
    upper: dict[str, float] | None = None,
) -> Fit:
    """Least squares in relative error over the terms, eff bounded to [EFF_FLOOR, 1] (or to ``upper``'s value,
    e.g. `PHYSICAL_MAX`); ``hold``: efficiencies kept at the base's value whatever the terms say, each with the
    reason. A fitted value that ends on its bound is listed in `Fit.at_bound`: it absorbs other terms' error."""
    terms = [t for t in terms if t.measured_s > 0 and math.isfinite(t.measured_s)]
    fit = Fit(base, base, terms)
    if not terms:
        fit.kept = {k: "no measured term" for k in FITTED}
        return fit
    free: list[str] = []
    for k in FITTED:
        if hold and k in hold:
            fit.kept[k] = hold[k]
            continue
        shares = [t.coef.get(k, 0.0) / getattr(base, k) / max(t.predicted(base), 1e-300) for t in terms]
        users = sum(s >= min_share for s in shares)
        if users:
            free.append(k)
            fit.fitted[k] = users
        else:
            fit.kept[k] = f"no measured term depends on it (largest share {100 * max(shares, default=0):.1f}%)"
    if not free:
        return fit
    # rows scaled by 1/measured: relative error, so a long backward does not drown a short p2p
    a = np.array([[t.coef.get(k, 0.0) / t.measured_s for k in free] for t in terms])
    rhs = np.array([1.0 - sum(t.coef.get(k, 0.0) / getattr(base, k) for k in fit.kept) / t.measured_s
                    - t.const / t.measured_s for t in terms])
    top = {k: min(1.0, (upper or {}).get(k, 1.0)) for k in free}
    x = box_least_squares(a, rhs, np.array([1.0 / top[k] for k in free]), np.full(len(free), 1.0 / EFF_FLOOR))
    values = {k: float(min(top[k], max(EFF_FLOOR, 1.0 / xi))) for k, xi in zip(free, x, strict=True)}
    fit.at_bound = [k for k, v in values.items() if v >= top[k] - 1e-6 or v <= EFF_FLOOR + 1e-9]
    fit.efficiency = base.model_copy(update={k: round(v, 4) or EFF_FLOOR for k, v in values.items()})
    return fit


# ------------------------------------------------------------------------------------------- output


def refit_yaml(base_text: str, fit: Fit, name: str, provenance: str) -> str:
    """The base spec's YAML with a new name, no aliases and the refitted `efficiency:` block, each line
    saying where its number came from (``provenance``: the command, the note, the device)."""
    block = efficiency_block(fit, provenance)
    return rewrite_spec_yaml(base_text, name, "refit", block, json.dumps(provenance))  # quoted: may hold ': '


def efficiency_block(fit: Fit, provenance: str) -> list[str]:
    block = [f"efficiency:  # {provenance}"]
    for key in ("matmul", "gemm_half_dim", "attention", "memory", "network"):
        value = getattr(fit.efficiency, key)
        text = f"{value:.1f}" if key == "gemm_half_dim" else f"{value:.4f}"
        if key in fit.fitted:
            why = f"fitted, least squares over {len(fit.terms)} measured terms ({fit.fitted[key]} depend on it)"
            why += f", was {getattr(fit.base, key):.4g}"
        elif key == "gemm_half_dim":
            why = "kept from the base spec (held fixed by the fit)"
        else:
            why = f"kept from the base spec: {fit.kept.get(key, 'not fitted')}"
        block.append(f"  {key}: {text}  # source: {why}")
    return block


# ------------------------------------------------------------------------------ a plan's own terms


@dataclass
class Expected:
    """A term of one plan that a run can measure: its name, kind, stage and the probe's instructions."""

    name: str
    kind: str
    stage: int | None
    const: float
    coef: dict[str, float]
    probe: dict[str, Any] | None = None  # a collective the probe runs: op, dim, bytes (, src, dst)


def plan_terms(
    graph: ModelGraph,
    cluster: ClusterSpec,
    cand: Candidate,
    partition: list[list[int]],
    recompute: list[str],
    full_blocks: list[int] | None = None,
) -> list[Expected]:
    """Per stage forward and backward per micro-batch, each pipeline hop's send and each stage's
    data-parallel collectives, as the cost model predicts them for this partition (affine in 1/eff; `full_blocks`:
    each stage's first blocks recomputed fully, plan.json's recompute_full_blocks)."""
    from planner.cost import collectives as coll
    from planner.cost.candidate import CostOptions
    from planner.cost.model import stage_costs, unit_cost
    from planner.cost.placement import stage_rank
    from planner.cost.terms import GRAD_BYTES_PER_PARAM, dp_link, p2p_time, weight_bytes_per_param

    dtype = graph.source.dtype
    n_stages = len(partition)
    hops = [
        (s, stage_rank(cand.schedule, cand.pp, cand.virtual_stages, s),
         stage_rank(cand.schedule, cand.pp, cand.virtual_stages, s + 1))
        for s in range(n_stages - 1)
    ]

    def stages(eff: Efficiencies) -> tuple[ClusterSpec, list[StageCost]]:
        cl = with_efficiency(cluster, eff)
        costs = [unit_cost(u, cand, cl, dtype) for u in graph.units]
        options = CostOptions.for_cluster(cl)
        return cl, stage_costs(graph, cl, cand, partition, recompute, costs, options, None, full_blocks)

    _, base_stages = stages(cluster.gpu.efficiency)
    dp_ops: list[tuple[str, str, int, float]] = []  # (name, op, stage, bytes)
    if cand.dp > 1:
        for st in base_stages:
            grad_b = GRAD_BYTES_PER_PARAM * st.params_local
            w_b = weight_bytes_per_param(dtype) * st.params_local
            if cand.zero_stage == 0:
                dp_ops.append(("all_reduce", "all_reduce", st.index, grad_b))
            else:
                dp_ops.append(("reduce_scatter", "reduce_scatter", st.index, grad_b))
                if cand.zero_stage in (1, 2):
                    dp_ops.append(("all_gather", "all_gather", st.index, w_b))
                else:
                    dp_ops.append(("all_gather", "all_gather", st.index, w_b))  # ZeRO-3's weight gather

    def predict(eff: Efficiencies) -> list[float]:
        cl, sts = stages(eff)
        out = [v for st in sts for v in (st.fwd, st.bwd)]
        out += [p2p_time(graph.units[partition[s][-1]].output_bytes, cand, cl) for s, _, _ in hops]
        bw, lat = dp_link(cand, cl)
        timers = {"all_reduce": coll.allreduce_time, "all_gather": coll.allgather_time,
                  "reduce_scatter": coll.reduce_scatter_time}
        out += [timers[op](nbytes, cand.dp, bw, lat) for _, op, _, nbytes in dp_ops]
        return out

    affine = affine_in_inverse_efficiency(predict, cluster.gpu.efficiency)
    expected: list[Expected] = []
    for s in range(n_stages):
        (cf, kf), (cb, kb) = affine[2 * s], affine[2 * s + 1]
        expected.append(Expected(f"stage {s} forward", "forward", s, cf, kf))
        expected.append(Expected(f"stage {s} backward", "backward", s, cb, kb))
    i = 2 * n_stages
    for s, src, dst in hops:
        nbytes = graph.units[partition[s][-1]].output_bytes * cand.micro_batch_size / (
            cand.tp if cand.sequence_parallel else 1
        )
        const, coef = affine[i]
        i += 1
        expected.append(Expected(
            f"p2p {_mib(nbytes)} (stage {s} -> {s + 1})", "p2p", s, const, coef,
            {"op": "p2p", "dim": "pp", "bytes": nbytes, "src": src, "dst": dst},
        ))
    for name, op, s, nbytes in dp_ops:
        const, coef = affine[i]
        i += 1
        expected.append(Expected(
            f"dp {name.replace('_', '-')} {_mib(nbytes)} (stage {s})", op, s, const, coef,
            {"op": op, "dim": "dp", "bytes": nbytes},
        ))
    return expected


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def probe_config(expected: list[Expected], out: str, pipeline: bool, repeats: int = 5) -> dict[str, Any]:
    """What the probe inside the run needs: where to write, whether a pipeline runs, which collectives."""
    collectives = [{**e.probe, "name": e.name} for e in expected if e.probe is not None]
    return {"out": out, "pipeline": pipeline, "repeats": repeats, "collectives": collectives}


def measured_terms(expected: list[Expected], rank_docs: list[dict[str, Any]]) -> list[Term]:
    """The expected terms with the run's measurements: medians over every rank (and micro-batch) that ran
    the term; a term nothing measured is left out."""
    import statistics

    terms = []
    for e in expected:
        samples: list[float] = []
        for doc in rank_docs:
            if e.kind in ("forward", "backward"):
                samples += doc.get("compute", {}).get(f"{e.kind}:{e.stage}", [])
            else:
                samples += doc.get("collectives", {}).get(e.name, [])
        if samples:
            terms.append(Term(e.name, e.kind, statistics.median(samples), len(samples), e.const, e.coef, e.stage))
    return terms
