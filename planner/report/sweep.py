"""What-if over clusters: one plan per (GPU kind, node count), their speed, time-to-train and cost, the Pareto front.

The model is analysed once; each cluster's search runs in a forked process (concurrent.futures with the fork
context, so the analysed graph is inherited, not re-traced), and the results come back in the order asked.
Costs use each spec's `price` (its source and date in the YAML) unless a price is given for that GPU.
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from planner.errors import ConfigError, PlannerError

if TYPE_CHECKING:
    from rich.table import Table

    from planner.model.graph import ModelGraph
    from planner.pipeline import PlanRequest

MAX_NODES = 1 << 20


@dataclass(frozen=True)
class SweepPoint:
    """One cluster's plan in figures; `error` instead where no plan fits."""

    gpu: str
    nodes: int
    gpus: int = 0
    layout: str = ""
    iteration_s: float = 0.0
    tokens_per_s: float | None = None
    samples_per_s: float = 0.0
    mfu: float = 0.0
    usd_per_gpu_hour: float | None = None
    price_source: str = ""
    time_to_train_s: float | None = None
    cost_usd: float | None = None
    pareto: bool = False
    error: str = ""


def parse_nodes(text: str) -> list[int]:
    """'4..128' -> the powers of two from 4 to 128; '2,3,8' -> those; '16' -> [16]."""
    text = text.strip()
    m = re.fullmatch(r"(\d+)\s*\.\.\s*(\d+)", text)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if not 1 <= lo <= hi <= MAX_NODES:
            raise ConfigError(f"--nodes {text}: write LOW..HIGH with 1 <= LOW <= HIGH (e.g. 4..128).")
        out, n = [], 1
        while n <= hi:
            if n >= lo:
                out.append(n)
            n *= 2
        if lo not in out:
            out.insert(0, lo)
        if hi not in out:
            out.append(hi)
        return out
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= MAX_NODES for v in values):
        raise ConfigError(
            f"--nodes {text!r} is not a node count list: write a range LOW..HIGH (powers of two between, e.g. "
            "4..128) or counts separated by commas (e.g. 4,8,12)."
        )
    return sorted(set(values))


