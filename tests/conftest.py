"""Shared pytest setup."""

import os
import sys
from pathlib import Path

# The repository root, so that plain `pytest` imports `planner` as `python -m pytest` does.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests analyse models afresh: the analysis cache (planner.model.cache) is on only where a test turns it on.
os.environ.setdefault("PLANNER_NO_CACHE", "1")

# No test is time-gated: hypothesis' default 200 ms deadline per example would fail property tests on a
# loaded machine (speed is measured by the bench/ scripts). Explicit @settings still override the rest.
from hypothesis import settings  # noqa: E402

settings.register_profile("planner", deadline=None)
settings.load_profile("planner")
