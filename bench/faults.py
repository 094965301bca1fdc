"""The hostile-input cases of issue 13 and of issue 28 (round two, the "R2" lines), each run against the real
`planner` command; prints how many hold.

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
    return subprocess.run([sys.executable, "-m", "planner.cli.main", *map(str, args)], cwd=ROOT, stdout=stdout,
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
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli.main", "plan", str(TINY), *CLUSTER, "--out", str(out),
                             "-q", *extra], cwd=ROOT, env={**os.environ, PAUSE_ENV: str(marker)},
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
    from planner.cli.validate import first_error

    log = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x\"\n[rank1]: ValueError: real cause\n"
    return first_error(log) == "[rank1]: ValueError: real cause"


def case_validate_kills_tree() -> bool:
    from planner.cli.validate import _alive, _run

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


# --- round two (issue 28) ------------------------------------------------------------------------------------

HF_CONFIG = ROOT / "tests" / "fixtures" / "models" / "hf_llama_config"
NET = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=8, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def build_model(**kwargs):
    return Net()


def example_inputs(batch_size, **kwargs):
    return (torch.randn(batch_size, 8),)
"""


def net(name: str, prefix: str = "", old: str = "", new: str = "") -> Path:
    path = TMP / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prefix + (NET.replace(old, new) if old else NET))
    return path


def _plan_json(proc: subprocess.CompletedProcess) -> dict | None:
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return None


def case_hf_injection() -> bool:
    marker = TMP / "PWNED"
    for name in (f'x/a"""\nimport os; os.system("touch {marker}")\n"""', f"x/$(touch {marker})`touch {marker}`"):
        proc = planner("plan", f"hf:{name}", "--hf-config", HF_CONFIG, "-a", "seq=32", "--dp", "2", *CLUSTER,
                       "--out", TMP / "inj", "--force", "--json")
        doc = _plan_json(proc)
        if proc.returncode != 0 or doc is None or doc.get("source_spec") != f"hf:{name}" or marker.exists():
            return False
    return True


def case_train_py_model_kept() -> bool:
    folder = TMP / "own"
    model = net("own/train.py")
    before = model.read_bytes()
    ok = all(user_error(planner("plan", model, *CLUSTER, "--out", folder, *force), "never replaces")
             for force in ((), ("--force",)))
    return ok and model.read_bytes() == before


def case_cache_sub_package_and_yaml() -> bool:
    folder = TMP / "cached"
    (folder / "netpkg").mkdir(parents=True, exist_ok=True)
    (folder / "netpkg" / "__init__.py").write_text("DEPTH = 2\n")
    (folder / "sizes.yaml").write_text("width: 8\n")
    reader = ("import yaml\nimport netpkg\nfrom pathlib import Path\n"
              "W = yaml.safe_load(Path(__file__).with_name('sizes.yaml').read_text())['width']\n")
    model = net("cached/model.py", reader, "return Net()", "return Net(W, netpkg.DEPTH)")
    model.write_text(model.read_text().replace("torch.randn(batch_size, 8)", "torch.randn(batch_size, W)"))
    env = {"PLANNER_CACHE_DIR": str(TMP / "cache")}

    def params() -> int | None:
        doc = _plan_json(planner("dry-run", model, *CLUSTER, "--json", env=env))
        return None if doc is None else doc.get("total_params")

    first = params()
    (folder / "netpkg" / "__init__.py").write_text("DEPTH = 4\n")
    deeper = params()
    (folder / "sizes.yaml").write_text("width: 32\n")
    wider = params()
    return first == 2 * 72 and deeper == 4 * 72 and wider == 4 * (32 * 32 + 32)


def case_model_args_round_trip() -> bool:
    refused = all(user_error(planner("plan", TINY, *CLUSTER, "-a", arg, "--out", TMP / "x"), "--model-arg")
                  for arg in ("widths={0: 16, 1: 16}", "shape=(1, 2)", "eps=1e999", "x=b'\\xff'"))
    arg = "cfg={'widths': [16, 16], 'eps': 1e-05, 'name': 'a b'}"
    out, again = TMP / "args", TMP / "args2"
    model = net("args.py")
    planned = planner("plan", model, *CLUSTER, "-a", arg, "--out", out, "-q").returncode == 0
    emitted = planner("emit", out, "--out", again, "-q").returncode == 0
    line = "MODEL_ARGS = {'cfg': {'widths': [16, 16], 'eps': 1e-05, 'name': 'a b'}}"
    import ast

    def args_of(folder: Path) -> object:
        tree = ast.parse((folder / "train.py").read_text())
        node = next(n for n in tree.body
                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "MODEL_ARGS")
        return ast.literal_eval(node.value)

    want = ast.literal_eval(line.split(" = ", 1)[1])
    return refused and planned and emitted and args_of(out) == want == args_of(again)


