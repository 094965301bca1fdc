"""What a checkpoint costs the training it interrupts: the generated train.py run three times on the same plan,
without checkpoints, saving every step synchronously, and saving every step asynchronously (dcp.async_save);
prints the mean step time of each (a step's time includes the time the save blocks it) and the overhead per
step against the run without checkpoints.

    python bench/checkpoint.py                      # GPT, 4 layers, hidden 512, dp2 ZeRO-3 on 2 CPU processes
    python bench/checkpoint.py --layers 8 --hidden 1024 --steps 12 --device cuda --procs 2

The goal (issue 25): an asynchronous save blocks a step by less than 10% of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def step_times(where: Path, procs: int, steps: int, device: str, *options: str) -> list[float]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", f"--nproc-per-node={procs}", "train.py", "--steps", str(steps),
           "--device", device, *options]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    records = json.loads((where / "metrics.json").read_text())["steps"]
    return [r["step_time_s"] for r in records[1:]]  # the first step warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--every", type=int, default=3, help="steps between saves (an async save in flight makes "
                        "the next one wait: every step, async is bound by the write like sync)")
    args = parser.parse_args()

    from e2e.plans import make_plan

    from planner.codegen.render import write_scripts

    model = {"layers": args.layers, "hidden": args.hidden, "heads": 8, "vocab": 4096, "seq": 128}
    plan = make_plan("gpt", dp=args.procs, zero_stage=3, model_args=model)
    where = Path(tempfile.mkdtemp(prefix="planner-bench-checkpoint-"))
    write_scripts(plan, where)
    runs = {
        "no checkpoint": ("--checkpoint-every", "0", "--checkpoint-dir", str(where / "none")),
        "sync": ("--checkpoint-every", str(args.every), "--sync-checkpoint", "--checkpoint-dir", str(where / "sync")),
        "async": ("--checkpoint-every", str(args.every), "--checkpoint-dir", str(where / "async")),
    }
    print(f"gpt {args.layers} layers, hidden {args.hidden}, dp{args.procs} ZeRO-3 on {args.device}, "
          f"{args.steps} steps, "
          f"a save every {args.every}")
    base = None
    for name, options in runs.items():
        times = step_times(where, args.procs, args.steps, args.device, *options)
        mean = statistics.mean(times)
        if base is None:
            base = mean
            print(f"{name:>18}: {mean * 1e3:8.1f} ms/step")
        else:
            saves = sum(1 for s in range(2, args.steps) if s % args.every == 0)  # steps 2 .. steps-1 are timed
            per_save = (mean - base) * (args.steps - 1) / max(1, saves)
            print(f"{name:>18}: {mean * 1e3:8.1f} ms/step, overhead {(mean - base) * 1e3:+8.1f} ms/step, "
                  f"{per_save * 1e3:+8.1f} ms per save ({per_save / base:+.0%} of a step)")


if __name__ == "__main__":
    main()
