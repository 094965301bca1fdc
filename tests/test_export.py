"""`planner export PLAN --to torchtitan|megatron`: the plan in the frameworks' own names, checked against the
option lists extracted from their source (tests/fixtures/frameworks/, with the commits they come from), and
against the frameworks' own parsers where they install."""

from __future__ import annotations

import argparse
import json
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from e2e.plans import make_plan
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import ExportError
from planner.export import megatron, torchtitan
from planner.plan import Plan

FRAMEWORKS = Path(__file__).resolve().parent / "fixtures" / "frameworks"


def names(file: str) -> set[str]:
    return {line.strip() for line in (FRAMEWORKS / file).read_text().splitlines() if not line.startswith("#")}


def gpt(**kw) -> Plan:
    return make_plan("gpt", **kw).model_copy(update={"tokens_per_sample": 32})


def write(plan: Plan, tmp_path: Path) -> Path:
    (tmp_path / "plan.json").write_text(plan.to_json())
    return tmp_path


def test_the_fixtures_name_their_source_commits():
    sources = {"torchtitan_options.txt": "pytorch/torchtitan", "megatron_options.txt": "NVIDIA/Megatron-LM"}
    for file, repo in sources.items():
        head = (FRAMEWORKS / file).read_text().splitlines()[0].split()
        assert head[1] == repo and len(head[2].rstrip(":")) == 40


@pytest.mark.parametrize(
    "plan",
    [
        gpt(pp=2, dp=2, zero_stage=1, recompute="full"),
        gpt(pp=2, virtual_stages=2, schedule="interleaved-1f1b", tp=2, sequence_parallel=True, num_micro_batches=4),
        gpt(dp=4, zero_stage=3, recompute="selective"),
    ],
    ids=["pp2_dp2_zero1_full", "pp2v2_tp2_sp", "dp4_zero3_selective"],
)
def test_torchtitan_export_sets_its_own_fields(plan, tmp_path):
    result = CliRunner().invoke(app, ["export", str(write(plan, tmp_path)), "--to", "torchtitan", "--quiet"])
    assert result.exit_code == 0, result.output
    module = runpy.run_path(str(tmp_path / "torchtitan_plan.py"))
    known = names("torchtitan_options.txt")
    flags = module["FLAGS"]
    options = [f[2:] for f in flags if f.startswith("--")]
    assert options and set(options) <= known, set(options) - known
    p = plan.parallel
    if plan.stages[0].recompute == "none":  # (otherwise apply_plan imports torchtitan's policy class)
        config = SimpleNamespace(parallelism=SimpleNamespace(), training=SimpleNamespace(), activation_checkpoint=0)
        assert module["apply_plan"](config) is config and config.activation_checkpoint is None
        assert config.parallelism.tensor_parallel_degree == p.tp and config.parallelism.enable_sequence_parallel
    settings = torchtitan.settings(plan)
    assert set(settings) <= known
    assert settings["parallelism.tensor_parallel_degree"] == p.tp
    assert settings["parallelism.pipeline_parallel_degree"] == p.pp
    dp = settings["parallelism.data_parallel_shard_degree"] * settings["parallelism.data_parallel_replicate_degree"]
    assert dp == p.dp
    assert settings["training.num_tokens_per_train_step"] == p.global_batch_size * 32
    if p.pp > 1:
        parts = settings["parallelism.module_fqns_per_model_part"]
        assert parts == [s.modules for s in sorted(plan.stages, key=lambda s: s.index)]
        assert json.loads(flags[flags.index("--parallelism.module_fqns_per_model_part") + 1]) == parts
    assert flags[0] == f"activation-checkpoint:{plan.stages[0].recompute}"
    out = subprocess.run([sys.executable, str(tmp_path / "torchtitan_plan.py")], capture_output=True, text=True)
    assert shlex.split(out.stdout) == flags


def test_megatron_export_uses_its_argument_names(tmp_path):
    plan = gpt(pp=2, virtual_stages=2, schedule="interleaved-1f1b", tp=2, sequence_parallel=True,
               num_micro_batches=4, zero_stage=1, recompute="full")
    result = CliRunner().invoke(app, ["export", str(write(plan, tmp_path)), "--to", "megatron", "--quiet"])
    assert result.exit_code == 0, result.output
    args = megatron.arguments(plan)
    assert {a for a in args if a.startswith("--")} <= names("megatron_options.txt")
    pairs = dict(zip(args, [*args[1:], ""], strict=True))
    assert pairs["--tensor-model-parallel-size"] == "2" and pairs["--pipeline-model-parallel-size"] == "2"
    assert pairs["--num-layers-per-virtual-pipeline-stage"] == "1" and pairs["--num-layers"] == "4"
    assert pairs["--global-batch-size"] == str(plan.parallel.global_batch_size)
    assert "--sequence-parallel" in args and "--use-distributed-optimizer" in args
    assert pairs["--recompute-granularity"] == "full"
    text = (tmp_path / "megatron_args.sh").read_text()
    script = f'source {tmp_path / "megatron_args.sh"}; printf "%s\\n" "${{PLANNED_ARGS[@]}}"'
    bash = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert bash.stdout.split("\n")[:-1] == args, text


def test_megatron_parser_takes_the_export():
    arguments = pytest.importorskip(
        "megatron.training.arguments", reason="Megatron-LM is not installed (its training package is not on PyPI)"
    )
    plan = gpt(pp=2, dp=2, zero_stage=1, recompute="selective")
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    parsed = parser.parse_args(megatron.arguments(plan))
    assert parsed.pipeline_model_parallel_size == 2 and parsed.use_distributed_optimizer


def test_what_a_framework_lacks_exits_2_with_the_reason(tmp_path):
    plan = gpt(pp=2, schedule="gpipe", num_micro_batches=4)
    result = CliRunner().invoke(app, ["export", str(write(plan, tmp_path)), "--to", "megatron"])
    assert result.exit_code == 2 and "no gpipe schedule" in result.output
    assert not (tmp_path / "megatron_args.sh").exists()
    with pytest.raises(ExportError, match="does not take token sequences"):
        torchtitan.settings(make_plan("gpt"))
    uneven = gpt(pp=2).model_copy(deep=True)
    uneven.stages[0].units = [*uneven.stages[0].units, "blocks.9"]
    with pytest.raises(ExportError, match=r"hold \[3, 2\] layers"):
        megatron.arguments(uneven.model_copy(update={"parallel": uneven.parallel.model_copy(
            update={"virtual_stages": 2, "schedule": "interleaved-1f1b"})}))


def test_torchtitan_config_classes_take_the_export():
    configs = pytest.importorskip(
        "torchtitan.config.configs", reason="torchtitan is not installed (it follows torch nightly)"
    )
    plan = gpt(pp=2, dp=2, zero_stage=1)
    sections: dict[str, dict] = {}
    for name, value in torchtitan.settings(plan).items():
        section, field = name.split(".")
        sections.setdefault(section, {})[field] = value
    configs.ParallelismConfig(**sections["parallelism"])
    configs.TrainingConfig(**sections["training"])


def test_per_op_recomputation_is_torchtitans_selective_ac_and_has_no_megatron_granularity():
    plan = gpt(dp=4, zero_stage=3, recompute="op")
    assert torchtitan.activation_checkpoint(plan) == ("selective", "SelectiveAC")
    with pytest.raises(ExportError, match="recomputes per op"):
        megatron.arguments(plan)
