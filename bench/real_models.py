"""Plan real models at full size on meta from their Hugging Face configs, and print how long it takes.

    python bench/real_models.py            # Llama-3-70B, Mixtral-8x7B, DeepSeek-V2-Lite on 64 H100s (8 nodes)
                                           # + torchtitan llama3 70B and deepseek_v3 16B when installed
    python bench/real_models.py Mixtral    # only the models whose name contains the word
    python bench/real_models.py --warm     # a re-plan of each, from the analysis cache

The configs are written from transformers' config classes with the published sizes (nothing downloads);
each plan runs `planner plan hf:NAME --hf-config ...` in a fresh process, so the time includes importing
torch and transformers and tracing on the meta device. Cold by default (PLANNER_NO_CACHE=1: no analysis
cache, no remembered check); `--warm` plans each model twice and times the second, from the cache. A
benchmark, not a test: it prints, it asserts nothing.
"""

from __future__ import annotations

import json
import os
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
    # DeepSeek-style MoE: 64 fine-grained routed experts (top-6) plus 2 shared experts per layer, the first
    # layer dense, multi-head latent attention.
    "deepseek-ai/DeepSeek-V2-Lite": {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
        "tie_word_embeddings": False,
    },
    # DeepSeek-style too (fine-grained routed experts plus a shared expert), in Qwen's layout: 60 experts,
    # top-4, one shared expert with a sigmoid gate.
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "decoder_sparse_step": 1, "norm_topk_prob": False, "vocab_size": 151936,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
}


MOE = (
    "mistralai/Mixtral-8x7B-v0.1", "deepseek-ai/DeepSeek-V2-Lite", "Qwen/Qwen1.5-MoE-A2.7B", "torchtitan:deepseek_v3",
)


def search_only(cfg: str, name: str, ep: str) -> None:
    """Child process: the search and the Plan without the plan-time check (planner.pipeline through the CLI's
    request builder), the plan document on stdout. For a model whose check fails for a reason of its own.
    `cfg`: the HF config's path, or a torchtitan source's flavor."""
    from planner.cli._options import DType, plan_request
    from planner.cli.plan import run_search

    titan = name.startswith("torchtitan:")
    request = plan_request(
        Path(name if titan else f"hf:{name}"), ["seq=4096"], gpu="h100-sxm-80gb", nodes=8, gpus_per_node=None,
        global_batch_size=512, dp=None, tp=None, pp=None, virtual_stages=None, micro_batch_size=None, schedule=None,
        zero_stage=None, recompute=None, sequence_parallel=None, dtype=DType.bf16, build_fn="build_model",
        inputs_fn="example_inputs", loss_fn=None, top_k=5, time_limit=None, no_overlap=False, seed=0, lr=1e-4,
        steps=10, hf_config=None if titan else Path(cfg), flavor=cfg if titan else None,
        ep=int(ep) if ep != "-" else None,
    )
    plan, _, _ = run_search(request, show_progress=False)
    sys.stdout.write(plan.model_dump_json())


def describe(name: str, p: dict, wall: float, how: str) -> None:
    par, pred = p["parallel"], p["predicted"]
    print(
        f"{name} [{how}]: {p['total_params'] / 1e9:.1f}B parameters, planned in {wall:.1f} s "
        f"({p['search']['ilps_solved']} ILPs, {p['search']['candidates']} candidates): dp {par['dp']} tp {par['tp']} "
        f"pp {par['pp']} v {par['virtual_stages']} ep {par.get('ep', 1)} {par['schedule']} zero {par['zero_stage']} "
        f"mbs {par['micro_batch_size']}, {pred['iteration_time_s'] * 1e3:.0f} ms/iteration, "
        f"MFU {pred['mfu'] * 100:.1f}%, peak {pred['peak_memory_bytes'] / 2**30:.1f} GiB, "
        f"expert all-to-all {pred['comm'].get('expert_parallel_s', 0.0) * 1e3:.0f} ms, "
        f"dp sync {pred['comm']['data_parallel_s'] * 1e3:.0f} ms"
    )
    print("  units: " + "; ".join(p["structure"]))
    alts = [a["parallel"] for a in p["alternatives"]]
    print("  runners-up: " + "; ".join(
        f"dp {a['dp']} ep {a.get('ep', 1)} tp {a['tp']} pp {a['pp']} zero {a['zero_stage']}" for a in alts
    ))
    for r in p["rejected"]:
        if "ep" in r.get("region", ""):
            print(f"  rejected {r['region']}: {r['reason']} ({r.get('count', 1)})")


WARM = False  # --warm: time a re-plan from the analysis cache

# torchtitan's own registry (torchtitan:MODEL --flavor NAME), built on meta; skipped without the titan extra.
TITAN = {"torchtitan:llama3": "70B", "torchtitan:deepseek_v3": "16B"}


def plan(name: str, config: dict | str, work: Path) -> None:
    cfg = work / name.replace("/", "--").replace(":", "-") / "config.json"
    cfg.parent.mkdir(parents=True)
    out = cfg.parent / "plan"
    if isinstance(config, str):  # a torchtitan flavor
        source = [name, "--flavor", config]
    else:
        cfg.write_text(json.dumps(config, indent=2))
        source = [f"hf:{name}", "--hf-config", str(cfg)]
    cmd = [sys.executable, "-m", "planner.cli.main", "plan", *source, "--model-arg", "seq=4096",
           "--gpu", "h100-sxm-80gb", "--nodes", "8", "--global-batch-size", "512", "--out", str(out), "--json"]
    env = {**os.environ, "PLANNER_NO_CACHE": "0" if WARM else "1"}
    if WARM:  # prime the analysis cache and the remembered check, then time a re-plan
        subprocess.run([*cmd, "--force"], cwd=ROOT, capture_output=True, text=True, env=env)
    start = time.perf_counter()
    done = subprocess.run([*cmd, "--force"], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode == 0:
        describe(name, json.loads(done.stdout), wall, "planner plan")
    else:
        print(f"{name}: planner plan failed after {wall:.1f} s: {done.stderr.strip()[-300:]}")
    # MoE models: the search alone (no plan-time check), with ep searched and with ep pinned to 1.
    for ep in ("-", "1") if name in MOE else ():
        if ep == "-" and done.returncode == 0:
            continue
        start = time.perf_counter()
        child = [sys.executable, __file__, "--search-only", config if isinstance(config, str) else str(cfg), name, ep]
        res = subprocess.run(child, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        how = "search only, ep searched" if ep == "-" else "search only, --ep 1"
        if res.returncode != 0:
            print(f"{name} [{how}]: failed after {wall:.1f} s: {res.stderr.strip()[-300:]}")
        else:
            describe(name, json.loads(res.stdout), wall, how)


def main() -> None:
    if sys.argv[1:2] == ["--search-only"]:
        sys.path.insert(0, str(ROOT))
        search_only(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    import importlib.util

    global WARM
    WARM = "--warm" in sys.argv
    only = [a for a in sys.argv[1:] if a != "--warm"]
    models: dict[str, dict | str] = dict(CONFIGS)
    if importlib.util.find_spec("torchtitan") is not None:
        models.update(TITAN)
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in models.items():
            if only and not any(word in name for word in only):
                continue
            plan(name, config, Path(tmp))


if __name__ == "__main__":
    main()
