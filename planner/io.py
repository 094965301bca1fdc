"""Atomic file output: write to a temporary file in the same directory, then rename over the target."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | Path, text: str, executable: bool = False) -> None:
    """Write text so that readers see either the old file or the whole new one, never a partial one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_files(files: dict[str | Path, tuple[str, bool]]) -> None:
    """Write several files, each atomically; all content is rendered before the first write."""
    for path, (text, executable) in files.items():
        atomic_write_text(path, text, executable)
