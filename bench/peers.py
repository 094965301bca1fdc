"""The planner beside peer estimators on the published runs of bench/published_runs.yaml.

Usage:
    python bench/peers.py               # every run: planner, llm-analysis; distributions on validation rows
    python bench/peers.py --rows mpt-h100-7b-128,bloom-176b-384

Peers:
- llm-analysis (github:cli99/llm-analysis, PyPI `llm-analysis`, optional: `pip install llm-analysis`; its pins
  on transformers / huggingface_hub are older than ours, its `train` runs with the newer ones). It takes the
  efficiencies as inputs rather than predicting them: it is given the planner's own spec efficiencies for the
  run's GPU (matmul as flops_efficiency, memory as hbm_memory_efficiency, network as the intra- and inter-node
  efficiencies), so the comparison is between the two models of time, not between two fits. Rows it cannot
  express are listed with the reason (interleaved schedules: it has no virtual stages).
- Calculon (github:calculon-ai/calculon) is not run here: it is not on PyPI and this bench does not vendor it.

Each run is planned with its published layout pinned (bench/published_runs.plan_run); the published figure is
an iteration time as in bench/accuracy.py. Distributions are printed on the validation rows only (the rows no
efficiency was fitted on), without the rows flagged `unsupported` (FP8, torch.compile).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from dataclasses import dataclass

from accuracy import percentile
from published_runs import Run, load_runs, plan_run, predicted_iteration_s, run_cluster

from planner.errors import InfeasibleError

# the runs' GPU names -> llm-analysis's GPU configs
LLM_ANALYSIS_GPU = {
    "dgx-a100": "a100-sxm-80gb",
    "a100-sxm4-80gb": "a100-sxm-80gb",
    "a100-sxm4-40gb": "a100-sxm-40gb",
    "dgx-h100": "h100-sxm-80gb",
    "h100-sxm5-80gb": "h100-sxm-80gb",
}
RECOMPUTE = {"none": 0, "selective": 1, "full": 2}  # llm-analysis ActivationRecomputation


@dataclass
class Row:
    run: Run
    planner_s: float | None
    planner_why: str
    peer_s: float | None
    peer_why: str

    def error(self, s: float | None) -> float | None:
        return None if s is None else s / self.run.published_iteration_s - 1


def llm_analysis_iteration_s(run: Run) -> tuple[float | None, str]:
    """llm-analysis's `train` latency per iteration for the run, or None and why it cannot say."""
    try:
        from llm_analysis import config
        from llm_analysis.analysis import train
    except ImportError as e:  # optional peer
        return None, f"llm-analysis not installed ({e.name}); pip install llm-analysis"
    lay, c = run.layout, run.config
    if lay.v > 1:
        return None, "interleaved schedule: llm-analysis has no virtual stages"
    gpu = LLM_ANALYSIS_GPU.get(run.gpu)
    if gpu is None:
        return None, f"no llm-analysis GPU config for {run.gpu}"
    name = f"planner-bench-{run.id}"
    try:
        config.model_configs[name] = config.ModelConfig(
            name=name,
            num_layers=c.layers,
            n_head=c.heads,
            hidden_dim=c.hidden,
            vocab_size=c.vocab,
            max_seq_len=c.seq,
            num_key_value_heads=c.kv_heads or c.heads,
            ffn_embed_dim=c.ffn or 4 * c.hidden,
        )
    except AssertionError as e:  # its model schema's own checks
        return None, f"llm-analysis cannot express the model: {e}"
    eff = run_cluster(run).gpu.efficiency
    logging.getLogger("llm_analysis").setLevel(logging.ERROR)
    out = train(
        model_name=name,
        gpu_name=gpu,
        dtype_name="w16a16e16",
        log_level="ERROR",
        batch_size_per_gpu=lay.mbs,
        global_batch_size=lay.global_batch,
        seq_len=c.seq,
        activation_recomputation=RECOMPUTE[lay.recompute],
        ds_zero=lay.zero,
        tp_size=lay.tp,
        pp_size=lay.pp,
        sp_size=lay.tp if lay.sp else 1,
        total_num_gpus=run.gpus,
        flops_efficiency=eff.matmul,
        hbm_memory_efficiency=eff.memory,
        intra_node_memory_efficiency=eff.network,
        inter_node_memory_efficiency=eff.network,
        mlp_gated_linear_units=run.model == "llama",
        flash_attn=run.model_args.get("attention", "sdpa") != "math",
    )
    return float(out["latency_per_iter"]), ""


def planner_iteration_s(run: Run, graphs: dict) -> tuple[float | None, str]:
    try:
        plan, _ = plan_run(run, graphs)
    except InfeasibleError as e:
        return None, "refused: " + str(e).split(". ")[0]
    return predicted_iteration_s(run, plan), ""


def _cells(row: Row, s: float | None) -> tuple[str, str]:
    e = row.error(s)
    return ("-", "-") if s is None or e is None else (f"{s:.3f}", f"{100 * e:+.1f}")


def distribution(errors: list[float | None]) -> str:
    errs = [abs(e) for e in errors if e is not None]
    missing = sum(e is None for e in errors)
    if not errs:
        return f"no predictions ({missing} without)"
    return (
        f"n={len(errs)}: median {100 * statistics.median(errs):.1f}%, p90 {100 * percentile(errs, 0.9):.1f}%, "
        f"worst {100 * max(errs):.1f}%" + (f"; {missing} without a prediction" if missing else "")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated run ids (default: all)")
    args = ap.parse_args(argv)
    runs = load_runs().runs
    if args.rows:
        wanted = {r.strip() for r in args.rows.split(",")}
        runs = [r for r in runs if r.id in wanted]
        if not runs:
            raise SystemExit(f"--rows: none of {args.rows!r} is a run id of bench/published_runs.yaml")
    graphs: dict = {}
    rows = []
    for run in runs:
        ps, pw = planner_iteration_s(run, graphs)
        qs, qw = llm_analysis_iteration_s(run)
        rows.append(Row(run, ps, pw, qs, qw))
    head = f"{'run':<36} {'role':<4} {'publ s':>8} {'planner s':>9} {'err %':>7} {'llm-an. s':>9} {'err %':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        (ps, pe), (qs, qe) = _cells(r, r.planner_s), _cells(r, r.peer_s)
        role = "fit" if r.run.role == "fit" else "val"
        flag = " !" if r.run.unsupported else ""
        print(f"{r.run.id:<36} {role:<4} {r.run.published_iteration_s:>8.3f} {ps:>9} {pe:>7} {qs:>9} {qe:>7}{flag}")
    print()
    for r in rows:
        for who, why in (("planner", r.planner_why), ("llm-analysis", r.peer_why)):
            if why:
                print(f"  {r.run.id}: {who}: {why}")
    val = [r for r in rows if r.run.role == "validation" and not r.run.unsupported]
    print(f"\nValidation rows without unsupported features ({len(val)}), |predicted / published - 1|:")
    print(f"  planner      {distribution([r.error(r.planner_s) for r in val])}")
    print(f"  llm-analysis {distribution([r.error(r.peer_s) for r in val])}")
    both = [r for r in val if r.planner_s is not None and r.peer_s is not None]
    print(f"  on the {len(both)} rows both predict:")
    print(f"    planner      {distribution([r.error(r.planner_s) for r in both])}")
    print(f"    llm-analysis {distribution([r.error(r.peer_s) for r in both])}")
    print("  Calculon: not run (not on PyPI; this bench does not vendor its repository)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
