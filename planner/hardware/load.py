"""Finding and loading hardware specs: the YAML files under hardware_specs/, or a user's own file.

A spec is named by its ``name``, one of its ``aliases`` (case and ``_``/space insensitive), or a path.
Files are parsed once per content: the cache is keyed by the file's path and bytes, so an edited file is
re-read and an unchanged one is not re-validated. Every mistake raises :class:`SpecError` saying what is
wrong and how to fix it; nothing else escapes from a malformed file.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from planner.errors import SpecError
from planner.hardware.spec import ClusterPreset, ClusterSpec, GPUSpec, TopologySpec

log = logging.getLogger(__name__)

Spec = GPUSpec | ClusterPreset

SPECS_DIR_ENV = "PLANNER_SPECS_DIR"
_SUFFIXES = (".yaml", ".yml")
_KINDS: dict[str, type[GPUSpec] | type[ClusterPreset]] = {"gpu": GPUSpec, "cluster": ClusterPreset}


def specs_dir() -> Path:
    """The folder of built-in specs (top-level hardware_specs/), or $PLANNER_SPECS_DIR when set."""
    override = os.environ.get(SPECS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(__file__).resolve().parents[2] / "hardware_specs"


def normalize_name(name: str) -> str:
    """'H100_SXM 80GB' -> 'h100-sxm-80gb': names and aliases compare in this form."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def list_specs() -> list[Spec]:
    """Every GPU spec and cluster preset in specs_dir(), sorted by name."""
    return sorted((_read(path) for path in _spec_files()), key=lambda spec: spec.name)


def load_spec(name_or_path: str | os.PathLike[str]) -> Spec:
    """A GPU spec or cluster preset by name, alias, or path of a YAML file."""
    return _resolve(name_or_path)[0]


def load_cluster(gpu: str | os.PathLike[str], nodes: int, gpus_per_node: int | None = None) -> ClusterSpec:
    """The machine a plan targets: ``nodes`` nodes of a GPU (in its usual node) or of a cluster preset.

    A GPU name brings the topology of the node it usually ships in; a cluster preset brings its own
    topology and GPU. ``gpus_per_node`` overrides the topology's count (e.g. a partially filled node).
    """
    _check_count("nodes", nodes, "--nodes")
    if gpus_per_node is not None:
        _check_count("gpus_per_node", gpus_per_node, "--gpus-per-node")
    spec, path = _resolve(gpu)
    if isinstance(spec, ClusterPreset):
        gpu_spec = _gpu_of_preset(spec, path)
    else:
        gpu_spec = spec
    topology = spec.topology
    if gpus_per_node is not None and gpus_per_node != topology.gpus_per_node:
        topology = TopologySpec.model_validate({**topology.model_dump(), "gpus_per_node": gpus_per_node})
    return ClusterSpec(name=spec.name, gpu=gpu_spec, topology=topology, nodes=nodes)


# --- resolution -------------------------------------------------------------------------------------------


def _looks_like_path(value: str | os.PathLike[str]) -> bool:
    if not isinstance(value, str):
        return True
    return value.endswith(_SUFFIXES) or "/" in value or os.sep in value


def _resolve(name_or_path: str | os.PathLike[str]) -> tuple[Spec, Path]:
    """The spec and the file it came from."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise SpecError(
            f"A hardware spec is named by a string or a path, not {type(name_or_path).__name__} "
            f"({name_or_path!r}). Pass a name such as 'h100' or the path of a YAML file."
        )
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise SpecError(
                f"Hardware spec file {str(path)!r} does not exist (or is not a file). Check the path, or "
                f"pass a known name instead: {', '.join(_known_names())}."
            )
        return _read(path), path
    key = normalize_name(os.fspath(name_or_path))
    index = _index()
    if key in index:
        path = index[key]
        return _read(path), path
    close = difflib.get_close_matches(key, list(index), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise SpecError(
        f"Unknown hardware spec {name_or_path!r}.{hint} Known specs: {', '.join(_known_names())}. Pass "
        "one of these names (or an alias), or the path of your own YAML file written like those in "
        f"{specs_dir()}."
    )


def _gpu_of_preset(preset: ClusterPreset, preset_path: Path) -> GPUSpec:
    """The GPU a cluster preset names; a relative path there is relative to the preset's own file."""
    ref = preset.gpu
    if _looks_like_path(ref) and not Path(ref).expanduser().is_absolute():
        ref = str(preset_path.parent / ref)
    try:
        spec = load_spec(ref)
    except SpecError as e:
        raise SpecError(
            f"Cluster preset {preset.name!r} ({preset_path}) names gpu {preset.gpu!r}. {e}"
        ) from e
    if not isinstance(spec, GPUSpec):
        raise SpecError(
            f"Cluster preset {preset.name!r} ({preset_path}) names gpu {preset.gpu!r}, which is a cluster "
            "preset, not a GPU spec. Set its gpu field to a GPU name such as 'h100-sxm5-80gb'."
        )
    return spec


