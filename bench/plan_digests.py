"""sha256 of plan.json for a fixed set of `planner plan` commands, against the digests recorded in
tests/fixtures/plan_digests.json: a refactor of the search must leave every plan byte-identical.

    python bench/plan_digests.py              # every case, each in a fresh process; exit 1 on a changed digest
    python bench/plan_digests.py --cheap      # the cases tests/test_plan_digests.py runs
    python bench/plan_digests.py --record     # (re)write the fixture from this checkout (unmodified code only)

The set: the README's `planner plan` examples that run here (the Hugging Face and torchtitan ones need a
config or a package that is not installed), GPT-3 175B on 1024 A100s (free, and pinned as
tests/e2e/test_planned_e2e.py plans it), the plans the e2e tests make with `planner plan`, and searches of
unit sequences that are not one run of identical blocks (the chain and rank solvers, CBC's forms, the tail
cut). plan.json holds the model file's absolute path; it is replaced by `<ROOT>` (or `<OUT>`) before hashing,
so a checkout elsewhere gives the same digests. Every case runs with PLANNER_NO_CACHE=1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "plan_digests.json"
GPT = "{ROOT}/sample_models/gpt.py"
LLAMA = "{ROOT}/sample_models/llama.py"
MLP = "{ROOT}/sample_models/mlp.py"
MODELS = "{ROOT}/tests/fixtures/models"
TINY = "{ROOT}/tests/fixtures/tiny_gpt.py"
CPU4 = ["--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--global-batch-size", "8", "--micro-batch-size", "2"]
E2E_GPT = ["--model-arg", "layers=4", "--model-arg", "hidden=64", "--model-arg", "seq=32", "--model-arg", "vocab=256"]


def _a100(gpus: int, batch: int) -> list[str]:
    return ["--gpu", "a100-sxm-80gb", "--nodes", str(gpus // 8), "--global-batch-size", str(batch)]


# name -> (cheap: run by the test, `planner plan` arguments without --out)
CASES: dict[str, tuple[bool, list[str]]] = {
    # README.md
    "readme_gpt3_6.7b_h100x64": (False, [GPT, "--model-arg", "preset=gpt3-6.7b", "--gpu", "h100-sxm-80gb", "--nodes",
                                         "8", "--global-batch-size", "512"]),
    "readme_llama2_7b_h100x64": (False, [LLAMA, "--model-arg", "preset=llama2-7b", "--gpu", "h100-sxm-80gb",
                                         "--nodes", "8", "--global-batch-size", "512"]),
    # GPT-3 175B on 1024 A100s: bench/search_speed.py's free search, and tests/e2e/test_planned_e2e.py's pins
    "gpt3_175b_a100x1024": (False, [GPT, "--model-arg", "preset=gpt3-175b", *_a100(1024, 1536)]),
    "gpt3_175b_a100x1024_tp8_pp16": (False, [GPT, "--model-arg", "preset=gpt3-175b", *_a100(1024, 1536), "--tp",
                                             "8", "--pp", "16", "--micro-batch-size", "1", "--schedule", "1f1b"]),
    # bench/search_speed.py's models that are not one run of identical blocks (ranks.py, chain.py, CBC)
    "mlp24_5sizes_a100x32": (True, [MLP, "--model-arg", "layers=24", "--model-arg", "width=4096", "--model-arg",
                                    "ffn_cycle=5", *_a100(32, 256)]),
    "mlp24_5sizes_a100x8": (True, [MLP, "--model-arg", "layers=24", "--model-arg", "width=4096", "--model-arg",
                                   "ffn_cycle=5", *_a100(8, 256)]),
    "cnn48_a100x32": (False, [f"{MODELS}/sequential_cnn.py", "--model-arg", "blocks=48", "--model-arg",
                              "channels=512", *_a100(32, 256)]),
    "gpt98_a100x1024": (False, [GPT, "--model-arg", "layers=98", "--model-arg", "hidden=4096", "--model-arg",
                                "heads=32", "--model-arg", "seq=2048", "--model-arg", "vocab=51200",
                                *_a100(1024, 512)]),
    # the e2e tests' `planner plan` commands (tests/e2e/)
    "e2e_planned_gpt_pp2_dp2": (True, [GPT, *E2E_GPT, *CPU4, "--pp", "2", "--dp", "2", "--schedule", "1f1b",
                                       "--lr", "3e-3"]),
    "e2e_layouts_gpt_pp2_v2": (True, [GPT, "--model-arg", "layers=6", "--model-arg", "hidden=32", "--model-arg",
                                      "heads=2", "--model-arg", "seq=16", "--model-arg", "vocab=64", "--gpu", "cpu",
                                      "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "8", "--pp", "2",
                                      "--virtual-stages", "2", "--micro-batch-size", "2", "--schedule",
                                      "interleaved-1f1b", "--lr", "3e-3"]),
    "e2e_train_tiny_tp2_sp": (True, [TINY, "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "8",
                                     "--micro-batch-size", "2", "--tp", "2", "--sequence-parallel", "--lr", "1e-3"]),
    "e2e_tp_moduledict_llama_pp2_tp2": (True, [f"{MODELS}/moduledict_llama.py", *CPU4, "--tp", "2", "--pp", "2",
                                               "--schedule", "1f1b", "--lr", "1e-3"]),
    "e2e_tp_headcount_gpt_tp2_dp2": (True, [f"{MODELS}/headcount_gpt.py", *CPU4, "--tp", "2", "--dp", "2", "--lr",
                                            "1e-3"]),
    "e2e_corpus_sequential_cnn_pp2_dp2": (True, [f"{MODELS}/sequential_cnn.py", *CPU4, "--pp", "2", "--dp", "2",
                                                 "--schedule", "1f1b", "--lr", "1e-3"]),
    "e2e_corpus_gpt2_pp2_dp2": (False, [f"{MODELS}/hf_tiny.py", "--model-arg", "arch='gpt2'", *CPU4, "--pp", "2",
                                        "--dp", "2", "--schedule", "1f1b", "--lr", "1e-3"]),
    "e2e_moe_deepseek_style_pp2_dp2_ep2": (True, [f"{MODELS}/deepseek_moe.py", *CPU4, "--dtype", "fp32",
                                                  "--pp", "2", "--dp", "2", "--ep", "2", "--lr", "1e-3"]),
    "e2e_moe_mixtral_dp4_ep2": (False, [f"{MODELS}/hf_tiny.py", "--model-arg", "arch=mixtral", *CPU4, "--dtype",
                                        "fp32", "--dp", "4", "--ep", "2", "--lr", "1e-3"]),
    "e2e_layout_file_wide_dp2": (True, ["{ROOT}/tests/e2e/wide_model.py", "--gpu", "cpu", "--nodes", "1",
                                        "--gpus-per-node", "2", "--dp", "2", "--global-batch-size", "8",
                                        "--micro-batch-size", "2", "--lr", "1e-2"]),
    # unpinned: the whole search on a CPU cluster (tests/test_cli.py's)
    "cli_tiny_free": (True, [TINY, "--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", "8"]),
}


def plan_args(name: str, out: Path) -> list[str]:
    return ["plan", *(a.replace("{ROOT}", str(ROOT)) for a in CASES[name][1]), "--out", str(out), "--quiet"]


def digest(plan_json: Path, out: Path) -> str:
    """sha256 of plan.json with the checkout's and the output folder's paths replaced by placeholders."""
    text = plan_json.read_text().replace(str(out), "<OUT>").replace(str(ROOT), "<ROOT>")
    return hashlib.sha256(text.encode()).hexdigest()


def run_case(name: str) -> str:
    """The digest of the case's plan.json, `planner plan` in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        env = {**os.environ, "PLANNER_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "planner.cli.main", *plan_args(name, out)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: planner plan failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        return digest(out / "plan.json", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cheap", action="store_true", help="only the cases the test runs")
    ap.add_argument("--record", action="store_true", help="write the fixture from this checkout")
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    names = args.cases or [n for n, (cheap, _) in CASES.items() if cheap or not args.cheap]
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    changed = 0
    for name in names:
        t0 = time.perf_counter()
        got = run_case(name)
        wall = time.perf_counter() - t0
        want = recorded.get(name)
        verdict = "recorded" if args.record else ("same" if got == want else f"CHANGED (was {want})")
        changed += not args.record and got != want
        print(f"{name:<40} {wall:6.1f} s  {got[:16]}  {verdict}", flush=True)
        recorded[name] = got
    if args.record:
        FIXTURE.write_text(json.dumps(dict(sorted(recorded.items())), indent=2) + "\n")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
