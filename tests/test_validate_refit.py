"""planner validate --refit: the bounded least-squares fit, the plan's terms read off the cost model, and the
whole command on 4 CPU ranks (gloo), where a deliberately wrong spec is refit from the run's own timings.

The CUDA path of the probe (CUDA events) is not run here: no GPU in CI; it is code-reviewed only."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from planner.cli.main import app
from planner.cost.candidate import Candidate
from planner.hardware.load import load_cluster, load_spec, specs_dir
from planner.hardware.spec import Efficiencies
from planner.measure.refit import (
    Term,
    box_least_squares,
    fit_efficiencies,
    measured_terms,
    plan_terms,
    refit_yaml,
    with_efficiency,
)
from planner.pipeline import PlanRequest, analyse

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "sample_models" / "gpt.py"
TINY = {"layers": 4, "hidden": 64, "seq": 32, "vocab": 256}
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


# ------------------------------------------------------------------------------------------ the fit


def test_box_least_squares_matches_a_dense_grid():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, (8, 2))
    b = a @ np.array([0.5, 3.0]) + rng.normal(0, 0.05, 8)  # x0 = 0.5 lies below the bound 1
    lower, upper = np.ones(2), np.full(2, 10.0)
    x = box_least_squares(a, b, lower, upper)
    grid = [(u, v) for u in np.linspace(1, 10, 181) for v in np.linspace(1, 10, 181)]
    best = min(grid, key=lambda p: float(np.sum((a @ np.array(p) - b) ** 2)))
    assert x[0] == pytest.approx(1.0)  # held at the bound
    assert np.sum((a @ x - b) ** 2) <= np.sum((a @ np.array(best) - b) ** 2) + 1e-12
    assert x[1] == pytest.approx(best[1], abs=0.06)


@functools.cache
def _tiny_graph():
    return analyse(PlanRequest(model_path=str(GPT), model_args=TINY, gpu="cpu", global_batch_size=8), cache=False)


def _tiny_plan_terms(eff: Efficiencies):
    graph = _tiny_graph()
    cluster = with_efficiency(load_cluster("cpu", 1, 4), eff)
    cand = Candidate(2, 1, 2, 1, 2, 2, "1f1b", 0, False)
    n = len(graph.units)
    partition = [list(range(n // 2)), list(range(n // 2, n))]
    return graph, cluster, cand, partition, plan_terms(graph, cluster, cand, partition, ["none", "none"])


def test_plan_terms_are_the_cost_models_figures_at_any_efficiency():
    from planner.cost.candidate import CostOptions
    from planner.cost.model import stage_costs, unit_cost

    base = load_spec("cpu").efficiency
    graph, cluster, cand, partition, expected = _tiny_plan_terms(base)
    other = Efficiencies(matmul=0.1, attention=0.3, memory=0.05, network=0.2, gemm_half_dim=base.gemm_half_dim)
    cl = with_efficiency(cluster, other)
    costs = [unit_cost(u, cand, cl, graph.source.dtype) for u in graph.units]
    stages = stage_costs(graph, cl, cand, partition, ["none", "none"], costs, CostOptions())
    by_name = {e.name: e for e in expected}
    for st in stages:
        for kind, value in (("forward", st.fwd), ("backward", st.bwd)):
            e = by_name[f"stage {st.index} {kind}"]
            got = e.const + sum(c / getattr(other, k) for k, c in e.coef.items())
            assert got == pytest.approx(value, rel=1e-9)
    kinds = {e.kind for e in expected}
    assert kinds == {"forward", "backward", "p2p", "all_reduce"}  # ZeRO-0 dp sync: one all-reduce per stage


def test_refit_moves_wrong_efficiencies_to_the_truth():
    """Measurements made by a known 'true' spec (plus a few % of deterministic noise); the fit starts from
    a spec that is wrong by 10x and lands within 10% of the truth, and predicts the terms better."""
    truth = Efficiencies(matmul=0.04, attention=0.3, memory=0.2, network=0.1, gemm_half_dim=256.0)
    wrong = Efficiencies(matmul=0.4, attention=0.3, memory=0.9, network=0.9, gemm_half_dim=256.0)
    *_, expected = _tiny_plan_terms(wrong)
    noise = [1.03, 0.97, 1.02, 0.99, 1.01, 0.98, 1.0, 1.02]
    terms = []
    for i, e in enumerate(expected):
        true_time = e.const + sum(c / getattr(truth, k) for k, c in e.coef.items())
        terms.append(Term(e.name, e.kind, true_time * noise[i % len(noise)], 5, e.const, e.coef, e.stage))
    fit = fit_efficiencies(wrong, terms)
    for key in ("matmul", "network"):
        assert key in fit.fitted
        assert getattr(fit.efficiency, key) == pytest.approx(getattr(truth, key), rel=0.10), key
    assert fit.error(fit.efficiency) < 0.05 < fit.error(wrong)
    assert fit.efficiency.attention == wrong.attention and "attention" in fit.kept  # too small a share to fit


def test_fitted_efficiencies_stay_within_bounds():
    # measured faster than any efficiency <= 1 allows: clamped at 1, not above
    term = Term("stage 0 forward", "forward", 0.5, 3, 0.0, {"matmul": 1.0, "attention": 0.0, "memory": 0.0,
                                                             "network": 0.0})
    fit = fit_efficiencies(Efficiencies(matmul=0.5), [term])
    assert fit.efficiency.matmul == 1.0


def test_refit_yaml_loads_and_says_where_each_number_came_from(tmp_path):
    base_text = (specs_dir() / "h100-sxm5-80gb.yaml").read_text()
    base = load_spec("h100-sxm5-80gb").efficiency
    term = Term("stage 0 forward", "forward", 2.0, 7, 0.0, {"matmul": 1.0, "attention": 0.0, "memory": 0.0,
                                                           "network": 0.0})
    fit = fit_efficiencies(base, [term])
    text = refit_yaml(base_text, fit, "h100-refit", "planner validate run --refit; note: 2026-12-03")
    path = tmp_path / "h100-refit.yaml"
    path.write_text(text)
    spec = load_spec(path)
    assert spec.name == "h100-refit" and spec.efficiency.matmul == pytest.approx(0.5)
    assert spec.peak_tflops == load_spec("h100-sxm5-80gb").peak_tflops
    lines = text.split("\nefficiency:", 1)[1].split("\nsources:")[0].strip().splitlines()[1:]
    assert len(lines) == 5 and all("# source:" in line for line in lines)
    assert "fitted, least squares over 1 measured terms" in next(x for x in lines if "matmul" in x)
    assert "2026-12-03" in spec.sources["efficiency"]


def test_measured_terms_take_the_median_over_ranks():
    *_, expected = _tiny_plan_terms(load_spec("cpu").efficiency)
    docs = [{"compute": {"forward:0": [1.0, 3.0]}, "collectives": {}}, {"compute": {"forward:0": [2.0]}}]
    (term,) = [t for t in measured_terms(expected, docs) if t.kind == "forward"]
    assert term.measured_s == 2.0 and term.samples == 3


def test_refit_options_need_refit(tmp_path):
    res = invoke("validate", tmp_path, "--out", tmp_path / "x.yaml")
    assert res.exit_code == 2


# ------------------------------------------------------------------------------- the whole command


@pytest.fixture(scope="module")
def refit_run(tmp_path_factory):
    """One 4-rank gloo run of a tiny GPT planned pp2 x dp2, refit from a deliberately wrong CPU spec."""
    tmp = tmp_path_factory.mktemp("refit")
    wrong = yaml.safe_load((specs_dir() / "cpu.yaml").read_text())
    wrong.update(name="cpu-wrong", aliases=[])
    # 0.9 of peak for every op and link: far faster than a shared CPU runs a tiny model with gloo
    wrong["efficiency"] = {"matmul": 0.9, "attention": 0.9, "memory": 0.9, "network": 0.9, "gemm_half_dim": 256}
    wrong_path = tmp / "cpu-wrong.yaml"
    wrong_path.write_text(yaml.safe_dump(wrong))
    plan_dir = tmp / "plan"
    args = [f"--model-arg={k}={v}" for k, v in TINY.items()]
    res = invoke("plan", GPT, *args, "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4",
                 "--global-batch-size", "12", "--pp", "2", "--dp", "2", "--micro-batch-size", "2",
                 "--schedule", "1f1b", "--out", plan_dir, "--quiet")
    assert res.exit_code == 0, res.output
    out = tmp / "refit.yaml"
    res = invoke("validate", plan_dir, "--refit", "--steps", "3", "--gpu", wrong_path, "--out", out,
                 "--note", "test run", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), out, wrong_path, plan_dir


def test_refit_from_a_run_moves_the_wrong_efficiency_and_predicts_the_run_better(refit_run):
    doc, out, wrong_path, plan_dir = refit_run
    kinds = {t["kind"] for t in doc["terms"]}
    assert {"forward", "backward", "p2p"} <= kinds and kinds & {"all_reduce", "reduce_scatter"}
    stages = {t["stage"] for t in doc["terms"] if t["kind"] == "forward"}
    assert stages == {0, 1}
    assert all(t["measured_s"] > 0 and t["samples"] >= 1 for t in doc["terms"])
    # The wrong spec predicts every term far too fast. The collectives depend on the network efficiency
    # alone (tp 1), so it is identified however noisy the machine: the refit pulls it far down. matmul and
    # memory share the stage terms of a model this small (both scale with the stage), so only their joint
    # effect is checked: the stage terms' predictions improve.
    assert doc["rms_error_before"] > 0.5
    assert "network" in doc["fitted"] and doc["efficiency"]["network"] < 0.5 * doc["base_efficiency"]["network"]
    assert doc["rms_error_after"] < 0.8 * doc["rms_error_before"]  # 0.3-0.65x measured, 0.65 with 12 ranks on 2 cores
    compute = [t for t in doc["terms"] if t["kind"] in ("forward", "backward")]

    def err(key):
        return sum(abs(t[key] / t["measured_s"] - 1) for t in compute)

    assert err("refit_predicted_s") < 0.8 * err("predicted_s")
    # the written spec, loaded from its file, predicts the same run's terms better than the wrong one
    refit_spec, wrong_spec = load_spec(out), load_spec(wrong_path)
    assert refit_spec.name == "cpu-wrong-refit"

    def rms(spec):
        by_name = {e.name: e for e in _plan_terms_for(plan_dir, spec)}
        errs = []
        for t in doc["terms"]:
            e = by_name[t["term"]]
            pred = e.const + sum(c / getattr(spec.efficiency, k) for k, c in e.coef.items())
            errs.append(pred / t["measured_s"] - 1)
        return math.sqrt(sum(x * x for x in errs) / len(errs))

    assert rms(refit_spec) < 0.8 * rms(wrong_spec)
    assert "test run" in refit_spec.sources["efficiency"] and "--refit" in refit_spec.sources["efficiency"]


def _plan_terms_for(plan_dir: Path, spec):
    from planner.plan import load_plan

    plan = load_plan(plan_dir)
    graph = analyse(PlanRequest(model_path=plan.model.path, model_args=plan.model.model_args, gpu="cpu",
                                global_batch_size=plan.parallel.global_batch_size), cache=False)
    index = {u.name: i for i, u in enumerate(graph.units)}
    p = plan.parallel
    cand = Candidate(p.dp, p.tp, p.pp, p.virtual_stages, p.micro_batch_size, p.num_micro_batches, p.schedule,
                     p.zero_stage, p.sequence_parallel)
    cluster = with_efficiency(load_cluster("cpu", 1, 4), spec.efficiency)
    partition = [[index[u] for u in s.units] for s in plan.stages]
    return plan_terms(graph, cluster, cand, partition, [s.recompute for s in plan.stages])


def test_refit_table_is_printed():
    from rich.console import Console

    from planner.cli.validate import RefitResult

    base = Efficiencies(matmul=0.5)
    coef = {"matmul": 1.0, "attention": 0.0, "memory": 0.0, "network": 0.0}
    terms = [Term("stage 0 forward", "forward", 4.0, 6, 0.0, coef, 0),
             Term("dp all-reduce 1 MiB (stage 0)", "all_reduce", 4.0, 2, 0.0, coef, 0)]
    console = Console(record=True, width=200)
    RefitResult(fit_efficiencies(base, terms), Path("r.yaml"), "cpu", "cpu").print(console)
    text = console.export_text()
    for needle in ("stage 0 forward", "predicted ms", "measured ms", "refit error", "perf_counter, median of 6",
                   "re-run on the run's group", "matmul 0.5 -> 0.25", "rms error 50.0% -> 0.0%", "wrote r.yaml"):
        assert needle in text, needle


def test_physical_bounds_cap_a_fit_and_say_which_efficiency_sits_on_its_bound():
    """bench/fit_published.py fits within PHYSICAL_MAX: a measurement faster than any physical efficiency
    allows leaves the efficiency on its bound, listed in `at_bound` (it absorbs another term's error)."""
    from planner.measure.refit import PHYSICAL_MAX

    term = Term("stage 0 forward", "forward", 0.5, 3, 0.0, {"matmul": 1.0, "attention": 0.0, "memory": 0.0,
                                                             "network": 0.0})
    fit = fit_efficiencies(Efficiencies(matmul=0.5), [term], upper=PHYSICAL_MAX)
    assert fit.efficiency.matmul == PHYSICAL_MAX["matmul"] and fit.at_bound == ["matmul"]
    inside = Term("stage 0 forward", "forward", 1.25, 3, 0.0, {"matmul": 0.5, "attention": 0.0, "memory": 0.0,
                                                                "network": 0.0})
    fit = fit_efficiencies(Efficiencies(matmul=0.5), [inside], upper=PHYSICAL_MAX)
    assert fit.efficiency.matmul == pytest.approx(0.4) and fit.at_bound == []