def case_validate_fresh_metrics() -> bool:
    out = TMP / "val"
    plan_into(out)
    (out / "metrics.json").write_text(json.dumps({"steps": [{"step_time_s": 1.0, "loss": 1.0}] * 5}))
    (out / "launch.sh").write_text("#!/bin/bash\nexit 0\n")
    return user_error(planner("validate", out, "--steps", "2"), "wrote no")


def case_chdir_relative_out() -> bool:
    model = net("cd.py", "import os\nos.chdir('/')\n")
    rel = Path(os.path.relpath(TMP / "cd_out", ROOT))
    proc = planner("plan", model, *CLUSTER, "--out", rel, "-q")
    return proc.returncode == 0 and (TMP / "cd_out" / "plan.json").is_file()


def _json_with(code: str) -> Callable[[], bool]:
    def check() -> bool:
        proc = planner("plan", net("fd.py", code + "\n"), *CLUSTER, "--out", TMP / "fd", "--force", "--json")
        return proc.returncode == 0 and _plan_json(proc) is not None
    return check


def _spec_with(text: str, *needles: str) -> Callable[[], bool]:
    def check() -> bool:
        path = TMP / "r2spec.yaml"
        path.write_text(text)
        t0 = time.monotonic()
        proc = planner("plan", TINY, "--gpu", path, "--global-batch-size", "4", "--out", TMP / "x")
        return user_error(proc, *needles) and time.monotonic() - t0 < 60
    return check


def _bomb() -> str:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nname: bomb\n"


def _h100_with(field: str, value: object, duplicate: bool = False) -> str:
    import yaml

    from planner.hardware.load import specs_dir

    text = (specs_dir() / "h100-sxm5-80gb.yaml").read_text()
    if duplicate:
        return text + f"{field}: {value}\n"
    spec = yaml.safe_load(text)
    target = spec
    *head, last = field.split(".")
    for key in head:
        target = target[key]
    target[last] = value
    return yaml.safe_dump(spec)


def case_top_k() -> bool:
    t0 = time.monotonic()
    return user_error(plan_into(TMP / "x", "--top-k", "100000"), "--top-k") and time.monotonic() - t0 < 60


def _plan_text_with(old: str, new: str) -> Callable[[], bool]:
    def check() -> bool:
        src = TMP / "good"
        if not (src / "plan.json").exists():
            plan_into(src)
        bad = TMP / "r2bad.json"
        bad.write_text((src / "plan.json").read_text().replace(old, new, 1))
        return all(user_error(planner(*cmd)) for cmd in (("report", bad), ("emit", bad, "--out", TMP / "r2emit")))
    return check


def case_script_module() -> bool:
    model = net("jit.py", old="    return Net()", new="    return torch.jit.script(Net())")
    return user_error(planner("plan", model, *CLUSTER, "--out", TMP / "x"), "TorchScript")


def case_lazy() -> bool:
    model = net("lazy.py", old="nn.Linear(width, width)", new="nn.LazyLinear(width)")
    return user_error(planner("plan", model, *CLUSTER, "--out", TMP / "x"), "lazy modules")


