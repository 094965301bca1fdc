"""The user's model file travels with the plan: copied into the plan folder's model/, with the modules beside it
that it imports, so that train.py names it by a path relative to itself and the folder runs on the cluster
(where the planning machine's absolute path does not exist).

A compiled model source (hf:, torchtitan:, module:) is already written into the plan folder as
model_source.py beside its config.json; train.py names it there and nothing is copied.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable
from pathlib import Path

from planner.errors import PlanError

MODEL_DIR = "model"
# A local package copied whole is bounded: a model folder holding a whole repository is a sign the model file
# imports something it should install instead.
MAX_PACKAGE_FILES = 200

Files = dict[str, tuple[str, bool]]


# Files beside the model that it may read by a path relative to its own (a config next to it): copied with it.
CONFIG_SUFFIXES = (".json", ".yaml", ".yml", ".toml")
MAX_COPIED_BYTES = 4 << 20  # per file: a larger one (weights, a corpus) is data the job names itself, not code


def copied_model(path: str, reads: Iterable[str] = ()) -> tuple[str, Files]:
    """(MODEL_FILE relative to train.py, {relative path: (text, executable)}) for the model file at `path`: the
    file, the local modules it imports, the configs beside it and those of `reads` (files the model's code opened
    or imported while it was planned: planner.model.reads) that lie in its project (project_root; hidden files
    left out), laid out under model/ as they lie relative to their common folder, so that paths the model builds
    from its own __file__ still resolve in the copy."""
    from planner.model.sources import SOURCE_FILE

    src = Path(path)
    if src.name == SOURCE_FILE:
        return SOURCE_FILE, {}
    if not src.is_file():
        raise PlanError(
            f"The plan's model file {path} is not there to copy beside the scripts. Run where the model file is, or "
            "re-plan with the model file's new path."
        )
    src = src.resolve()
    members = {src, *local_imports(src).values()}
    members |= {
        p.resolve() for p in src.parent.iterdir()
        if p.suffix in CONFIG_SUFFIXES and p.is_file() and not p.name.startswith(".")
    }
    project = project_root(src)
    for name in reads:
        file = Path(name).resolve()
        # only the project's own files: not what a library read elsewhere (a token in ~/.cache, the planner's
        # cache), nor hidden files
        if file.is_file() and file.suffix != ".pyc" and project in file.parents and not any(
            part.startswith(".") for part in file.relative_to(project).parts
        ):
            members.add(file)
    texts = {m: _read(m) if m == src else _small_text(m) for m in members}
    copied = {m: text for m, text in texts.items() if text is not None}
    root = Path(os.path.commonpath([str(m.parent) for m in copied]))
    files: Files = {}
    model = ""
    for member, text in sorted(copied.items()):
        rel = member.relative_to(root).as_posix()
        if member == src:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\.py", src.name):
                rel = member.parent.relative_to(root).joinpath("model_file.py").as_posix()  # an importable name
            model = f"{MODEL_DIR}/{rel}"
        files[f"{MODEL_DIR}/{rel}"] = (text, False)
    return model, files


def project_root(model: Path) -> Path:
    """The folder of the project the model file belongs to: the nearest one above it holding .git, .hg,
    pyproject.toml or setup.py; else the model's own folder."""
    for folder in model.parents:
        if any((folder / marker).exists() for marker in (".git", ".hg", "pyproject.toml", "setup.py")):
            return folder
    return model.parent


def _small_text(file: Path) -> str | None:
    """The file's text where it is small UTF-8 text, else None (too large, unreadable or binary)."""
    try:
        if file.stat().st_size > MAX_COPIED_BYTES:
            return None
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if "\0" in text else text  # a binary file that happens to decode


def copy_in_plan_folder(folder: Path) -> tuple[str, Files] | None:
    """The model copy a plan folder holds (what its train.py names as MODEL_FILE, and every file of its
    model/), to carry into another folder as it is (edits included); None where the folder has none."""
    train = folder / "train.py"
    tree = folder / MODEL_DIR
    if not train.is_file() or not tree.is_dir():
        return None
    try:
        module = ast.parse(train.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None
    model = None
    for node in module.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["MODEL_FILE"]:
            try:
                model = ast.literal_eval(node.value)
            except ValueError:
                return None
    if not isinstance(model, str) or not model.startswith(f"{MODEL_DIR}/") or not (folder / model).is_file():
        return None
    files: Files = {}
    for member in sorted(p for p in tree.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        text = _small_text(member)
        if text is not None:
            files[member.relative_to(folder).as_posix()] = (text, False)
    return model, files


def local_imports(model: Path) -> dict[str, Path]:
    """The modules beside `model` that it imports, transitively: {path relative to its folder: file}. A module
    `x` imported by name is `x.py` or the package `x/` in the model's folder (the folder is first on sys.path
    when the runtime imports the model file); everything else is installed and not copied."""
    root = model.parent
    found: dict[str, Path] = {}
    todo = [model]
    seen: set[Path] = set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for top in sorted(_imported_names(file)):
            module = root / f"{top}.py"
            package = root / top
            if module.is_file() and module.resolve() != model.resolve():
                found[f"{top}.py"] = module
                todo.append(module)
            elif (package / "__init__.py").is_file():
                members = sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
                if len(members) > MAX_PACKAGE_FILES:
                    raise PlanError(
                        f"The model file imports the local package {package} of {len(members)} Python files, more "
                        f"than the {MAX_PACKAGE_FILES} the plan folder copies. Install it (pip install -e) on the "
                        "cluster's machines so that the model file imports it from there, then re-plan."
                    )
                for member in members:
                    found[member.relative_to(root).as_posix()] = member
                    todo.append(member)
    return found


def _imported_names(file: Path) -> set[str]:
    try:
        tree = ast.parse(_read(file), filename=str(file))
    except SyntaxError:
        return set()  # the model file itself parsed when it was traced; a broken sibling fails where it is used
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _read(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(
            f"Cannot read {file} to copy it beside the scripts ({e}). Make it readable UTF-8 text."
        ) from None
