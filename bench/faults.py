"""Issue 13's hostile-input cases, each run against the real `planner` command; prints how many hold.

    python bench/faults.py          # one line per case, then "N/M hold"

Each case is a check that passes when the planner behaves: a user error is exit code 2 with one paragraph
and no traceback, nothing is lost or left half-written, nothing hangs. Exit status 1 if any case fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = ROOT / "tests" / "fixtures" / "tiny_gpt.py"
CLUSTER = ["--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "4"]
PAUSE_ENV = "PLANNER_TEST_PAUSE_AFTER_FIRST_WRITE"
TMP = Path(tempfile.mkdtemp(prefix="planner-faults-"))


def planner(*args: str, env: dict[str, str] | None = None, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=ROOT, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=600, env={**os.environ, **(env or {})})


def user_error(proc: subprocess.CompletedProcess, *needles: str) -> bool:
    return (proc.returncode == 2 and proc.stderr.lstrip().startswith("Error: ") and "Traceback" not in proc.stderr
            and all(n in proc.stderr for n in needles))


def model(name: str, text: str) -> Path:
    path = TMP / name
    path.write_text(textwrap.dedent(text))
    return path


def tiny_with(name: str, prefix: str = "", suffix: str = "") -> Path:
    return model(name, prefix + "\n" + TINY.read_text() + "\n" + suffix)


def plan_into(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return planner("plan", TINY, *CLUSTER, "--out", out, "-q", *extra)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def no_leftovers(folder: Path) -> bool:
    return not [p for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]


def _exit_at_import(code: str) -> Callable[[], bool]:
    return lambda: user_error(planner("plan", tiny_with("m.py", code), *CLUSTER, "--out", TMP / "x"),
                              "m.py, line 1")


def case_build_exit() -> bool:
    path = tiny_with("b.py", suffix="def build_model(**kw):\n    import sys\n    sys.exit('bye')\n")
    return user_error(planner("plan", path, *CLUSTER, "--out", TMP / "x"), "sys.exit('bye')", "b.py, line")


def case_hang() -> bool:
    path = tiny_with("h.py", "import time\ntime.sleep(3600)")
    return user_error(planner("plan", path, *CLUSTER, "--out", TMP / "x", "--load-timeout", "5"), "time limit")


def case_print_json() -> bool:
    proc = planner("plan", tiny_with("p.py", "print('hi')"), *CLUSTER, "--out", TMP / "pj", "--json")
    try:
        json.loads(proc.stdout)
    except ValueError:
        return False
    return proc.returncode == 0


def case_trillion() -> bool:
    proc = planner("plan", TINY, "--gpu", "cpu", "--gpus-per-node", "4", "--global-batch-size", str(10**12),
                   "--out", TMP / "big", "-q")
    return proc.returncode in (0, 2) and "Traceback" not in proc.stderr


def case_divisors() -> bool:
    from planner.search.space import divisors

    return len(divisors(2**40)) == 41 and divisors(999_999_999_989) == [1, 999_999_999_989]


def case_edit_kept() -> bool:
    out = TMP / "edit"
    plan_into(out)
    (out / "train.py").write_text((out / "train.py").read_text() + "# mine\n")
    again = plan_into(out)
    emit = planner("emit", out, "--out", out, "-q")
    return (again.returncode == 0 and emit.returncode == 0 and "kept train.py" in again.stderr
            and (out / "train.py").read_text().endswith("# mine\n"))


def case_edit_and_different_plan() -> bool:
    out = TMP / "edit2"
    plan_into(out)
    (out / "launch.sh").write_text("echo mine\n")
    before = snapshot(out)
    return user_error(plan_into(out, "--seed", "4"), "different plan", "launch.sh") and snapshot(out) == before


def _paused(out: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    marker = TMP / f"pause-{out.name}"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "plan", str(TINY), *CLUSTER, "--out", str(out), "-q",
                             *extra], cwd=ROOT, env={**os.environ, PAUSE_ENV: str(marker)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not marker.exists():
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    return proc, marker


def case_lock() -> bool:
    out = TMP / "lock"
    first, marker = _paused(out)
    second = plan_into(out, "--seed", "5")
    marker.unlink(missing_ok=True)
    first.communicate(timeout=600)
    return (user_error(second, "Another planner process", ".lock") and first.returncode == 0
            and json.loads((out / "plan.json").read_text())["training"]["seed"] == 0 and no_leftovers(out))


def _killed(sig: int) -> bool:
    out = TMP / f"kill{sig}"
    plan_into(out)
    before = snapshot(out)
    proc, _ = _paused(out, "--seed", "9", "--force")
    proc.send_signal(sig)
    proc.communicate(timeout=600)
    return snapshot(out) == before and no_leftovers(out)


def case_folder_in_the_way() -> bool:
    out = TMP / "inway"
    (out / "train.py").mkdir(parents=True)
    return user_error(plan_into(out), "train.py") and not (out / "plan.json").exists() and no_leftovers(out)


def case_validate_first_error() -> bool:
    from cli.validate import first_error

    log = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x\"\n[rank1]: ValueError: real cause\n"
    return first_error(log) == "[rank1]: ValueError: real cause"


def case_validate_kills_tree() -> bool:
    from cli.validate import _alive, _run

    pids = TMP / "pids"
    worker = model("worker.py", f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.setsid()
        open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
        while True:
            time.sleep(0.1)
    """)
    launcher = TMP / "launch.sh"
    launcher.write_text(f"trap '' TERM\n{sys.executable} {worker} &\nwait\n")
    code = _run(["bash", str(launcher)], TMP, TMP / "vlog", timeout=3.0)
    alive = [p for p in map(int, pids.read_text().split()) if _alive(p)]
    return code is None and not alive


