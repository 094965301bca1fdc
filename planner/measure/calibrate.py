"""Calibrating a GPU spec's efficiencies from micro-benchmarks on the local device (`planner calibrate`).

What is measured, each against the spec's own peak figures (so the efficiencies mean what the cost model
means by them, `planner/cost/model.py`):

- **GEMMs** (`matmul`, `gemm_half_dim`): the model's own Linear shapes at one micro-batch of tokens when a
  model is given, else a standard set of square GEMMs; achieved FLOP/s / peak per GEMM, then the cost
  model's curve ``eff = matmul * d / (d + gemm_half_dim)`` (d the smallest GEMM dimension) fitted by
  least squares on ``1/eff = 1/matmul + (gemm_half_dim/matmul) / d``.
- **attention** (`attention`): ``scaled_dot_product_attention`` forward + backward (causal), its FLOPs
  counted by torch's own FLOP formulas as the model analysis counts them.
- **memory-bound ops** (`memory`): an elementwise add over tensors far larger than caches; bytes read and
  written / time / the spec's bandwidth.
- **collectives** (`network`): all-reduce, all-gather and point-to-point between the local devices with
  torch.distributed (gloo with 2 processes on a CPU, nccl over every local GPU); ring bus bandwidth /
  the spec's intra-node bandwidth. With a single GPU nothing is measured and the spec's value is kept.

Timing: CUDA events on a GPU, ``time.perf_counter`` on a CPU, medians of repeated runs after warm-up.
The result is written as a spec YAML (the base spec with the measured `efficiency:` block, each value
with a `# source:` comment saying how it was measured) that `--gpu FILE` accepts.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue as queue_module
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import ConfigError
from planner.hardware.spec import Efficiencies, GPUSpec

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    import torch

# One collective timing as rank 0 reports it: (kind, bytes per rank, median seconds).
CollectiveResult = tuple[str, int, float]

log = logging.getLogger(__name__)

# Standard GEMM sizes (M = N = K) when no model is given: small ones show where efficiency falls off.
STANDARD_GEMMS_CUDA = (512, 1024, 2048, 4096, 8192)
STANDARD_GEMMS_CPU = (128, 256, 512, 768, 1024)


@dataclass
class Measurement:
    """One micro-benchmark: what ran, its median time, and the efficiency it implies."""

    kind: str  # gemm, attention, memory, all_reduce, all_gather, p2p
    label: str
    seconds: float
    efficiency: float
    dim: float = 0.0  # smallest GEMM dimension (gemm only)


@dataclass
class Calibration:
    """Measured efficiencies for a spec, with the measurements behind each."""

    base: GPUSpec
    device: str
    device_name: str
    dtype: str
    torch_version: str
    measurements: list[Measurement] = field(default_factory=list)
    efficiency: Efficiencies | None = None
    notes: dict[str, str] = field(default_factory=dict)  # efficiency field -> how it was measured


# ------------------------------------------------------------------------------------------- timing


def _timer(device: str) -> Callable[[Callable[[], object], int, int], float]:
    """A function timing ``fn`` (median seconds over ``repeats`` after ``warmup`` runs) on the device."""
    import torch

    def time_cpu(fn: Callable[[], object], repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        samples: list[float] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def time_cuda(fn: Callable[[], object], repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        samples: list[float] = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    return time_cuda if device == "cuda" else time_cpu


# ---------------------------------------------------------------------------------------- shapes


def model_gemm_shapes(model_files: list[tuple[str, dict[str, Any]]], dtype: str) -> list[tuple[int, int, int]]:
    """(M, K, N) of every distinct Linear in the models, M = the tokens of one sample (batch 1)."""
    import torch

    from planner.model.load import build_meta_model, load_model_file, meta_inputs
    from planner.processes import model_loaded

    shapes: set[tuple[int, int, int]] = set()
    for path, args in model_files:
        loaded = load_model_file(path, args, "build_model", "example_inputs", None, dtype, None)
        model = build_meta_model(loaded)
        model_loaded()  # after the build, as the analysis calls it (the build may import the model's class)
        inputs = meta_inputs(loaded, 1)
        tokens = math.prod(inputs[0].shape[:2]) if inputs and inputs[0].dim() >= 2 else 1
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                shapes.add((int(tokens), mod.in_features, mod.out_features))
    return sorted(shapes)


# -------------------------------------------------------------------------------- single device


def _dtype(device: str, dtype: str) -> torch.dtype:
    import torch

    from planner.model.load import torch_dtype

    # bf16 matmuls are slow or unsupported on many CPUs: measure there in fp32, as `planner profile` runs
    return torch.float32 if device == "cpu" else torch_dtype(dtype)


def bench_gemms(
    spec: GPUSpec, shapes: list[tuple[int, int, int]], device: str, dtype: str, repeats: int, warmup: int
) -> list[Measurement]:
    import torch

    timer, tdt = _timer(device), _dtype(device, dtype)
    peak = spec.peak_flops("fp32" if device == "cpu" else dtype)
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=tdt)
        b = torch.randn(k, n, device=device, dtype=tdt)
        secs = timer(functools.partial(torch.mm, a, b), repeats, warmup)
        out.append(Measurement("gemm", f"{m}x{k}x{n}", secs, 2 * m * k * n / secs / peak, float(min(m, k, n))))
    return out


def bench_attention(
    spec: GPUSpec, shape: tuple[int, int, int, int], device: str, dtype: str, repeats: int, warmup: int
) -> Measurement:
    """Causal SDPA forward + backward on (batch, heads, seq, head_dim).

    FLOPs counted as the model analysis counts SDPA (planner/model/units.py, flash attention): 4 b h s^2 d
    forward and twice that backward, whatever the mask, so the efficiency is the one the cost model needs.
    """
    import torch
    import torch.nn.functional as F

    timer, tdt = _timer(device), _dtype(device, dtype)
    q, k, v = (torch.randn(*shape, device=device, dtype=tdt, requires_grad=True) for _ in range(3))

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    b, h, s, d = shape
    flops = 12.0 * b * h * s * s * d
    secs = timer(step, repeats, warmup)
    peak = spec.peak_flops("fp32" if device == "cpu" else dtype)
    return Measurement("attention", f"sdpa b{b} h{h} s{s} d{d}", secs, flops / secs / peak)


def bench_memory(spec: GPUSpec, numel: int, device: str, dtype: str, repeats: int, warmup: int) -> Measurement:
    """out = x + y over tensors of ``numel`` elements: 3 x numel x itemsize bytes moved."""
    import torch

    timer, tdt = _timer(device), _dtype(device, dtype)
    x, y = torch.randn(numel, device=device, dtype=tdt), torch.randn(numel, device=device, dtype=tdt)
    out = torch.empty_like(x)
    secs = timer(lambda: torch.add(x, y, out=out), repeats, warmup)
    moved = 3 * numel * x.element_size()
    return Measurement(
        "memory", f"add {numel * x.element_size() / 2**20:.0f} MiB", secs, moved / secs / spec.memory_bandwidth
    )


# --------------------------------------------------------------------------------------- collectives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # an AF_INET socket's name is (host, port)
        return port


def _collective_worker(
    rank: int, world: int, port: int, device: str, sizes: list[int], repeats: int,
    queue: Queue[list[CollectiveResult]],
) -> None:
    """One rank: time all-reduce, all-gather and a p2p ping-pong; rank 0 puts the results on ``queue``."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], object]) -> float:
        fn()  # warm-up (NCCL connects lazily)
        sync()
        dist.barrier()
        samples: list[float] = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    results: list[CollectiveResult] = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        x = torch.ones(n, device=dev)
        gathered = torch.empty(n * world, device=dev)
        results.append(("all_reduce", nbytes, timed(functools.partial(dist.all_reduce, x))))
        results.append(("all_gather", nbytes, timed(functools.partial(dist.all_gather_into_tensor, gathered, x))))

        def ping_pong(x: torch.Tensor = x) -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        results.append(("p2p", nbytes, timed(ping_pong) / 2))
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def bench_collectives(spec: GPUSpec, device: str, world: int, sizes: list[int], repeats: int) -> list[Measurement]:
    """Ring bus bandwidth of each collective over ``world`` local processes, / the spec's intra-node link."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue: Queue[list[CollectiveResult]] = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_collective_worker, args=(r, world, port, device, sizes, repeats, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: list[CollectiveResult] | None = None
    deadline = time.monotonic() + 600
    try:
        # wait for rank 0's results, but not for a rank that has died (its peers would wait forever)
        while results is None and time.monotonic() < deadline:
            try:
                results = queue.get(timeout=0.5)
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if results is None:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"the collective benchmark processes did not finish (exit codes {codes})")
    bw = spec.topology.intra_node_bandwidth
    out = []
    for kind, nbytes, secs in results:
        # ring bus bandwidth (nccl-tests' convention): all-reduce moves 2(n-1)/n of the bytes, all-gather
        # (n-1)/n of the gathered output (n x the input), a p2p message all of it
        factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1), "p2p": 1.0}[kind]
        label = f"{kind} {nbytes / 2**20:g} MiB x{world}"
        out.append(Measurement(kind, label, secs, factor * nbytes / secs / bw, float(nbytes)))
    return out


# --------------------------------------------------------------------------------------------- fit


def fit_gemm_curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(matmul, gemm_half_dim) of ``eff = matmul * d / (d + half)`` by least squares on 1/eff = a + b/d."""
    if not points:
        raise ValueError("no GEMM measurements to fit")
    xs = [1 / d for d, _ in points]
    ys = [1 / e for _, e in points]
    if len(points) == 1 or max(xs) - min(xs) < 1e-12:
        return points[0][1], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if a <= 0:  # efficiency still rising at the largest size: take the largest measured as the asymptote
        best = max(points)
        return best[1], 0.0
    b = max(b, 0.0)
    return 1 / a, b / a


