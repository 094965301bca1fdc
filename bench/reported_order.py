"""Is the chosen plan the fastest by the figure the report shows? For each case it plans (as `planner
dry-run` does) and prints the chosen plan's iteration time, the best runner-up's and its difference, and
the search's gap for the reported figure; exits 1 if any runner-up is faster than the choice.

Cases: `planner dry-run` on 4 CPU ranks with --pp 2 --dp 2 (the e2e suite's layout) for the sample gpt,
llama and mlp and a tiny Hugging Face ViT (tests/fixtures/hf/vit.py, when transformers is installed);
the same models on 8 A100s unpinned; and bench/search_speed.py's cases (GPT-3 175B on 1024 A100s, the
1T model, the growth tables' models, the non-transformer MLPs).

    python bench/reported_order.py           # every case
    python bench/reported_order.py --quick   # the dry-run cases only
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.pipeline import PlanRequest, plan_model  # noqa: E402

SAMPLES = ROOT / "sample_models"
VIT = ROOT / "tests" / "fixtures" / "hf" / "vit.py"
GROWTH = {"hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200}


def cases(quick: bool) -> list[tuple[str, dict[str, Any]]]:
    models = [(name, str(SAMPLES / f"{name}.py")) for name in ("gpt", "llama", "mlp")]
    if importlib.util.find_spec("transformers") is not None:
        models.append(("hf-vit", str(VIT)))
    out: list[tuple[str, dict[str, Any]]] = []
    for name, path in models:
        out.append((f"{name} dry-run cpu 4 --pp 2 --dp 2", dict(
            model_path=path, gpu="cpu", nodes=1, gpus_per_node=4, global_batch_size=8, pins={"pp": 2, "dp": 2})))
    if quick:
        return out
    for name, path in models:
        out.append((f"{name} 8 x a100", dict(
            model_path=path, gpu="a100-sxm-80gb", nodes=1, gpus_per_node=8, global_batch_size=16)))
    gpt = str(SAMPLES / "gpt.py")
    out.append(("GPT-3 175B 1024 x a100", dict(
        model_path=gpt, model_args={"preset": "gpt3-175b"}, gpu="a100-sxm-80gb", nodes=128, global_batch_size=1536)))
    out.append(("1T 3072 x a100", dict(
        model_path=gpt, model_args={"preset": "megatron-1t"}, gpu="a100-sxm-80gb", nodes=384, global_batch_size=3072)))
    for layers in (24, 48, 96):
        out.append((f"{layers} layers x 4096, 512 x a100", dict(
            model_path=gpt, model_args={"layers": layers, **GROWTH}, gpu="a100-sxm-80gb", nodes=64,
            global_batch_size=1024)))
    for gpus in (64, 512):
        out.append((f"48 layers on {gpus} x a100", dict(
            model_path=gpt, model_args={"layers": 48, **GROWTH}, gpu="a100-sxm-80gb", nodes=gpus // 8,
            global_batch_size=4096)))
    for layers in (12, 24):
        out.append((f"MLP {layers} layers x 5 sizes, 32 x a100", dict(
            model_path=str(SAMPLES / "mlp.py"), model_args={"layers": layers, "width": 4096, "ffn_cycle": 5},
            gpu="a100-sxm-80gb", nodes=4, global_batch_size=256)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the dry-run cases")
    args = ap.parse_args()
    bad = 0
    for label, fields in cases(args.quick):
        t0 = time.perf_counter()
        plan, _, result = plan_model(PlanRequest(**fields))
        best = plan.predicted.iteration_time_s
        alts = [a.predicted.iteration_time_s for a in plan.alternatives]
        runner = min(alts, default=None)
        faster = runner is not None and runner < best
        bad += faster
        p = plan.parallel
        shape = f"dp{p.dp} tp{p.tp} pp{p.pp}x{p.virtual_stages} {p.schedule} zero{p.zero_stage}"
        diff = f"{(runner / best - 1) * 100:+7.2f}%" if runner is not None else "      -"
        second = f"{runner:.6g}" if runner is not None else "-"
        gap = getattr(result, "reported_gap", float("nan"))  # main before issue 11 had none
        print(
            f"{label:<40} chosen {best:.6g} s ({shape}), best runner-up {second} s ({diff}), "
            f"reported gap {gap * 100:.2f}%, {time.perf_counter() - t0:.1f} s  "
            + ("FASTER RUNNER-UP" if faster else "ok"),
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
