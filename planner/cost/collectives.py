"""Ring collectives and point-to-point transfers (alpha-beta model).

Each formula is the standard bandwidth-optimal ring algorithm (Patarasuk & Yuan 2009; Thakur et al.
2005, "Optimization of Collective Communication Operations in MPICH"): n-1 steps (2(n-1) for all-reduce),
each paying the link latency alpha, moving bytes/n per step at bandwidth beta.
"""

from __future__ import annotations


def allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: 2(n-1)/n * bytes / bw + 2(n-1) * latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def allgather_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a tensor of `nbytes` in total: (n-1)/n * bytes / bw + (n-1) * latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of a tensor of `nbytes` in total; same volume as all-gather."""
    return allgather_time(nbytes, n, bandwidth, latency)


def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """One point-to-point send: latency + bytes / bw."""
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / bandwidth
