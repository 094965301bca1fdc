"""hf:ORG/NAME resolution through huggingface_hub: the requested revision out of a cache that holds two, offline
mode respected, hints naming `hf download`. Each case runs in a fresh process: huggingface_hub reads HF_HOME and
HF_HUB_OFFLINE when it is imported, as it does for the planner's command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = json.loads((ROOT / "tests" / "fixtures" / "models" / "hf_llama_config" / "config.json").read_text())
OLD, NEW = "1" * 40, "2" * 40


def fake_cache(home: Path) -> dict[str, Path]:
    """An HF_HOME whose hub cache holds org/tiny at two commits: main -> NEW, tag v1 -> OLD (as `hf download`
    leaves them: refs/<name> holding the commit, snapshots/<commit>/config.json)."""
    repo = home / "hub" / "models--org--tiny"
    paths = {}
    for commit, layers in ((OLD, 2), (NEW, 4)):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
        paths[commit] = snap / "config.json"
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(NEW)
    (repo / "refs" / "v1").write_text(OLD)
    return paths


def resolve(home: Path, *args: str, offline: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), PYTHONPATH=str(ROOT))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    code = (
        "import sys\nfrom planner.errors import PlannerError\nfrom planner.model.sources import find_hf_config\n"
        "try:\n    print(find_hf_config(*sys.argv[1:2], revision=(sys.argv[2:] or [None])[0]))\n"
        "except PlannerError as e:\n    print(e, file=sys.stderr)\n    sys.exit(2)\n"
    )
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_requested_revision_is_picked(tmp_path):
    paths = fake_cache(tmp_path)
    # by tag, by commit, and main by default: each the snapshot its ref names (a walk of snapshots/ sorted by
    # name took the last folder whatever was asked)
    for args, commit in (((("org/tiny", "v1")), OLD), (("org/tiny", OLD), OLD), (("org/tiny",), NEW),
                         (("org/tiny", "main"), NEW), (("org/tiny", NEW), NEW)):
        got = resolve(tmp_path, *args)
        assert got.returncode == 0, got.stderr
        assert Path(got.stdout.strip()) == paths[commit].resolve(), args


def test_a_revision_not_in_the_cache_offline_is_a_clear_error(tmp_path):
    fake_cache(tmp_path)
    got = resolve(tmp_path, "org/tiny", "v2")
    assert got.returncode == 2
    assert "HF_HUB_OFFLINE" in got.stderr and "hf download org/tiny config.json --revision v2" in got.stderr
    assert "huggingface-cli" not in got.stderr
    got = resolve(tmp_path, "nobody/none")
    assert got.returncode == 2 and "hf download nobody/none config.json" in got.stderr


def test_plan_reads_the_revision(tmp_path):
    """`planner dry-run hf:org/tiny --revision v1` plans the 2-layer config of tag v1, not main's 4 layers."""
    pytest.importorskip("transformers")
    fake_cache(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", PLANNER_NO_CACHE="1", PYTHONPATH=str(ROOT))
    got = subprocess.run(
        [sys.executable, "-c", "from planner.cli.main import main; main()", "dry-run", "hf:org/tiny",
         "--revision", "v1", "-a", "seq=16", "--gpu", "cpu", "--gpus-per-node", "1", "--global-batch-size", "1",
         "--json"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    structure = json.loads(got.stdout)["structure"]
    assert len(structure) == 1 and structure[0].startswith("2 x "), structure