def parse_prices(items: list[str] | None) -> dict[str, float]:
    """['h100=2.5'] -> {'h100': 2.5}: USD per GPU-hour by GPU name or alias."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not name.strip() or not price >= 0 or price == float("inf"):
            raise ConfigError(
                f"--price {item!r} is not GPU=USD_PER_GPU_HOUR. Write it like --price h100-sxm-80gb=2.49."
            )
        out[name.strip()] = price
    return out


def _plan_one(graph: ModelGraph, request: PlanRequest, tokens: int | None, case: tuple[str, int, float | None, str]
              ) -> SweepPoint:
    from planner.pipeline import plan_model
    from planner.report.tables import degrees

    gpu, nodes, price, source = case
    try:
        plan, _, _ = plan_model(request.model_copy(update={"gpu": gpu, "nodes": nodes}), graph)
    except PlannerError as e:
        return SweepPoint(gpu, nodes, usd_per_gpu_hour=price, price_source=source, error=str(e).split(". ")[0])
    p = plan.predicted
    gpus = plan.parallel.world_size
    seconds = tokens / p.tokens_per_s if tokens and p.tokens_per_s else None
    cost = seconds / 3600 * gpus * price if seconds is not None and price is not None else None
    return SweepPoint(
        gpu=gpu, nodes=nodes, gpus=gpus, layout=degrees(plan.parallel), iteration_s=p.iteration_time_s,
        tokens_per_s=p.tokens_per_s, samples_per_s=p.samples_per_s, mfu=p.mfu, usd_per_gpu_hour=price,
        price_source=source, time_to_train_s=seconds, cost_usd=cost,
    )


def pareto(points: list[SweepPoint]) -> list[SweepPoint]:
    """The points marked where no other is at least as fast and as cheap and better in one (time-to-train and
    cost where both are known; else iteration time and GPU count)."""

    def key(p: SweepPoint) -> tuple[float, float] | None:
        if p.error:
            return None
        if p.time_to_train_s is not None and p.cost_usd is not None:
            return (p.time_to_train_s, p.cost_usd)
        return (p.iteration_s, float(p.gpus)) if all(q.cost_usd is None for q in points if not q.error) else None

    keys = [key(p) for p in points]
    out = []
    for p, k in zip(points, keys, strict=True):
        front = k is not None and not any(
            o is not None and o[0] <= k[0] and o[1] <= k[1] and o != k for o in keys
        )
        out.append(replace(p, pareto=front))
    return out


def sweep(
    request: PlanRequest,
    gpus: list[str],
    nodes: list[int],
    prices: dict[str, float] | None = None,
    tokens: int | None = None,
    jobs: int = 2,
    graph: ModelGraph | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[SweepPoint]:
    """Plan `request` on every GPU kind x node count (its gpu/nodes replaced), `jobs` at a time."""
    from planner.hardware.load import load_cluster
    from planner.pipeline import analyse

    prices = prices or {}
    cases: list[tuple[str, int, float | None, str]] = []
    for gpu in gpus:
        spec = load_cluster(gpu, 1).gpu  # a wrong name is reported before any planning
        given = next((v for k, v in prices.items() if load_cluster(k, 1).gpu.name == spec.name), None)
        if given is not None:
            price, source = given, "--price"
        elif spec.price is not None:
            price, source = spec.price.usd_per_gpu_hour, f"{spec.price.source} ({spec.price.date})"
        else:
            price, source = None, ""
        cases += [(gpu, n, price, source) for n in nodes]
    if graph is None:
        graph = analyse(request)
    work = partial(_plan_one, graph, request.model_copy(update={"top_k": 0, "measure": False}), tokens)
    results: list[SweepPoint] = []
    if jobs <= 1:
        for case in cases:
            results.append(work(case))
            if progress:
                progress(len(results), len(cases))
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            for point in pool.map(work, cases):
                results.append(point)
                if progress:
                    progress(len(results), len(cases))
    return pareto(results)


def time_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def sweep_svg(points: list[SweepPoint], title: str) -> str:
    """Time-to-train (or iteration time) against cost (or GPU count) per GPU kind, log-log, Pareto front joined."""
    import math
    from xml.sax.saxutils import escape

    ok = [p for p in points if not p.error]
    priced = all(p.cost_usd is not None and p.time_to_train_s is not None for p in ok) and ok

    def xy(p: SweepPoint) -> tuple[float, float]:
        if priced:
            return p.cost_usd or 0.0, p.time_to_train_s or 0.0
        return float(p.gpus), p.iteration_s

    xlabel, ylabel = ("cost (USD)", "time to train (hours)") if priced else ("GPUs", "iteration time (s)")
    yscale = 1 / 3600 if priced else 1.0
    width, height, left, right, top, bottom = 760, 480, 80, 180, 50, 60
    pw, ph = width - left - right, height - top - bottom
    pts = [xy(p) for p in ok] or [(1.0, 1.0)]
    lx = [math.log10(max(x, 1e-12)) for x, _ in pts]
    ly = [math.log10(max(y * yscale, 1e-12)) for _, y in pts]
    x0, x1 = math.floor(min(lx)), math.ceil(max(lx)) + (1 if math.ceil(max(lx)) == math.floor(min(lx)) else 0)
    y0, y1 = math.floor(min(ly)), math.ceil(max(ly)) + (1 if math.ceil(max(ly)) == math.floor(min(ly)) else 0)

    def sx(v: float) -> float:
        return left + (math.log10(max(v, 1e-12)) - x0) / (x1 - x0) * pw

    def sy(v: float) -> float:
        return top + ph - (math.log10(max(v * yscale, 1e-12)) - y0) / (y1 - y0) * ph

    colours = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]
    kinds = list(dict.fromkeys(p.gpu for p in points))
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="24" font-size="14" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#000000"/>',
    ]
    for d in range(x0, x1 + 1):
        x = left + (d - x0) / (x1 - x0) * pw
        out.append(f'<line x1="{x:.2f}" y1="{top}" x2="{x:.2f}" y2="{top + ph}" stroke="#dddddd"/>')
        out.append(f'<text x="{x:.2f}" y="{top + ph + 16}" text-anchor="middle">{10.0 ** d:g}</text>')
    for d in range(y0, y1 + 1):
        y = top + ph - (d - y0) / (y1 - y0) * ph
        out.append(f'<line x1="{left}" y1="{y:.2f}" x2="{left + pw}" y2="{y:.2f}" stroke="#dddddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.2f}" text-anchor="end">{10.0 ** d:g}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{height - 18}" text-anchor="middle">{xlabel} (log)</text>')
    out.append(f'<text x="18" y="{top + ph / 2:.0f}" transform="rotate(-90 18 {top + ph / 2:.0f})" '
               f'text-anchor="middle">{ylabel} (log)</text>')
    front = sorted(xy(p) for p in ok if p.pareto)
    if len(front) > 1:
        path = " ".join(f"{sx(x):.2f},{sy(y):.2f}" for x, y in front)
        out.append(f'<polyline points="{path}" fill="none" stroke="#000000" stroke-dasharray="4 3"/>')
    for p in ok:
        x, y = xy(p)
        colour = colours[kinds.index(p.gpu) % len(colours)]
        tip = f"{p.gpu} x {p.nodes} nodes ({p.gpus} GPUs, {p.layout}): iteration {p.iteration_s:.3f} s"
        stroke = ' stroke="#000000" stroke-width="2"' if p.pareto else ""
        out.append(f'<circle cx="{sx(x):.2f}" cy="{sy(y):.2f}" r="5" fill="{colour}"{stroke}><title>{escape(tip)}'
                   f'</title></circle>')
        out.append(f'<text x="{sx(x) + 7:.2f}" y="{sy(y) - 6:.2f}" font-size="9">{p.nodes}</text>')
    for i, kind in enumerate(kinds):
        y = top + 10 + i * 18
        out.append(f'<circle cx="{left + pw + 20}" cy="{y}" r="5" fill="{colours[i % len(colours)]}"/>')
        out.append(f'<text x="{left + pw + 30}" y="{y + 4}">{escape(kind)}</text>')
    y = top + 10 + len(kinds) * 18
    out.append(f'<text x="{left + pw + 14}" y="{y + 4}" font-size="9">ringed: Pareto front; labels: nodes</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def sweep_png(points: list[SweepPoint], title: str) -> bytes | None:
    """The same plot as PNG bytes through matplotlib, where it is installed; None where it is not."""
    import io

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [p for p in points if not p.error]
    priced = bool(ok) and all(p.cost_usd is not None and p.time_to_train_s is not None for p in ok)
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    for kind in dict.fromkeys(p.gpu for p in ok):
        mine = [p for p in ok if p.gpu == kind]
        xs = [(p.cost_usd if priced else p.gpus) for p in mine]
        ys = [((p.time_to_train_s or 0) / 3600 if priced else p.iteration_s) for p in mine]
        ax.scatter(xs, ys, label=kind, edgecolors=["black" if p.pareto else "none" for p in mine])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cost (USD)" if priced else "GPUs")
    ax.set_ylabel("time to train (hours)" if priced else "iteration time (s)")
    ax.set_title(title)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()




def sweep_table(points: list[SweepPoint], title: str) -> Table:
    """The sweep as a rich table, one row per cluster, the Pareto front starred."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("", "GPU", "nodes", "GPUs", "layout", "iteration", "tokens/s", "MFU", "time to train", "$/GPU-h",
                "cost"):
        table.add_column(col, justify="left" if col in ("", "GPU", "layout") else "right")
    for p in points:
        if p.error:
            table.add_row("", p.gpu, str(p.nodes), "", f"no plan: {p.error}", "", "", "", "", "", "")
            continue
        table.add_row(
            "*" if p.pareto else "", p.gpu, str(p.nodes), str(p.gpus), p.layout, time_text(p.iteration_s),
            f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-", f"{p.mfu * 100:.1f}%", time_text(p.time_to_train_s),
            f"{p.usd_per_gpu_hour:.2f}" if p.usd_per_gpu_hour is not None else "-",
            f"{p.cost_usd:,.0f}" if p.cost_usd is not None else "-",
        )
    table.caption = "*: Pareto front (no other cluster both faster and cheaper). Prices: " + "; ".join(
        sorted({f"{p.gpu} {p.price_source}" for p in points if p.price_source})
    ) if any(p.price_source for p in points) else "*: Pareto front. No prices: pass --price GPU=USD_PER_GPU_HOUR."
    return table
