"""Search speed: wall time of a whole `planner plan` command and of the search alone, and ILPs solved.

    python bench/search_speed.py            # the two headline cases and the growth tables
    python bench/search_speed.py --quick    # headline cases only

"plan" is the wall time of the `planner plan` command in a fresh process (interpreter start, torch
import, loading and tracing on the meta device, the search, the simulator, writing plan.json, train.py,
launchers and the timeline); "search" is `planner.search.search.search` alone, in this process, after
the model was analysed. Prints figures; it asserts nothing. The targets of the issue are < 5 s for GPT-3
175B on 1024 A100s and < 15 s for a 1T model (128 layers, hidden 25600) on 3072 GPUs, on a 2-core
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.pipeline import PlanRequest, analyse, plan_model  # noqa: E402

GPT = str(ROOT / "sample_models" / "gpt.py")
MLP = str(ROOT / "sample_models" / "mlp.py")
GPU = "a100-sxm-80gb"
GROWTH = {"hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200}


def cli_seconds(model_args: dict, gpus: int, batch: int, model: str = GPT) -> tuple[float, dict]:
    """Wall time of `planner plan` in a new process, and the plan it wrote."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "cli.main", "plan", model, "--gpu", GPU, "--nodes", str(gpus // 8)]
        cmd += ["--global-batch-size", str(batch), "--out", out, "--quiet"]
        for k, v in model_args.items():
            cmd += ["--model-arg", f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        return wall, json.loads((Path(out) / "plan.json").read_text())


def one(label: str, model_args: dict, gpus: int, batch: int, run_cli: bool = True, model: str = GPT) -> None:
    req = PlanRequest(model_path=model, model_args=model_args, gpu=GPU, nodes=gpus // 8, global_batch_size=batch)
    t0 = time.perf_counter()
    graph = analyse(req)
    t1 = time.perf_counter()
    plan, _, result = plan_model(req, graph=graph)
    p = plan.parallel
    wall = f"{cli_seconds(model_args, gpus, batch, model)[0]:6.2f} s" if run_cli else "     - "
    print(
        f"{label:<30} {gpus:>5} GPUs  plan {wall}  search {result.seconds:6.2f} s  (analyse {t1 - t0:5.2f} s)  "
        f"ILPs {result.ilps_solved:>3} of {result.candidates:>5} candidates, {result.status:<10} -> "
        f"dp{p.dp} tp{p.tp} pp{p.pp}x{p.virtual_stages} mbs{p.micro_batch_size} {p.schedule} zero{p.zero_stage}  "
        f"{plan.predicted.iteration_time_s:.2f} s/iter",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the two headline cases")
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print("headline cases")
    one("GPT-3 175B, batch 1536", {"preset": "gpt3-175b"}, 1024, 1536)
    one("1T (128 x 25600), batch 3072", {"preset": "megatron-1t"}, 3072, 3072)
    if args.quick:
        return
    print("growth with layers (hidden 4096, 512 GPUs, batch 1024)")
    for layers in (24, 48, 96, 192):
        one(f"{layers} layers x 4096", {"layers": layers, **GROWTH}, 512, 1024)
    print("growth with GPUs (48 layers x 4096, batch 4096)")
    for gpus in (64, 512, 4096):
        one(f"48 layers on {gpus} GPUs", {"layers": 48, **GROWTH}, gpus, 4096)
    print("not transformer-shaped: the sample MLP with blocks of 5 sizes (interval form)")
    for layers in (12, 24):
        args = {"layers": layers, "width": 4096, "ffn_cycle": 5}
        one(f"MLP {layers} layers x 5 sizes", args, 32, 256, model=MLP)


if __name__ == "__main__":
    main()
