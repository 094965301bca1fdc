"""The digest of the runtime package that a generated train.py records and checks at start.

The same computation is written out in train.py (standard library only), so a plan directory can check its
copy of the runtime before importing any of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def runtime_files(folder: Path = PACKAGE) -> dict[str, str]:
    """The runtime's source files, {file name: text}, in name order (what codegen copies)."""
    return {f.name: f.read_text(encoding="utf-8") for f in sorted(folder.glob("*.py"))}


def digest_of(files: Mapping[str, str | bytes]) -> str:
    """sha256 over each file's name and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(name.encode() + b"\0" + (data.encode() if isinstance(data, str) else data) + b"\0")
    return h.hexdigest()


def package_digest(folder: str | Path) -> str:
    """The digest of the *.py files in `folder` (a copied runtime), as train.py computes it."""
    return digest_of({f.name: f.read_bytes() for f in sorted(Path(folder).glob("*.py"))})