def _clamp(value: float, name: str, notes: dict[str, str]) -> float:
    if value > 1.0:
        notes[name] += f"; measured {value:.3f} > 1, clamped (the spec's peak is below what this device reaches)"
        return 1.0
    return max(value, 1e-6)


def calibrate(
    spec: GPUSpec,
    device: str = "cpu",
    dtype: str = "bf16",
    gemm_shapes: list[tuple[int, int, int]] | None = None,
    world: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    quick: bool = False,
) -> Calibration:
    """Run the micro-benchmarks on the local device and fit the spec's efficiencies to them."""
    import torch

    from planner.measure.profile import local_device_name

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: no CUDA GPU is visible here; calibrate on the GPU machine or use --device cpu."
        )
    cal = Calibration(spec, device, local_device_name(device), "fp32" if device == "cpu" else dtype, torch.__version__)
    cpu = device == "cpu"
    if gemm_shapes is None:
        sizes = STANDARD_GEMMS_CPU if cpu else STANDARD_GEMMS_CUDA
        gemm_shapes = [(d, d, d) for d in (sizes[1::2] if quick else sizes)]
    gemms = bench_gemms(spec, gemm_shapes, device, dtype, repeats, warmup)
    attn = bench_attention(spec, (1, 4, 256, 64) if cpu else (4, 16, 2048, 128), device, dtype, repeats, warmup)
    mem = bench_memory(spec, (2**22 if quick else 2**24) if cpu else 2**28, device, dtype, repeats, warmup)
    cal.measurements += [*gemms, attn, mem]

    n_dev = torch.cuda.device_count() if device == "cuda" else 2
    world = n_dev if world is None else world
    base = spec.efficiency
    notes = {
        "matmul": f"planner calibrate: {len(gemms)} GEMMs ({', '.join(g.label for g in gemms[:6])}"
        f"{', ...' if len(gemms) > 6 else ''}), achieved / peak {cal.dtype}, least-squares fit of the d/(d+half) curve",
        "attention": f"planner calibrate: causal SDPA fwd+bwd {attn.label[5:]}, 12 b h s^2 d FLOPs "
        "(as the model analysis counts SDPA) / time / peak",
        "memory": f"planner calibrate: elementwise add ({mem.label[4:]}), bytes moved / time / memory_bandwidth_gbps",
    }
    notes["gemm_half_dim"] = notes["matmul"]
    matmul, half = fit_gemm_curve([(g.dim, g.efficiency) for g in gemms])
    values = {
        "matmul": _clamp(matmul, "matmul", notes),
        "gemm_half_dim": round(half, 1),
        "attention": _clamp(attn.efficiency, "attention", notes),
        "memory": _clamp(mem.efficiency, "memory", notes),
    }
    if world >= 2:
        message_sizes = [2**20, 2**24] if cpu or quick else [2**20, 2**26, 2**28]
        colls = bench_collectives(spec, device, world, message_sizes, repeats)
        cal.measurements += colls
        top = max((c for c in colls if c.kind == "all_reduce"), key=lambda c: c.dim)
        notes["network"] = (
            f"planner calibrate: all-reduce bus bandwidth, {top.label.split(' ', 1)[1]} processes over "
            f"{'nccl' if device == 'cuda' else 'gloo'}, / intra_node_bandwidth_gbps"
        )
        values["network"] = _clamp(top.efficiency, "network", notes)
    else:
        notes["network"] = "kept from the base spec: one local device, no collective to measure"
        values["network"] = base.network
    cal.efficiency = Efficiencies(**values)
    cal.notes = notes
    return cal


