"""Search speed: wall time of a whole `planner plan` and of the search alone, and ILPs solved.

    python bench/search_speed.py            # the two headline cases and the growth table
    python bench/search_speed.py --quick    # headline cases only

Prints figures; it asserts nothing. The targets of the issue are < 5 s for GPT-3 175B on 1024 A100s and
< 15 s for a 1T model (128 layers, hidden 25600) on 3072 GPUs, on a 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.pipeline import PlanRequest, analyse, plan_model  # noqa: E402

GPT = str(ROOT / "sample_models" / "gpt.py")


def one(label: str, model_args: dict, gpu: str, gpus: int, batch: int) -> None:
    req = PlanRequest(model_path=GPT, model_args=model_args, gpu=gpu, nodes=gpus // 8, global_batch_size=batch)
    t0 = time.perf_counter()
    graph = analyse(req)
    t1 = time.perf_counter()
    plan, _, result = plan_model(req, graph=graph)
    t2 = time.perf_counter()
    p = plan.parallel
    print(
        f"{label:<34} {gpus:>5} GPUs  plan {t2 - t0:7.2f} s  (trace+analyse {t1 - t0:5.2f} s, search "
        f"{result.seconds:7.2f} s)  ILPs {result.ilps_solved:>4} of {result.candidates:>5} candidates, "
        f"status {result.status}  -> dp{p.dp} tp{p.tp} pp{p.pp}x{p.virtual_stages} mbs{p.micro_batch_size} "
        f"{p.schedule} zero{p.zero_stage}  {plan.predicted.iteration_time_s:.2f} s/iter",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the two headline cases")
    args = ap.parse_args()
    print("headline cases")
    one("GPT-3 175B, batch 1536", {"preset": "gpt3-175b"}, "a100-sxm-80gb", 1024, 1536)
    one("1T (128 x 25600), batch 3072", {"preset": "megatron-1t"}, "a100-sxm-80gb", 3072, 3072)
    if args.quick:
        return
    print("growth with layers (hidden 4096, 512 GPUs) and with GPUs (48 layers)")
    for layers in (24, 48, 96, 192):
        one(f"{layers} layers x 4096", {"layers": layers, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200},
            "a100-sxm-80gb", 512, 1024)
    for gpus in (64, 512, 4096):
        one(f"48 layers x 4096 on {gpus}", {"layers": 48, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200},
            "a100-sxm-80gb", gpus, 4096)


if __name__ == "__main__":
    main()