def _bad_plan(path: str, value) -> Callable[[], bool]:
    def check() -> bool:
        src = TMP / "good"
        if not (src / "plan.json").exists():
            plan_into(src)
        doc = json.loads((src / "plan.json").read_text())
        target = doc
        *head, last = path.split(".")
        for key in head:
            target = target[int(key)] if key.isdigit() else target[key]
        target[last] = value
        bad = TMP / "bad.json"
        bad.write_text(json.dumps(doc))
        report, as_json = planner("report", bad), planner("report", bad, "--json")
        return user_error(report) and user_error(as_json) and "NaN" not in as_json.stdout
    return check


def case_int_into_linear() -> bool:
    path = model("i.py", """
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

            def forward(self, x):
                for b in self.blocks:
                    x = b(x)
                return x

        def build_model(**kw):
            return Net()

        def example_inputs(batch_size, **kw):
            return (torch.randint(0, 4, (batch_size, 8)),)
    """)
    return user_error(planner("plan", path, *CLUSTER, "--out", TMP / "x"), "int64", "blocks.0 (Linear)")


def case_unknown_arg() -> bool:
    path = model("a.py", TINY.read_text().replace("**_):\n    return GPT", "):\n    return GPT"))
    return user_error(planner("plan", path, *CLUSTER, "-a", "layer=4", "--out", TMP / "x"), "'layer'",
                      "Did you mean 'layers'")


def case_spec_overflow() -> bool:
    import yaml

    from planner.hardware.load import specs_dir

    spec = yaml.safe_load(sorted(specs_dir().glob("*.yaml"))[0].read_text())
    spec["memory_gib"] = 1e300
    path = TMP / "huge.yaml"
    path.write_text(yaml.safe_dump(spec))
    return user_error(planner("plan", TINY, "--gpu", path, "--global-batch-size", "4", "--out", TMP / "x"),
                      "memory_gib")


def case_export_quiet() -> bool:
    path = model("cf.py", TINY.read_text().replace(
        "        for b in self.blocks:\n            x = b(x)",
        "        for b in self.blocks:\n            if x.sum() > 0:\n                x = b(x)"))
    proc = planner("plan", path, *CLUSTER, "--out", TMP / "x")
    return proc.returncode == 2 and "ERROR" not in proc.stderr and "Traceback" not in proc.stderr


def case_no_params() -> bool:
    path = model("np.py", """
        import torch
        from torch import nn

        class Net(nn.Module):
            def forward(self, x):
                return x * 2

        def build_model(**kw):
            return Net()

        def example_inputs(batch_size, **kw):
            return (torch.randn(batch_size, 8),)
    """)
    proc = planner("plan", path, *CLUSTER, "--out", TMP / "x")
    return user_error(proc) and "control flow" not in proc.stderr


def case_impossible_pins() -> bool:
    proc = planner("plan", TINY, *CLUSTER, "--pp", "2", "--schedule", "zero-bubble", "--virtual-stages", "3",
                   "--out", TMP / "x")
    return user_error(proc) and "constraints: none" not in proc.stderr


