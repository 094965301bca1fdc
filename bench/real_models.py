"""Plan real models at full size on meta from their Hugging Face configs, and print how long it takes.

    python bench/real_models.py            # Llama-3-70B, Mixtral-8x7B, DeepSeek-V2-Lite, Qwen1.5-MoE,
                                           # Qwen3-30B-A3B, Mamba-2.8B, Mamba-2 2.7B (seq 2048)
                                           # on 64 H100s (8 nodes),
                                           # DeepSeek-V3 671B on 512 H100s (64 nodes), Whisper large-v3
                                           # and a CLIP ViT-L/14 pair (model files),
                                           # + torchtitan llama3 70B and deepseek_v3 16B when installed
    python bench/real_models.py Mixtral    # only the models whose name contains the word
    python bench/real_models.py --warm     # a re-plan of each, from the analysis cache
    python bench/real_models.py --repeat 3 # each planned 3 times: the medians, and the spread
    python bench/real_models.py --ep-search  # MoE models: also the search alone, ep searched and ep pinned to 1

The configs are written from transformers' config classes with the published sizes (nothing downloads);
each plan runs `planner plan hf:NAME --hf-config ...` (or `planner plan FILE` for a model file that builds
the transformers class from its config: Whisper's mel input, CLIP's image and text towers) in a fresh
process, so the time includes importing torch and transformers and tracing on the meta device. Before each
plan, `python -c "import torch"` is timed in a fresh process too, and the plan's time is printed as a ratio to
it: the machine's speed (and its load from other work) cancels out of the ratio. So is a process that only
imports what the plan must import of other people's code (torch, and transformers with the model's class, or
torchtitan's model package: `floor_s`); the plan's time less that is printed as the planner's own. Cold by default
(PLANNER_NO_CACHE=1: no analysis cache, no remembered check); `--warm` plans each model twice and times the
second, from the cache. A benchmark, not a test: it prints, it asserts nothing (each cold plan is meant to take
at most BUDGET_S seconds, issue 27).
"""

from __future__ import annotations

import json
import os
import statistics
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
    # Qwen3's MoE: 128 experts, top-8, every layer sparse, no shared expert.
    "Qwen/Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # DeepSeek-V3 671B: 256 routed experts (top-8, grouped routing) and a shared one, the first 3 layers dense,
    # multi-head latent attention with a compressed query.
    "deepseek-ai/DeepSeek-V3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "vocab_size": 129280,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Mamba-2.8B (state-spaces/mamba-2.8b-hf): 64 Mamba blocks, no attention; planned at seq 2048.
    "state-spaces/mamba-2.8b-hf": {
        "model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 2560,
        "intermediate_size": 5120, "num_hidden_layers": 64, "state_size": 16, "expand": 2, "conv_kernel": 4,
        "time_step_rank": 160, "vocab_size": 50280, "layer_norm_epsilon": 1e-5, "use_bias": False,
        "use_conv_bias": True, "residual_in_fp32": True, "tie_word_embeddings": True,
    },
    # Mamba-2 2.7B (state-spaces/mamba2-2.7b): 64 Mamba-2 blocks (SSD: 80 heads of 64, state 128, one group,
    # chunks of 256), no attention; planned at seq 2048.
    "state-spaces/mamba2-2.7b": {
        "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 2560,
        "num_hidden_layers": 64, "expand": 2, "head_dim": 64, "num_heads": 80, "state_size": 128, "n_groups": 1,
        "chunk_size": 256, "conv_kernel": 4, "vocab_size": 50280, "layer_norm_epsilon": 1e-5, "use_bias": False,
        "use_conv_bias": True, "residual_in_fp32": True, "rms_norm": True, "tie_word_embeddings": True,
    },
}