# ------------------------------------------------------------------------------------------- output


def calibrated_yaml(cal: Calibration, base_text: str, name: str) -> str:
    """The base spec's YAML with a new name, no aliases and the measured `efficiency:` block."""
    assert cal.efficiency is not None
    source = (
        f"measured by planner calibrate on {cal.device_name} ({cal.device}, {cal.dtype}, torch {cal.torch_version})"
    )
    return rewrite_spec_yaml(base_text, name, "calibrated", _efficiency_block(cal), source)


def rewrite_spec_yaml(base_text: str, name: str, suffix: str, efficiency: list[str], source: str) -> str:
    """``base_text`` (a GPU spec's YAML) renamed to ``name`` with no aliases, `` (suffix)`` after its display
    name, its top-level `efficiency:` block replaced by the lines ``efficiency`` and its `sources:` entry for
    the efficiencies replaced by ``source``; the rest of the file (comments included) is kept as it is.
    Shared by `planner calibrate` and `planner validate --refit`."""
    lines = base_text.splitlines()
    out: list[str] = []
    skipping = False
    for line in lines:
        if skipping:
            if line.startswith((" ", "\t", "#")) or not line.strip():
                continue
            skipping = False
        if line.startswith("efficiency:"):
            skipping = True
            continue
        if line.startswith("name:"):
            line = f"name: {name}"
        elif line.startswith("aliases:"):
            line = "aliases: []"
        elif line.startswith("display_name:"):
            line = f"{line.rstrip()} ({suffix})"
        elif line.startswith("  efficiency:") and any(o.startswith("sources:") for o in out):
            continue  # the efficiencies' source, replaced below
        if line.startswith("sources:"):
            out.extend(efficiency)
            out += [line, f"  efficiency: {source}"]
            continue
        out.append(line)
    if not any(line.startswith("sources:") for line in lines):
        out += [*efficiency, "sources:", f"  efficiency: {source}"]
    return "\n".join(out) + "\n"


