"""End to end: checkpoints of the generated train.py (torch.distributed.checkpoint), killed and resumed runs, and
checkpoints resumed under another plan of the same model (DCP resharding).

Every plan here trains the tiny GPT on a global batch of 16 (4 ranks), 6 steps. A run killed with SIGKILL in
the middle and resumed must give the losses of the run that was never killed; a checkpoint written at dp4 ZeRO-3
must continue on the same trajectory under pp2 x dp2 and tp2 x dp2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e.plans import make_plan
from e2e.test_train_e2e import TIMEOUT_S, TORCHRUN, run

from planner.codegen.render import write_scripts
from planner.plan import Plan

pytestmark = pytest.mark.e2e

STEPS = 6
EVERY = 2  # the killed runs save every 2 steps
LAYOUTS = {
    "dp4_zero3": lambda: make_plan("gpt", dp=4, zero_stage=3),
    "pp2_dp2_1f1b": lambda: make_plan("gpt", pp=2, dp=2, num_micro_batches=4),
    "pp2_dp2_interleaved": lambda: make_plan(
        "gpt", pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b", num_micro_batches=4
    ),
    "tp2_dp2": lambda: make_plan("gpt", tp=2, dp=2, num_micro_batches=4),
}


def command(*options: str) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node=4", "train.py", "--device", "cpu", "--steps", str(STEPS),
            *options]


def losses(where: Path) -> dict[int, float]:
    """Step -> loss of the last run in `where` (metrics.json holds the steps that run trained)."""
    return {s["step"]: s["loss"] for s in json.loads((where / "metrics.json").read_text())["steps"]}


def trained(plan: Plan, where: Path, *options: str) -> Path:
    write_scripts(plan, where)
    run(command(*options), where)
    return where


def killed_after_a_checkpoint(where: Path) -> None:
    """Start train.py (saving every EVERY steps) and SIGKILL every process of it once a step after its first
    complete checkpoint is logged (the next save may be under way: it must then be skipped on resume)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    log = (where / "killed.log").open("w")
    proc = subprocess.Popen(
        command("--checkpoint-every", str(EVERY)), cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    jsonl = where / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            lines = jsonl.read_text().splitlines() if jsonl.exists() else []
            logged = max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)
            saved = [int(p.name[5:]) for p in where.glob("checkpoints/step-*") if (p / "COMPLETE").exists()]
            if saved and logged > min(saved):
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"train.py ended before it was killed: {(where / 'killed.log').read_text()[-3000:]}"
    finally:
        # torchrun starts each worker in a session of its own: kill the workers (a lost node), then torchrun.
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        log.close()


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, and by them, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each layout's run that is never killed (dp4's also keeps a checkpoint of step 3 for the resharding test)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = trained(LAYOUTS[name](), tmp_path_factory.mktemp(name), "--checkpoint-every", "3")
        return cache[name]

    return get


