"""Plan real models at full size on meta from their Hugging Face configs, and print how long it takes.

    python bench/real_models.py            # Llama-3-70B and Mixtral-8x7B on 64 H100s (8 nodes)
    python bench/real_models.py Mixtral    # only the models whose name contains the word

The configs are written from transformers' config classes with the published sizes (nothing downloads);
each plan runs `planner plan hf:NAME --hf-config ...` in a fresh process, so the time includes importing
torch and transformers and tracing on the meta device. A benchmark, not a test: it prints, it asserts nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Published sizes (the models' config.json on the Hugging Face hub).
CONFIGS = {
    "meta-llama/Meta-Llama-3-70B": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
    },
}


def plan(name: str, config: dict, work: Path) -> None:
    cfg = work / name.replace("/", "--") / "config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps(config, indent=2))
    out = cfg.parent / "plan"
    cmd = [sys.executable, "-m", "cli.main", "plan", f"hf:{name}", "--hf-config", str(cfg), "--model-arg", "seq=4096",
           "--gpu", "h100-sxm-80gb", "--nodes", "8", "--global-batch-size", "512", "--out", str(out), "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(f"{name}: failed after {wall:.1f} s: {done.stderr.strip()[-500:]}")
        return
    p = json.loads(done.stdout)
    par, pred = p["parallel"], p["predicted"]
    print(
        f"{name}: {p['total_params'] / 1e9:.1f}B parameters, planned in {wall:.1f} s "
        f"({p['search']['ilps_solved']} ILPs, {p['search']['candidates']} candidates): dp {par['dp']} tp {par['tp']} "
        f"pp {par['pp']} v {par['virtual_stages']} ep {par.get('ep', 1)} {par['schedule']} zero {par['zero_stage']}, "
        f"{pred['iteration_time_s'] * 1e3:.0f} ms/iteration, MFU {pred['mfu'] * 100:.1f}%, "
        f"peak {pred['peak_memory_bytes'] / 2**30:.1f} GiB; units: {'; '.join(p['structure'])}"
    )
    alts = [a["parallel"] for a in p["alternatives"]]
    print("  runners-up: " + "; ".join(
        f"dp {a['dp']} ep {a.get('ep', 1)} tp {a['tp']} pp {a['pp']} zero {a['zero_stage']}" for a in alts
    ))
    for r in p["rejected"]:
        if "ep" in r.get("region", ""):
            print(f"  rejected {r['region']}: {r['reason']} ({r.get('count', 1)})")


def main() -> None:
    only = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            if only and not any(word in name for word in only):
                continue
            plan(name, config, Path(tmp))


if __name__ == "__main__":
    main()