def _efficiency_block(cal: Calibration) -> list[str]:
    eff = cal.efficiency
    assert eff is not None
    block = [f"efficiency:  # measured by planner calibrate on {cal.device_name}"]
    for key in ("matmul", "gemm_half_dim", "attention", "memory", "network"):
        value = getattr(eff, key)
        # 4 decimals, or 4 significant digits below 0.001 (a slow, loaded CPU): 0.0000 would not be a valid spec
        text = f"{value:.1f}" if key == "gemm_half_dim" else f"{value:.4f}" if value >= 1e-3 else f"{value:.4e}"
        block.append(f"  {key}: {text}  # source: {cal.notes[key]}")
    return block


def gpu_spec_and_file(name_or_path: str) -> tuple[GPUSpec, Path]:
    """The GPU spec to calibrate and the YAML file it came from (whose text the calibrated spec keeps)."""
    from planner.hardware.load import _resolve  # the loader's own resolution: names, aliases, paths

    spec, path = _resolve(name_or_path)
    if not isinstance(spec, GPUSpec):
        raise ConfigError(
            f"--gpu {name_or_path!r} is the cluster preset {spec.name!r}; calibrate its GPU instead (--gpu {spec.gpu})."
        )
    return spec, path


def write_calibrated_spec(cal: Calibration, base_path: Path, out: Path, name: str | None = None) -> Path:
    from planner.io import atomic_write_text

    text = calibrated_yaml(cal, base_path.read_text(), name or f"{cal.base.name}-calibrated")
    atomic_write_text(out, text)
    return out
