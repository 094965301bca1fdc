"""Ring collectives and point-to-point transfers (alpha-beta model).

Each formula is the standard bandwidth-optimal ring algorithm (Patarasuk & Yuan 2009; Thakur et al.
2005, "Optimization of Collective Communication Operations in MPICH"): n-1 steps (2(n-1) for all-reduce),
each paying the link latency alpha, moving bytes/n per step at bandwidth beta.

The byte count may be a float, a numpy array or a pulp expression (see `planner.cost.terms`): the
"nothing to send" guard applies to plain numbers only.
"""

from __future__ import annotations

from typing import Any


def is_nonpositive(x: Any) -> bool:
    """True for a plain number <= 0; False for arrays and expressions (their constant part is paid)."""
    return isinstance(x, (int, float)) and x <= 0


def allreduce_time(nbytes: Any, n: int, bandwidth: float, latency: float) -> Any:
    """Ring all-reduce: 2(n-1)/n * bytes / bw + 2(n-1) * latency."""
    if n <= 1 or is_nonpositive(nbytes):
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def allgather_time(nbytes: Any, n: int, bandwidth: float, latency: float) -> Any:
    """Ring all-gather of a tensor of `nbytes` in total: (n-1)/n * bytes / bw + (n-1) * latency."""
    if n <= 1 or is_nonpositive(nbytes):
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def reduce_scatter_time(nbytes: Any, n: int, bandwidth: float, latency: float) -> Any:
    """Ring reduce-scatter of a tensor of `nbytes` in total; same volume as all-gather."""
    return allgather_time(nbytes, n, bandwidth, latency)


def p2p_time(nbytes: Any, bandwidth: float, latency: float) -> Any:
    """One point-to-point send: latency + bytes / bw."""
    if is_nonpositive(nbytes):
        return 0.0
    return latency + nbytes / bandwidth