def case_directory_model() -> bool:
    return user_error(planner("plan", TMP, *CLUSTER, "--out", TMP / "x"), "is a directory")


def case_report_full_device() -> bool:
    src = TMP / "good"
    if not (src / "plan.json").exists():
        plan_into(src)
    with open("/dev/full", "w") as full:
        proc = planner("report", src, stdout=full)
    return user_error(proc, "No space left on device")


def case_p2p_inter_node() -> bool:
    from planner.cost.model import Candidate, p2p_time
    from planner.hardware.load import load_cluster

    cluster = load_cluster("a100-sxm4-80gb", 2)
    slow = cluster.model_copy(update={"topology": cluster.topology.model_copy(
        update={"inter_node_bandwidth_gbps": 1e-3})})
    cand = Candidate(1, 2, 8, 1, 1, 16, "1f1b", 0, False)
    return p2p_time(1e6, cand, slow) > 100 * p2p_time(1e6, cand, cluster)


CASES: list[tuple[str, Callable[[], bool]]] = [
    ("1 sys.exit(0) at import -> exit 2", _exit_at_import("import sys; sys.exit(0)")),
    ("1 os._exit(0) at import -> exit 2", _exit_at_import("import os; os._exit(0)")),
    ("1 sys.exit(3) at import -> exit 2", _exit_at_import("import sys; sys.exit(3)")),
    ("1 SIGTERM to itself at import -> exit 2", _exit_at_import("import os, signal; os.kill(os.getpid(), 15)")),
    ("1 sys.exit('bye') in build_model -> exit 2", case_build_exit),
    ("1 a hang at import -> time limit, exit 2", case_hang),
    ("1 prints at import -> --json stays JSON", case_print_json),
    ("2 --global-batch-size 10**12 answers", case_trillion),
    ("2 divisors by factorisation", case_divisors),
    ("3 edited train.py kept (identical plan; plan and emit)", case_edit_kept),
    ("3 edited launch.sh + different plan refused, nothing changed", case_edit_and_different_plan),
    ("4 two plans on one --out: second fails on the lock", case_lock),
    ("4 SIGTERM between file writes: old set intact, no orphans", lambda: _killed(signal.SIGTERM)),
    ("4 SIGINT between file writes: old set intact, no orphans", lambda: _killed(signal.SIGINT)),
    ("4 a folder in the way: refused, nothing partial", case_folder_in_the_way),
    ("5 validate shows the failing rank's first error", case_validate_first_error),
    ("5 validate --timeout kills workers that ignore SIGTERM", case_validate_kills_tree),
    ("6 cluster size vs degrees", _bad_plan("cluster.nodes", 7)),
    ("6 NaN prediction refused, no NaN printed", _bad_plan("predicted.iteration_time_s", float("nan"))),
    ("6 negative prediction refused", _bad_plan("predicted.samples_per_s", -1.0)),
    ("6 training.steps -1 refused", _bad_plan("training.steps", -1)),
    ("6 tp: true refused", _bad_plan("parallel.tp", True)),
    ("6 duplicate stage index refused", _bad_plan("stages.0.index", 5)),
    ("7 int64 input into a Linear refused", case_int_into_linear),
    ("7 --lr nan refused", lambda: user_error(plan_into(TMP / "x", "--lr", "nan"), "--lr")),
    ("7 --lr -1 refused", lambda: user_error(plan_into(TMP / "x", "--lr", "-1"), "--lr")),
    ("7 unknown --model-arg key refused", case_unknown_arg),
    ("8 memory_gib 1e300 -> SpecError", case_spec_overflow),
    ("8 export failure prints no torch ERROR", case_export_quiet),
    ("8 no-parameter model not blamed on control flow", case_no_params),
    ("8 impossible schedule pins: no 'constraints: none'", case_impossible_pins),
    ("8 a directory as model file: 'is a directory'", case_directory_model),
    ("8 report to /dev/full -> clean error", case_report_full_device),
    ("9 p2p across nodes on the inter-node link", case_p2p_inter_node),
]


def main() -> int:
    held = 0
    for name, check in CASES:
        try:
            ok = bool(check())
        except Exception as e:  # noqa: BLE001 - a crashing check is a failing case
            ok = False
            name += f" ({type(e).__name__}: {e})"
        held += ok
        print(f"{'hold' if ok else 'FAIL'}  {name}", flush=True)
    print(f"{held}/{len(CASES)} hold")
    return 0 if held == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