def case_non_utf8_arg() -> bool:
    proc = subprocess.run([sys.executable, "-m", "planner.cli.main", "plan", str(TINY), *CLUSTER, "-a", b"x=\xff\xfe",
                           "--out", str(TMP / "x")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return user_error(proc, "--model-arg x")


def case_read_only_out() -> bool:
    """A read-only bind mount as --out (made in a user namespace with `unshare -rm`): the error names the
    read-only file system, not "Device or resource busy" (the failed folder exchange)."""
    import shlex

    folder = TMP / "ro"
    folder.mkdir(exist_ok=True)
    q = shlex.quote(str(folder))
    cmd = (f"mount --bind {q} {q} && mount -o remount,bind,ro {q} && {shlex.quote(sys.executable)} -m planner.cli.main "
           f"plan {shlex.quote(str(TINY))} {' '.join(CLUSTER)} --out {q} -q")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if "mount" in proc.stderr and proc.returncode != 2:  # no user namespaces here: the fallback's own check
        from planner import io

        saved = io._exchange

        def busy(a, b):
            import errno
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(b))

        io._exchange = busy
        try:
            io.write_output_set(folder, {"a.txt": ("a", False)}, force=False)
        finally:
            io._exchange = saved
        return (folder / "a.txt").read_text() == "a"
    return user_error(proc, "Read-only file system") and "resource busy" not in proc.stderr


def case_launch_steps() -> bool:
    out = TMP / "steps"
    plan_into(out)
    (out / "metrics.json").write_text("{}")
    procs = [subprocess.run(["bash", "launch.sh", "--steps", s], cwd=out, capture_output=True, text=True,
                            timeout=600) for s in ("0", "-1")]
    kept = (out / "metrics.json").read_text() == "{}"
    return kept and all(p.returncode != 0 and "--steps" in p.stderr for p in procs)


def case_emit_kept_listing() -> bool:
    out = TMP / "kept"
    plan_into(out)
    (out / "train.py").write_text((out / "train.py").read_text() + "# mine\n")
    proc = planner("emit", out, "--out", out)
    return proc.returncode == 0 and "kept train.py" in proc.stderr and str(out / "train.py") not in proc.stdout


def case_unknown_model_type() -> bool:
    config = json.loads((HF_CONFIG / "config.json").read_text())
    config["model_type"] = "llamma"
    folder = TMP / "badtype"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    proc = planner("plan", "hf:x/y", "--hf-config", folder, *CLUSTER, "--out", TMP / "x")
    return user_error(proc, "llamma") and len(proc.stderr) < 1000


def case_fifo_and_dev_zero() -> bool:
    fifo = TMP / "fifo.py"
    if not fifo.exists():
        os.mkfifo(fifo)
    return all(user_error(planner("plan", path, *CLUSTER, "--out", TMP / "x"), "not a regular file")
               for path in (fifo, Path("/dev/zero")))


def case_data_signature() -> bool:
    model = net("data.py")
    model.write_text(model.read_text() + "\n\ndef get_batch(step):\n    return (torch.randn(2, 8),)\n")
    return user_error(planner("plan", model, *CLUSTER, "--out", TMP / "x"), "get_batch(step)")


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
    ("R2 1 hf: name with quotes, newlines, $() runs nothing", case_hf_injection),
    ("R2 2 a model named train.py is never replaced (with or without --force)", case_train_py_model_kept),
    ("R2 3 cache misses on an edited sub-package and YAML file", case_cache_sub_package_and_yaml),
    ("R2 4 --model-arg values round-trip through plan.json or are refused", case_model_args_round_trip),
    ("R2 5 validate does not report an old metrics.json", case_validate_fresh_metrics),
    ("R2 6 os.chdir at import does not move a relative --out", case_chdir_relative_out),
    ("R2 7 YAML alias bomb refused at once", _spec_with(_bomb(), "anchor or alias")),
    ("R2 7 --top-k 100000 refused at once", case_top_k),
    ("R2 8 duplicate YAML key refused", _spec_with(_h100_with("memory_gib", 8000, duplicate=True), "duplicate key")),
    ("R2 8 duplicate \"training\" in plan.json refused", _plan_text_with('\n  "training": {',
                                                                     '\n  "training": {},\n  "training": {')),
    ("R2 8 bandwidth in bytes/s refused as a unit slip",
     _spec_with(_h100_with("memory_bandwidth_gbps", 3.35e12), "memory_bandwidth_gbps", "GB/s")),
    ("R2 8 peak in FLOP/s refused as a unit slip",
     _spec_with(_h100_with("peak_tflops.bf16", 989e12), "peak_tflops.bf16", "TFLOP/s")),
    ("R2 9 build_model returning a ScriptModule -> exit 2", case_script_module),
    ("R2 9 nn.LazyLinear -> exit 2", case_lazy),
    ("R2 9 self-referencing YAML alias -> exit 2", _spec_with("name: &a [*a]\n", "alias")),
    ("R2 9 non-UTF-8 bytes --model-arg -> exit 2", case_non_utf8_arg),
    ("R2 9 5000-digit integer in plan.json -> exit 2 (report, emit)",
     _plan_text_with('"seed": 0', '"seed": ' + "9" * 5000)),
    ("R2 9 a model closing fd 1 -> plan, clean JSON", _json_with("import os; os.close(1)")),
    ("R2 9 a model closing sys.stdout -> plan, clean JSON", _json_with("import sys; sys.stdout.close()")),
    ("R2 10 --json with a model writing to fd 1 at import", _json_with("import os; os.write(1, b'{oops')")),
    ("R2 11 a read-only mount point as --out: 'Read-only file system'", case_read_only_out),
    ("R2 11 launch.sh --steps 0 / -1 refused, metrics.json kept", case_launch_steps),
    ("R2 11 emit does not list kept files as written", case_emit_kept_listing),
    ("R2 11 unknown HF model_type: one short paragraph", case_unknown_model_type),
    ("R2 11 a FIFO or /dev/zero as the model file", case_fifo_and_dev_zero),
    ("R2 11 --data naming a function with the wrong signature", case_data_signature),
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