# Models whose inputs are not token ids (the `hf:` source's example inputs): model files that build the
# transformers class from a config written the same way, with training settings (no cache, sdpa attention).
HF_FILE = '''"""{doc} (published sizes, built from its config on meta by the planner)."""

import torch
import torch.nn.functional as F
import transformers

CONFIG = {config!r}
{body}

def build_model(**_):
    config = transformers.{config_class}(**CONFIG)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return {model_class}._from_config(config)
'''

WHISPER = '''

class SpeechToText(transformers.WhisperForConditionalGeneration):
    """Whisper called as its training step calls it: mel features and the decoder's tokens, by position."""

    def forward(self, mel, tokens):
        return super().forward(input_features=mel, decoder_input_ids=tokens)


def example_inputs(batch_size, **_):
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(batch_size, CONFIG["num_mel_bins"], 2 * CONFIG["max_source_positions"], generator=g)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch_size, CONFIG["max_target_positions"]), generator=g)
    return mel, tokens


def loss_fn(output, mel, tokens):
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
'''

CLIP = '''

def example_inputs(batch_size, **_):
    g = torch.Generator().manual_seed(0)
    vision, text = CONFIG["vision_config"], CONFIG["text_config"]
    size = vision["image_size"]
    ids = torch.randint(0, text["vocab_size"], (batch_size, text["max_position_embeddings"]), generator=g)
    return ids, torch.randn(batch_size, vision["num_channels"], size, size, generator=g)


def loss_fn(output, ids, pixels):
    logits = output.logits_per_image.float()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
'''

FILES = {
    # openai/whisper-large-v3: 32 + 32 layers of width 1280, 128 mel bins over 30 s (3000 frames), 448 tokens.
    "openai/whisper-large-v3": dict(
        doc="Whisper large-v3", config_class="WhisperConfig", model_class="SpeechToText", body=WHISPER, config={
            "d_model": 1280, "encoder_layers": 32, "decoder_layers": 32, "encoder_attention_heads": 20,
            "decoder_attention_heads": 20, "encoder_ffn_dim": 5120, "decoder_ffn_dim": 5120, "num_mel_bins": 128,
            "vocab_size": 51866, "max_source_positions": 1500, "max_target_positions": 448,
            "tie_word_embeddings": True,
        },
    ),
    # openai/clip-vit-large-patch14: a ViT-L/14 image tower (24 layers, width 1024, 224 px) and a 12-layer text
    # tower (width 768, 77 tokens), both projected to 768, a learned temperature.
    "openai/clip-vit-large-patch14": dict(
        doc="CLIP ViT-L/14", config_class="CLIPConfig", model_class="transformers.CLIPModel", body=CLIP, config={
            "projection_dim": 768,
            "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "max_position_embeddings": 77, "vocab_size": 49408,
                            "projection_dim": 768},
            "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                              "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "num_channels": 3,
                              "projection_dim": 768},
        },
    ),
}

# What each model is planned with, where not the default (seq 4096 on 8 nodes of 8 H100s).
SEQ = {"state-spaces/mamba-2.8b-hf": 2048, "state-spaces/mamba2-2.7b": 2048}
NODES = {"deepseek-ai/DeepSeek-V3": 64}
BUDGET_S = 5.0  # issue 27: each cold plan within this on the development machine


MOE = (
    "mistralai/Mixtral-8x7B-v0.1", "deepseek-ai/DeepSeek-V2-Lite", "Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen3-30B-A3B",
    "deepseek-ai/DeepSeek-V3", "torchtitan:deepseek_v3",
)


