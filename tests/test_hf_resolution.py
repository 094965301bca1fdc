"""hf:ORG/NAME resolution through huggingface_hub: the requested revision out of a cache that holds two, offline
mode respected, online only config.json fetched (from a local stand-in for the Hub at HF_ENDPOINT), hints naming
`hf download`. Each case runs in a fresh process: huggingface_hub reads HF_HOME and
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


def resolve(home: Path, *args: str, offline: bool = True, endpoint: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), PYTHONPATH=str(ROOT))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
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


class _Hub:
    """A local stand-in for the Hub's file endpoint (HF_ENDPOINT): HEAD/GET /ORG/NAME/resolve/REV/FILE answered
    with the headers huggingface_hub reads (X-Repo-Commit, ETag, Content-Length); every path asked is kept."""

    def __init__(self, refs: dict[str, str], files: dict[tuple[str, str], bytes]):
        import http.server
        import threading

        self.asked: list[tuple[str, str]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                hub.asked.append((self.command, self.path))
                parts = self.path.split("?")[0].strip("/").split("/")  # org, name, resolve, rev, file
                commit = refs.get(parts[3], parts[3]) if len(parts) == 5 and parts[2] == "resolve" else None
                data = files.get((commit, parts[4])) if commit else None
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{commit[:8]}-{parts[4]}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._answer(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(body=True)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_online_fetches_the_revisions_config_json_alone(tmp_path):
    """With a network (HF_ENDPOINT: a local Hub), config.json of the requested revision is downloaded into the
    cache as `hf download` would put it, and no other file is asked for (no weights, no listing)."""
    config = {(OLD, "config.json"): json.dumps({**CONFIG, "num_hidden_layers": 2}).encode(),
              (NEW, "config.json"): json.dumps({**CONFIG, "num_hidden_layers": 4}).encode(),
              (NEW, "model.safetensors"): b"weights"}
    hub = _Hub({"main": NEW, "v1": OLD}, config)
    try:
        got = resolve(tmp_path, "org/tiny", "v1", offline=False, endpoint=hub.url)
        assert got.returncode == 0, got.stderr
        path = Path(got.stdout.strip())
        assert path == (tmp_path / "hub" / "models--org--tiny" / "snapshots" / OLD / "config.json").resolve()
        assert json.loads(path.read_text())["num_hidden_layers"] == 2
        # Files asked for: that one (huggingface_hub may also ask /api/agent-harnesses for its user agent)
        assert {p.split("?")[0] for _, p in hub.asked if "/resolve/" in p} == {"/org/tiny/resolve/v1/config.json"}
        got = resolve(tmp_path, "org/tiny", offline=False, endpoint=hub.url)  # main, now: the other commit's file
        assert got.returncode == 0, got.stderr
        assert json.loads(Path(got.stdout.strip()).read_text())["num_hidden_layers"] == 4
        # No such revision: the Hub's 404, worded with the command that fetches it
        got = resolve(tmp_path, "org/tiny", "v9", offline=False, endpoint=hub.url)
        assert got.returncode == 2 and "hf download org/tiny config.json --revision v9" in got.stderr
        assert all("safetensors" not in p for _, p in hub.asked)
    finally:
        hub.close()


def test_unreachable_hub_falls_back_to_the_cached_revision(tmp_path):
    """Online but the Hub does not answer (a closed port): the cached copy of the requested revision is read."""
    import socket

    paths = fake_cache(tmp_path)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    got = resolve(tmp_path, "org/tiny", "v1", offline=False, endpoint=closed)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()) == paths[OLD].resolve()
