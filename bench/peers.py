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
- Calculon (github:calculon-ai/calculon), with `--calculon DIR` naming a checkout of its repository (it is not
  on PyPI; nothing of it is vendored here): its own model of time with its own system files (a100_80g.json,
  h100_80g_nvl8.json), not given the planner's efficiencies. It expresses dense GPT rows with tp / pp /
  interleaving / dp and ZeRO-1 (optimizer_sharding); not ZeRO-2/3 (FSDP), grouped-query attention or SwiGLU.

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
from published_runs import NotExpressible, Run, load_runs, plan_run, predicted_iteration_s, run_cluster

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
    calc_s: float | None = None
    calc_why: str = ""

    def error(self, s: float | None) -> float | None:
        return None if s is None else s / self.run.published_iteration_s - 1


def llm_analysis_iteration_s(run: Run) -> tuple[float | None, str]:
    """llm-analysis's `train` latency per iteration for the run, or None and why it cannot say."""
    try:
        from llm_analysis import config
        from llm_analysis.analysis import train
    except ImportError as e:  # optional peer
        return None, f"llm-analysis not installed ({e.name}); pip install llm-analysis"
    if run.config is None:
        return None, "mixture of experts: bench/peers.py does not pass llm-analysis its expert options"
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


CALCULON_SYSTEM = {
    "dgx-a100": "a100_80g.json",
    "a100-sxm4-80gb": "a100_80g.json",
    "dgx-h100": "h100_80g_nvl8.json",
    "h100-sxm5-80gb": "h100_80g_nvl8.json",
}
CALCULON_RECOMPUTE = {"none": "none", "selective": "attn_only", "full": "full"}


def calculon_iteration_s(run: Run, checkout: str | None) -> tuple[float | None, str]:
    """Calculon's iteration time for the run (its `llm` command's total_time), or None and why."""
    if checkout is None:
        return None, "Calculon not run: pass --calculon DIR (a checkout of github:calculon-ai/calculon)"
    lay, c = run.layout, run.config
    if run.model != "gpt" or c is None:
        return None, "Calculon has no grouped-query attention, SwiGLU or mixture of experts"
    if lay.zero >= 2:
        return None, f"ZeRO-{lay.zero}: Calculon shards the optimizer only (ZeRO-1)"
    system = CALCULON_SYSTEM.get(run.gpu)
    if system is None:
        return None, f"no Calculon system file for {run.gpu}"
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    try:
        import calculon  # type: ignore[import-not-found]
        from calculon.llm import Llm  # type: ignore[import-not-found]
    except ImportError as e:  # its own dependencies (pandas, ...)
        return None, f"Calculon cannot be imported ({e.name} missing)"

    app = Llm.Application(
        {
            "hidden": c.hidden,
            "feedforward": c.ffn or 4 * c.hidden,
            "seq_size": c.seq,
            "attn_heads": c.heads,
            "attn_size": c.hidden // c.heads,
            "num_blocks": c.layers,
        }
    )
    exe_json = (
        {
            "num_procs": run.gpus,
            "tensor_par": lay.tp,
            "pipeline_par": lay.pp,
            "data_par": run.dp,
            "tensor_par_net": 0,
            "pipeline_par_net": 1,
            "data_par_net": 1,
            "batch_size": lay.global_batch,
            "microbatch_size": lay.mbs,
            "datatype": "float16",
            "fused_activation": True,
            "attention_type": "multihead",
            "activation_recompute": CALCULON_RECOMPUTE[lay.recompute],
            "pipeline_interleaving": lay.v,
            "optimizer_sharding": lay.zero == 1,
            "tensor_par_comm_type": "rs_ag" if lay.sp else "ar",
            "tensor_par_overlap": "none",
            "seq_par_ag_redo": False,
            "data_par_overlap": lay.overlap_dp_comm and run.dp > 1,
            "weight_offload": False,
            "activations_offload": False,
            "optimizer_offload": False,
            "training": True,
        }
    )
    try:
        exe = Llm.Execution.from_json(exe_json)
    except AssertionError as e:  # its execution schema's own checks
        return None, f"Calculon cannot express the layout: {e}"
    syst = calculon.System(calculon.io.read_json_file(f"{checkout}/systems/{system}"))
    model = Llm(app, logging.getLogger("calculon"))
    try:
        model.compile(syst, exe)
        model.run(syst)
    except Llm.Error as e:
        return None, f"Calculon refuses the layout: {e}"
    return float(model.get_total_time()), ""


def planner_iteration_s(run: Run, graphs: dict) -> tuple[float | None, str]:
    try:
        plan, _ = plan_run(run, graphs)
    except NotExpressible as e:
        return None, str(e)
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
    ap.add_argument("--calculon", metavar="DIR", help="a checkout of github:calculon-ai/calculon to run beside")
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
        cs, cw = calculon_iteration_s(run, args.calculon)
        rows.append(Row(run, ps, pw, qs, qw, cs, cw))
    head = (
        f"{'run':<36} {'role':<4} {'publ s':>8} {'planner s':>9} {'err %':>7} {'llm-an. s':>9} {'err %':>7} "
        f"{'calculon s':>10} {'err %':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        (ps, pe), (qs, qe), (cs, ce) = _cells(r, r.planner_s), _cells(r, r.peer_s), _cells(r, r.calc_s)
        role = "fit" if r.run.role == "fit" else "val"
        flag = " !" if r.run.unsupported else ""
        print(
            f"{r.run.id:<36} {role:<4} {r.run.published_iteration_s:>8.3f} {ps:>9} {pe:>7} {qs:>9} {qe:>7} "
            f"{cs:>10} {ce:>7}{flag}"
        )
    print()
    for r in rows:
        for who, why in (("planner", r.planner_why), ("llm-analysis", r.peer_why), ("calculon", r.calc_why)):
            if why:
                print(f"  {r.run.id}: {who}: {why}")
    val = [r for r in rows if r.run.role == "validation" and not r.run.unsupported]
    print(f"\nValidation rows without unsupported features ({len(val)}), |predicted / published - 1|:")
    print(f"  planner      {distribution([r.error(r.planner_s) for r in val])}")
    print(f"  llm-analysis {distribution([r.error(r.peer_s) for r in val])}")
    print(f"  calculon     {distribution([r.error(r.calc_s) for r in val])}")
    for name, attr in (("llm-analysis", "peer_s"), ("calculon", "calc_s")):
        both = [r for r in val if r.planner_s is not None and getattr(r, attr) is not None]
        print(f"  on the {len(both)} rows both the planner and {name} predict:")
        print(f"    planner      {distribution([r.error(r.planner_s) for r in both])}")
        print(f"    {name:<12} {distribution([r.error(getattr(r, attr)) for r in both])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