def search_only(cfg: str, name: str, ep: str) -> None:
    """Child process: the search and the Plan without the plan-time check (planner.pipeline through the CLI's
    request builder), the plan document on stdout. For a model whose check fails for a reason of its own.
    `cfg`: the HF config's path, or a torchtitan source's flavor."""
    from planner.cli._options import DType, plan_request
    from planner.cli.plan import run_search

    titan = name.startswith("torchtitan:")
    request = plan_request(
        Path(name if titan else f"hf:{name}"), [f"seq={SEQ.get(name, 4096)}"], gpu="h100-sxm-80gb",
        nodes=NODES.get(name, 8), gpus_per_node=None,
        global_batch_size=512, dp=None, tp=None, pp=None, virtual_stages=None, micro_batch_size=None, schedule=None,
        zero_stage=None, recompute=None, sequence_parallel=None, dtype=DType.bf16, build_fn="build_model",
        inputs_fn="example_inputs", loss_fn=None, top_k=5, time_limit=None, no_overlap=False, seed=0, lr=1e-4,
        steps=10, hf_config=None if titan else Path(cfg), flavor=cfg if titan else None,
        ep=int(ep) if ep != "-" else None,
    )
    plan, _, _ = run_search(request, show_progress=False)
    sys.stdout.write(plan.model_dump_json())


def describe(name: str, p: dict, wall: float, how: str, torch_s: float | None = None) -> None:
    par, pred = p["parallel"], p["predicted"]
    ratio = f" = {wall / torch_s:.1f} x import torch ({torch_s:.2f} s)" if torch_s else ""
    print(
        f"{name} [{how}]: {p['total_params'] / 1e9:.1f}B parameters, planned in {wall:.1f} s{ratio} "
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
    for r in p["rejected"] if EP_SEARCH else ():
        if "ep" in r.get("region", ""):
            print(f"  rejected {r['region']}: {r['reason']} ({r.get('count', 1)})")


TIMES: dict[str, tuple[float, float, bool]] = {}  # name -> (plan s, import torch s, planned)
WARM = False  # --warm: time a re-plan from the analysis cache
EP_SEARCH = False  # --ep-search: MoE models' search alone, ep searched and ep pinned to 1
REPEAT = 1  # --repeat N: each model planned N times (fresh processes), the median reported
SPREAD: dict[str, tuple[float, float]] = {}  # name -> (least, most) plan s over the repeats
FLOORS: dict[str, float] = {}  # name -> median s of importing torch and the model's library alone (floor_s)
OWN: dict[str, float] = {}  # name -> median s of each plan less the floor measured just before it


def import_torch_s() -> float:
    """Seconds `python -c "import torch"` takes in a fresh process now: the unit the plan times are given in."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], cwd=ROOT, check=True)
    return time.perf_counter() - start


def floor_code(name: str, config: dict | str) -> str:
    """What a plan of `name` must import of other people's code, as a program: torch and the model's own library
    (transformers and its class for the model; torchtitan's model package), imported as `planner` imports them
    (no cyclic collection meanwhile: planner.processes.defer_collection) and ended as `planner` ends (os._exit
    after its output: no interpreter teardown, which takes about a second after transformers)."""
    if isinstance(config, dict):
        what = f"import transformers; transformers.{config['architectures'][0]}"
    elif name in FILES:
        what = f"import transformers; transformers.{FILES[name]['config_class'].replace('Config', 'Model')}"
    else:  # a torchtitan flavor
        what = f"import importlib; importlib.import_module('torchtitan.models.{name.split(':', 1)[1]}')"
    return f"import gc; gc.disable(); import os, torch; {what}; os._exit(0)"


def floor_s(name: str, config: dict | str) -> float:
    """Seconds the imports of `floor_code` take in a fresh process now: the part of a plan's time that is
    torch's and the model library's, which no planner can spend less on."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", floor_code(name, config)], cwd=ROOT, check=True)
    return time.perf_counter() - start

# torchtitan's own registry (torchtitan:MODEL --flavor NAME), built on meta; skipped without the titan extra.
TITAN = {"torchtitan:llama3": "70B", "torchtitan:deepseek_v3": "16B"}