def _spec_files() -> list[Path]:
    folder = specs_dir()
    if not folder.is_dir():
        where = f" (from ${SPECS_DIR_ENV})" if os.environ.get(SPECS_DIR_ENV) else ""
        raise SpecError(
            f"The hardware specs folder {folder}{where} does not exist. Point ${SPECS_DIR_ENV} at a folder "
            "of spec YAML files, or unset it to use the built-in hardware_specs/."
        )
    return sorted(p for p in folder.iterdir() if p.suffix in _SUFFIXES and p.is_file())


def _index() -> dict[str, Path]:
    """Normalized name or alias -> file, over specs_dir(); two files claiming one name is an error."""
    index: dict[str, Path] = {}
    for path in _spec_files():
        spec = _read(path)
        for name in (spec.name, *spec.aliases):
            key = normalize_name(name)
            if key in index and index[key] != path:
                raise SpecError(
                    f"Hardware spec name {name!r} is claimed by both {index[key]} and {path}. Rename one, or "
                    "remove the duplicate from its aliases."
                )
            index[key] = path
    return index


def _known_names() -> list[str]:
    try:
        return sorted(spec.name for spec in list_specs())
    except SpecError:
        return ["(the built-in specs could not be read)"]


def _check_count(what: str, value: Any, option: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(
            f"{what} must be a whole number of at least 1, got {value!r}. Pass {option} 1 or more."
        )


# --- parsing ----------------------------------------------------------------------------------------------


def _read(path: Path) -> Spec:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SpecError(
            f"Cannot read hardware spec file {path}: {e.strerror or e}. Check the path and its permissions."
        ) from e
    # Copies, so that a caller editing a dict in place cannot change what the cache hands out next.
    return _parse(str(path), data).model_copy(deep=True)


# libyaml's safe loader where PyYAML was built with it (~8x faster: every spec is read to find one by alias)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=256)
def _parse(path: str, data: bytes) -> Spec:
    """Parse and validate one file's bytes. Cached on (path, content), so edits are always seen."""
    log.debug("parsing hardware spec %s", path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}). Save it as UTF-8.") from e
    try:
        _refuse_anchors(path, text)
        raw = yaml.load(text, Loader=_SpecLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise SpecError(
            f"{path} is not valid YAML: {problem} at {where}. Fix the syntax there; the files in "
            f"{specs_dir()} show the expected layout."
        ) from e
    except yaml.YAMLError as e:
        raise SpecError(
            f"{path} is not valid YAML: {e}. Fix the file; see {specs_dir()} for examples."
        ) from e
    except RecursionError as e:
        raise SpecError(
            f"{path} nests too deeply to be a hardware spec. See {specs_dir()} for examples."
        ) from e
    if not isinstance(raw, dict):
        raise SpecError(
            f"{path} must hold a YAML mapping (name:, peak_tflops:, topology: ...), not "
            f"{type(raw).__name__}. Start from a file in {specs_dir()}."
        )
    kind = raw.get("kind", "gpu")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise SpecError(f"{path}: kind must be 'gpu' or 'cluster', got {kind!r}. Set kind to gpu or cluster.")
    bad_number = _first_non_finite(raw)
    if bad_number is not None:
        field, number = bad_number
        raise SpecError(f"{path}: field '{field}' is {number}; spec numbers must be finite. Fix the value.")
    try:
        spec = model.model_validate(raw)
    except ValidationError as e:
        what = "GPU spec" if model is GPUSpec else "cluster preset"
        raise SpecError(
            f"{path} is not a valid {what}: {_describe(e)}. Fix the field(s); the files in {specs_dir()} are "
            "complete examples."
        ) from e
    except (TypeError, ValueError) as e:  # pydantic wraps validator errors, but odd YAML types can slip past
        raise SpecError(f"{path} is not a valid hardware spec: {e}. See {specs_dir()} for examples.") from e
    _check_plausible(path, spec)
    return spec


class _SpecLoader(_SAFE_LOADER):  # type: ignore[misc,valid-type]
    """The safe loader, refusing a key given twice in one mapping (YAML's last-wins would hide a typo)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the base constructor words that error
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); a key may "
                        "appear once in a mapping", key_node.start_mark,
                    )
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)  # yaml has no type information
        return mapping


def _refuse_anchors(path: str, text: str) -> None:
    """Anchors and aliases (&a / *a) are refused: a spec has no use for them, and a few KB of nested aliases
    expand to billions of nodes (the "billion laughs"), a self-referencing one to a cycle. Checked on the
    parser's events, which are never expanded."""
    for event in yaml.parse(text, Loader=_SAFE_LOADER):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            raise SpecError(
                f"{path} uses a YAML anchor or alias ({'*' if isinstance(event, yaml.AliasEvent) else '&'}"
                f"{event.anchor}) at line {mark.line + 1}, column {mark.column + 1}. Hardware specs take plain "
                "values only: write the value out where it is used."
            )


# Above these a figure is not a GPU's but a unit slip (bytes/s for GB/s, FLOP/s for TFLOP/s, bytes for GiB).
# The largest real ones (2026): ~8 TB/s of HBM, ~1.8 TB/s of NVLink per GPU, ~20 PFLOP/s of dense fp4.
PLAUSIBLE_MAX = {
    "memory_bandwidth_gbps": (10_000.0, "GB/s (10 TB/s = 10000)"),
    "intra_node_bandwidth_gbps": (10_000.0, "GB/s per GPU (10 TB/s = 10000)"),
    "inter_node_bandwidth_gbps": (10_000.0, "GB/s per GPU (10 TB/s = 10000)"),
    "peak_tflops": (100_000.0, "TFLOP/s (100 PFLOP/s = 100000)"),
    "memory_gib": (16_384.0, "GiB (16 TiB = 16384)"),
    "intra_node_latency_us": (1e6, "microseconds (1 s = 1000000)"),
    "inter_node_latency_us": (1e6, "microseconds (1 s = 1000000)"),
}


def _check_plausible(path: str, spec: Spec) -> None:
    """Each figure within the physical bounds of one GPU (PLAUSIBLE_MAX): above them, a SpecError naming the
    field and the unit it is read in."""
    topology = spec.topology.model_dump()
    figures: dict[str, float] = {f"topology.{k}": v for k, v in topology.items() if k in PLAUSIBLE_MAX}
    if isinstance(spec, GPUSpec):
        figures["memory_bandwidth_gbps"] = spec.memory_bandwidth_gbps
        figures["memory_gib"] = spec.memory_gib
        figures.update({f"peak_tflops.{k}": v for k, v in spec.peak_tflops.items()})
    for field, value in figures.items():
        limit, unit = PLAUSIBLE_MAX[field.split(".")[0] if field.startswith("peak") else field.split(".")[-1]]
        if value > limit:
            raise SpecError(
                f"{path}: field '{field}' is {value:g}, more than any GPU has ({limit:g}): it is read in {unit}, so "
                "this looks like a unit slip (bytes or FLOP where the field counts GB, GiB or TFLOP). Write the "
                "value in that unit."
            )


def _first_non_finite(value: Any, where: str = "") -> tuple[str, float] | None:
    """(field path, value) of the first inf or nan number anywhere in parsed YAML, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "(top level)", value
    if isinstance(value, dict):
        for k, v in value.items():
            found = _first_non_finite(v, f"{where}.{k}" if where else str(k))
            if found:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _first_non_finite(v, f"{where}[{i}]")
            if found:
                return found
    return None


def _describe(error: ValidationError, limit: int = 5) -> str:
    """'field peak_tflops.bf16: Input should be greater than 0 (got -1); ...' for the first few errors."""
    parts = []
    for err in error.errors()[:limit]:
        loc = [str(x) for x in err["loc"]]
        what = "field"
        if loc and loc[-1] == "[key]":  # a dict key is wrong (e.g. an unknown dtype in peak_tflops)
            what, loc = "key", loc[:-1]
        field = ".".join(loc) or "(top level)"
        msg = err["msg"]
        if err["type"] not in ("missing", "model_type") and "input" in err:
            shown = repr(err["input"])
            msg += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
        parts.append(f"{what} '{field}': {msg}")
    more = error.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
