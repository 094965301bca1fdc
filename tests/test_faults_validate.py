"""validate shows the failing rank's first real error and kills the whole process tree on --timeout,
workers that ignore SIGTERM included (issue 13 point 5)."""

from __future__ import annotations

import os
import sys
import textwrap

from planner.cli.validate import _alive, _run, first_error

LOG = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 40, in <module>
[rank1]:     main()
[rank1]: RuntimeError: shape mismatch in stage 1
[rank0]: Traceback (most recent call last):
[rank0]: torch.distributed.DistBackendError: connection reset by peer
Traceback (most recent call last):
  File "torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_first_error_is_the_failing_ranks():
    assert first_error(LOG) == "[rank1]: RuntimeError: shape mismatch in stage 1"
    assert first_error("all good\n") == ""


def test_timeout_kills_workers_that_ignore_sigterm(tmp_path):
    pids = tmp_path / "pids"
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.setsid()  # a session of its own, as elastic agents' workers may have: killpg misses it
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        while True:
            time.sleep(0.1)
    """))
    launcher = tmp_path / "launch.sh"
    launcher.write_text(f"trap '' TERM\n{sys.executable} {worker} &\n{sys.executable} {worker} &\nwait\n")
    code = _run(["bash", str(launcher)], tmp_path, tmp_path / "log", timeout=5.0)
    assert code is None
    workers = [int(p) for p in pids.read_text().split()]
    assert len(workers) == 2
    assert not any(_alive(p) for p in workers), "a worker survived the timeout"
    for p in workers:
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