def plan(name: str, config: dict | str, work: Path) -> None:
    cfg = work / name.replace("/", "--").replace(":", "-") / "config.json"
    cfg.parent.mkdir(parents=True)
    out = cfg.parent / "plan"
    if name in FILES:  # a model file that builds the transformers class
        model_file = cfg.with_name("model.py")
        model_file.write_text(HF_FILE.format(**FILES[name]))
        source = [str(model_file)]
    elif isinstance(config, str):  # a torchtitan flavor
        source = [name, "--flavor", config]
    else:
        cfg.write_text(json.dumps(config, indent=2))
        source = [f"hf:{name}", "--hf-config", str(cfg)]
    cmd = [sys.executable, "-m", "planner.cli.main", "plan", *source, "--model-arg", f"seq={SEQ.get(name, 4096)}",
           "--gpu", "h100-sxm-80gb", "--nodes", str(NODES.get(name, 8)), "--global-batch-size", "512",
           "--out", str(out), "--json"]
    env = {**os.environ, "PLANNER_NO_CACHE": "0" if WARM else "1"}
    if WARM:  # prime the analysis cache and the remembered check, then time a re-plan
        subprocess.run([*cmd, "--force"], cwd=ROOT, capture_output=True, text=True, env=env)
    walls, torches, floors = [], [], []
    for _ in range(REPEAT):  # each a fresh process; the median is reported (this machine's timings wander)
        torches.append(import_torch_s())
        floors.append(floor_s(name, config))
        start = time.perf_counter()
        done = subprocess.run([*cmd, "--force"], cwd=ROOT, capture_output=True, text=True, env=env)
        walls.append(time.perf_counter() - start)
        if done.returncode != 0:
            break
    wall, torch_s = statistics.median(walls), statistics.median(torches)
    FLOORS[name] = statistics.median(floors)
    OWN[name] = statistics.median(w - f for w, f in zip(walls, floors, strict=True))
    SPREAD[name] = (min(walls), max(walls))
    if done.returncode == 0:
        describe(name, json.loads(done.stdout), wall, "planner plan", torch_s)
    else:
        print(f"{name}: planner plan failed after {wall:.1f} s = {wall / torch_s:.1f} x import torch ({torch_s:.2f} s):"
              f" {done.stderr.strip()[-300:]}")
    TIMES[name] = (wall, torch_s, done.returncode == 0)
    # MoE models: the search alone (no plan-time check), with ep searched and with ep pinned to 1.
    for ep in ("-", "1") if name in MOE and EP_SEARCH and name not in FILES else ():
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

    global WARM, EP_SEARCH, REPEAT
    WARM = "--warm" in sys.argv
    EP_SEARCH = "--ep-search" in sys.argv
    args = sys.argv[1:]
    if "--repeat" in args:
        at = args.index("--repeat")
        REPEAT = int(args[at + 1])
        del args[at : at + 2]
    only = [a for a in args if a not in ("--warm", "--ep-search")]
    models: dict[str, dict | str] = {**CONFIGS, **{name: "" for name in FILES}}
    if importlib.util.find_spec("torchtitan") is not None:
        models.update(TITAN)
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in models.items():
            if only and not any(word in name for word in only):
                continue
            plan(name, config, Path(tmp))
    runs = f", median of {REPEAT} cold plans (min..max)" if REPEAT > 1 else ""
    print(f"\n{'model':34} {'plan s':>7} {'import torch s':>15} {'ratio':>6} {'imports s':>10} {'planner s':>10}"
          f"  within {BUDGET_S:g} s{runs}")
    for name, (wall, torch_s, ok) in TIMES.items():
        verdict = ("yes" if wall <= BUDGET_S else "no") if ok else "failed"
        lo, hi = SPREAD.get(name, (wall, wall))
        spread = f"  ({lo:.1f}..{hi:.1f})" if REPEAT > 1 else ""
        print(f"{name:34} {wall:7.1f} {torch_s:15.2f} {wall / torch_s:6.1f} {FLOORS[name]:10.2f} {OWN[name]:10.2f}"
              f"  {verdict}{spread}")
    print("imports s: a fresh process that imports torch and the model's library (its class) and ends as planner "
          "does; planner s: each plan less the imports measured just before it (median)")


if __name__ == "__main__":
    main()