# pp2 x dp2 1F1B under `corpus` (not in CI): the interleaved case takes the same pipeline path with two stages a rank
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.corpus) if n == "pp2_dp2_1f1b" else n for n in LAYOUTS]
)
def test_killed_and_resumed_run_trains_like_the_run_never_killed(name, tmp_path, uninterrupted):
    expected = losses(uninterrupted(name))
    write_scripts(LAYOUTS[name](), tmp_path)
    killed_after_a_checkpoint(tmp_path)
    run(command("--resume"), tmp_path)
    got = losses(tmp_path)
    first = min(got)
    # Resumed from the newest complete checkpoint: step 2's or step 4's (never one killed half-way).
    assert first in (3, 5), got
    assert sorted(got) == list(range(first, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= 1e-6, (name, step, got, expected)
    complete = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    assert f"step-{STEPS:08d}" in complete


@pytest.mark.parametrize("name", ["pp2_dp2_1f1b", "tp2_dp2"])
def test_dp4_checkpoint_resumes_under_another_plan(name, tmp_path, uninterrupted):
    reference = uninterrupted("dp4_zero3")
    checkpoint = reference / "checkpoints" / "step-00000003"
    assert (checkpoint / "COMPLETE").is_file()
    got = losses(trained(LAYOUTS[name](), tmp_path, "--resume", str(checkpoint)))
    expected = losses(reference)
    assert sorted(got) == [4, 5, 6]
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= 1e-5, (name, step, got, expected)


def test_resume_without_a_checkpoint_and_with_another_global_batch_is_refused(tmp_path, uninterrupted):
    write_scripts(make_plan("gpt", dp=4, num_micro_batches=1), tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nothing = subprocess.run(command("--resume"), cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    assert nothing.returncode != 0 and "no complete checkpoint under" in nothing.stderr + nothing.stdout
    checkpoint = uninterrupted("dp4_zero3") / "checkpoints"
    other = subprocess.run(command("--resume", str(checkpoint)), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    assert other.returncode != 0
    assert "global batch 16, this plan's is 8" in other.stderr + other.stdout, other.stderr[-3000:]


def test_replan_to_half_the_ranks_resumes_and_keeps_training(tmp_path, uninterrupted):
    """`planner replan` of the dp4 run for 2 CPU processes: its resume.sh continues from the old run's step-3
    checkpoint under the new plan, on the old run's trajectory."""
    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.plan import load_plan

    old = tmp_path / "old"
    reference = uninterrupted("dp4_zero3")
    # planned where the model file was (a laptop's folder), re-planned where only the plan folder is
    old_plan = LAYOUTS["dp4_zero3"]()
    laptop = tmp_path / "laptop" / Path(old_plan.model.path).name
    laptop.parent.mkdir()
    shutil.copy(old_plan.model.path, laptop)
    old_plan = old_plan.model_copy(update={"model": old_plan.model.model_copy(update={"path": str(laptop)})})
    write_scripts(old_plan, old)
    (old / "plan.json").write_text(old_plan.to_json())
    shutil.rmtree(laptop.parent)
    shutil.copytree(reference / "checkpoints" / "step-00000003", old / "checkpoints" / "step-00000003")
    new = tmp_path / "new"
    result = CliRunner().invoke(app, ["replan", str(old), "--gpus-per-node", "2", "--out", str(new)])
    assert result.exit_code == 0, result.output
    assert "step-00000003" in result.output
    plan = load_plan(new)
    assert plan.parallel.world_size == 2 and plan.parallel.global_batch_size == 16
    assert "--resume ../old/checkpoints" in (new / "resume.sh").read_text()
    run(["bash", str(new / "resume.sh"), "--steps", str(STEPS), "--device", "cpu"], tmp_path)
    got, expected = losses(new), losses(reference)
    assert sorted(got) == [4, 5, 6]
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= 1e-5, (step, got, expected)
    assert (new / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE").is_file()


def resumes_on_the_same_next_batch(folder: Path, data: str) -> list[str]:
    """Train dp2 for 4 steps on `data` (checkpoints every 2), resume from step 2: steps 3-4 give the same losses.
    Returns the command (without --resume and --data) for further runs."""
    write_scripts(make_plan("gpt", dp=2), folder)
    two = [TORCHRUN, "--standalone", "--nproc-per-node=2", "train.py", "--device", "cpu", "--steps", "4"]
    run([*two, "--checkpoint-every", "2", "--sync-checkpoint", "--data", data], folder)
    whole = losses(folder)
    run([*two, "--resume", "checkpoints/step-00000002", "--data", data], folder)
    assert losses(folder) == {3: whole[3], 4: whole[4]}
    return two


def test_token_file_run_resumes_on_the_same_next_batch_and_refuses_other_data(tmp_path):
    """dp2 on a flat uint16 token file: resumed from step 2, steps 3-4 read the batches the whole run read (the
    losses are equal); resumed without the file (the model's own batches), it is refused."""
    import array
    import random

    rng = random.Random(0)
    (tmp_path / "corpus.bin").write_bytes(array.array("H", (rng.randrange(256) for _ in range(32 * 40))).tobytes())
    two = resumes_on_the_same_next_batch(tmp_path, "corpus.bin")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    other = subprocess.run([*two, "--resume", "checkpoints/step-00000002"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert other.returncode != 0 and "this run reads the model file's batches" in other.stderr, other.stderr[-3000:]


def test_dataset_folder_run_resumes_on_the_same_next_batch(tmp_path):
    """dp2 on a tokenized Hugging Face dataset (save_to_disk): resumed from step 2, steps 3-4 see the batches the
    uninterrupted run saw."""
    import random

    datasets = pytest.importorskip("datasets")
    rng = random.Random(0)
    docs = [[rng.randrange(256) for _ in range(rng.randrange(5, 60))] for _ in range(60)]
    datasets.Dataset.from_dict({"input_ids": docs}).save_to_disk(str(tmp_path / "corpus"))
    resumes_on_the_same_next_batch(tmp_path, "corpus")


@pytest.mark.parametrize(
    "model", [
        "nanogpt",
        pytest.param("authored/transformer_encoder_lm", marks=pytest.mark.corpus),
        pytest.param("phi3", marks=pytest.mark.corpus),
        pytest.param("attention_head_scale", marks=pytest.mark.corpus),  # and a weight summed over tp
    ]
)
def test_a_fused_qkv_checkpoint_of_tp2_resumes_under_tp1(model, tmp_path):
    """nanoGPT's fused c_attn, nn.MultiheadAttention's packed in_proj_weight / in_proj_bias, and Phi-3's qkv_proj
    of unequal chunks (TP_FUSED widths), which TP reorders per rank (q | k | v of each rank's heads): a tp2 x dp2
    checkpoint holds them in the model's order, so a dp4 plan resumes from it on the tp2 run's trajectory (weights
    and AdamW moments put back in each layout's order)."""
    from e2e.test_tp_e2e import plan_cli

    tp2, dp4 = tmp_path / "tp2", tmp_path / "dp4"
    tp2.mkdir(), dp4.mkdir()  # plan_cli writes a Hugging Face model's file beside the plan folder
    assert plan_cli(model, tp2 / "plan", "--tp", "2", "--dp", "2", "--no-sequence-parallel").exit_code == 0
    assert plan_cli(model, dp4 / "plan", "--dp", "4", "--zero-stage", "3").exit_code == 0
    assert json.loads((tp2 / "plan" / "plan.json").read_text())["tp_fused"]
    run(command("--checkpoint-every", "3", "--sync-checkpoint"), tp2 / "plan")
    whole = losses(tp2 / "plan")
    run(command("--resume", str(tp2 / "plan" / "checkpoints" / "step-00000003")), dp4 / "plan")
    got = losses(dp4 / "plan")
    assert sorted(got) == [4, 5, 6]
    for step, loss in got.items():
        assert abs(loss - whole[step]) <= 1e-4, (step, got, whole)
