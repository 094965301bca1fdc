"""`planner sweep` timed: Llama-3-70B (sample_models/llama.py preset llama3-70b) on A100, H100 and H200 nodes,
4 to 128 nodes (6 counts), global batch 1024, 1T tokens; the goal is under 60 s on this machine.

    python bench/sweep.py                # the table, the wall time of the whole command, the plot in sweep_out/
    python bench/sweep.py --jobs 4

The time is the `planner sweep` command in a fresh process (interpreter start, torch import, one analysis of the
model, 18 searches in forked processes, the plot), as a user runs it. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="sweep_out")
    args = parser.parse_args()
    cmd = [sys.executable, "-c", "from planner.cli.main import main; main()", "sweep",
           str(ROOT / "sample_models" / "llama.py"), "-a", "preset=llama3-70b",
           "--gpu", "a100-sxm-80gb,h100-sxm-80gb,h200", "--nodes", "4..128",
           "--global-batch-size", "1024", "--tokens", "1e12", "--jobs", str(args.jobs), "--out", args.out]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=None)
    seconds = time.perf_counter() - start
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        sys.stdout.write(proc.stderr)
        raise SystemExit(proc.returncode)
    print(f"planner sweep, 3 GPU kinds x 6 node counts: {seconds:.1f} s wall (goal < 60 s), --jobs {args.jobs}")


if __name__ == "__main__":
    main()
