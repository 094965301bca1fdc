"""Hardware specs: the shipped YAML files, name/alias/path resolution, clusters, and every error path."""

import copy
import itertools
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import SpecError
from planner.hardware.load import list_specs, load_cluster, load_spec, normalize_name, specs_dir
from planner.hardware.spec import ClusterPreset, GPUSpec

SPEC_FILES = sorted(specs_dir().glob("*.yaml"))
GPU_NAMES = [
    "v100-sxm2-32gb", "a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h100-pcie-80gb",
    "h200-sxm-141gb", "b200", "l40s", "rtx-4090", "mi300x", "cpu",
]  # fmt: skip
CLUSTER_NAMES = ["dgx-a100", "dgx-h100", "pcie-box"]


def _gpus() -> list[GPUSpec]:
    return [s for s in list_specs() if isinstance(s, GPUSpec)]


def _write(folder: Path, name: str, data) -> Path:
    path = folder / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _h100_dict() -> dict:
    return yaml.safe_load((specs_dir() / "h100-sxm5-80gb.yaml").read_text())


# --- the shipped files ------------------------------------------------------------------------------------


def test_the_shipped_specs_are_exactly_the_expected_ones():
    specs = list_specs()
    assert [s.name for s in specs] == sorted(GPU_NAMES + CLUSTER_NAMES)
    assert {s.name for s in specs if isinstance(s, ClusterPreset)} == set(CLUSTER_NAMES)


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_every_yaml_file_loads_by_path_and_by_name(path):
    by_path = load_spec(path)
    assert by_path.name == path.stem, "a spec's name must match its file name"
    assert load_spec(path.stem) == by_path
    assert load_spec(str(path)) == by_path


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_every_number_in_a_file_has_a_source_comment(path):
    for line in path.read_text().splitlines():
        body = line.split("#")[0]
        if ":" in body and body.split(":", 1)[1].strip().replace(".", "", 1).isdigit():
            assert "# source:" in line, f"{path.name}: no '# source:' comment on {line.strip()!r}"


@pytest.mark.parametrize("spec", _gpus(), ids=lambda s: s.name)
def test_gpu_numbers_are_sane(spec: GPUSpec):
    tflops = spec.peak_tflops
    assert all(v > 0 for v in tflops.values())
    assert spec.memory_gib > 0 and spec.memory_bandwidth_gbps > 0
    if spec.vendor != "generic":  # accelerators: tensor cores beat plain fp32, and fp8 doubles bf16
        for dtype in ("tf32", "bf16", "fp16", "fp8"):
            if dtype in tflops:
                assert tflops[dtype] >= tflops["fp32"], dtype
        if "bf16" in tflops and "fp8" in tflops:
            assert tflops["fp8"] == pytest.approx(2 * tflops["bf16"], rel=0.02)  # L40S: 733 vs 362.05
    topo = spec.topology
    assert topo.intra_node_bandwidth_gbps >= topo.inter_node_bandwidth_gbps
    assert topo.intra_node_latency_us <= topo.inter_node_latency_us
    assert {"peak_tflops", "memory_gib", "memory_bandwidth_gbps", "topology"} <= set(spec.sources)
    assert spec.peak_flops("bf16") > 0 and spec.memory_bytes > 0


@pytest.mark.parametrize(
    ("name", "dtype", "dense"),
    [
        ("v100-sxm2-32gb", "fp16", 125.0),
        ("a100-sxm4-80gb", "bf16", 312.0),
        ("a100-sxm4-80gb", "tf32", 156.0),
        ("h100-sxm5-80gb", "bf16", 989.4),
        ("h100-sxm5-80gb", "fp8", 1978.9),
        ("h100-sxm5-80gb", "tf32", 494.7),
        ("h100-pcie-80gb", "bf16", 756.0),
        ("l40s", "bf16", 362.05),
        ("mi300x", "bf16", 1307.4),
    ],
)
def test_peak_figures_are_the_dense_datasheet_ones(name, dtype, dense):
    assert load_spec(name).peak_tflops[dtype] == dense


def test_v100_has_no_bf16_and_falls_back_to_fp16():
    v100 = load_spec("v100")
    assert "bf16" not in v100.peak_tflops
    assert v100.peak_flops("bf16") == 125.0e12


def test_cluster_presets_describe_their_node():
    a100 = load_spec("dgx-a100")
    assert (a100.gpu, a100.topology.intra_node_bandwidth_gbps, a100.topology.inter_node_bandwidth_gbps) == (
        "a100-sxm4-80gb", 300.0, 25.0,
    )  # fmt: skip
    h100 = load_spec("dgx-h100")
    assert (h100.gpu, h100.topology.intra_node_bandwidth_gbps, h100.topology.inter_node_bandwidth_gbps) == (
        "h100-sxm5-80gb", 450.0, 50.0,
    )  # fmt: skip
    box = load_spec("pcie-box")
    assert (
        25.0 <= box.topology.intra_node_bandwidth_gbps <= 32.0 and box.topology.inter_node_bandwidth_gbps < 25
    )


# --- names and aliases ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("a100-sxm-80gb", "a100-sxm4-80gb"),
        ("h100-sxm-80gb", "h100-sxm5-80gb"),
        ("a100-80gb", "a100-sxm4-80gb"),
        ("h100", "h100-sxm5-80gb"),
        ("H100", "h100-sxm5-80gb"),
        ("  h100_SXM  ", "h100-sxm5-80gb"),
        ("h200", "h200-sxm-141gb"),
        ("4090", "rtx-4090"),
        ("hgx-h100", "dgx-h100"),
    ],
)
def test_aliases_resolve(alias, name):
    assert load_spec(alias).name == name


def test_no_alias_is_claimed_twice():
    seen: dict[str, str] = {}
    for spec in list_specs():
        for key in map(normalize_name, [spec.name, *spec.aliases]):
            assert key not in seen, f"{key!r} claimed by {seen.get(key)} and {spec.name}"
            seen[key] = spec.name


# --- clusters ---------------------------------------------------------------------------------------------


def test_a_gpu_name_brings_its_usual_node():
    cluster = load_cluster("h100", nodes=4)
    assert cluster.gpu.name == "h100-sxm5-80gb" and cluster.nodes == 4
    assert cluster.topology == cluster.gpu.topology and cluster.world_size == 32


def test_a_cluster_preset_brings_its_topology_and_gpu():
    cluster = load_cluster("dgx-a100", nodes=2)
    assert cluster.name == "dgx-a100" and cluster.gpu.name == "a100-sxm4-80gb"
    assert cluster.topology == load_spec("dgx-a100").topology and cluster.world_size == 16


def test_gpus_per_node_overrides_the_topology():
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    assert cluster.gpus_per_node == 2 and cluster.world_size == 2
    assert cluster.topology.intra_node_link == load_spec("cpu").topology.intra_node_link


@pytest.mark.parametrize(
    ("nodes", "gpus_per_node"), [(0, None), (-1, None), (1.5, None), (True, None), (1, 0)]
)
def test_bad_counts_raise_spec_error(nodes, gpus_per_node):
    with pytest.raises(SpecError, match="at least 1"):
        load_cluster("h100", nodes, gpus_per_node)


# --- a user's own files -----------------------------------------------------------------------------------


def test_a_user_yaml_path_works(tmp_path):
    data = _h100_dict() | {"name": "my-h100", "aliases": [], "memory_gib": 64.0}
    path = _write(tmp_path, "mine.yaml", data)
    for ref in (path, str(path)):
        spec = load_spec(ref)
        assert spec.name == "my-h100" and spec.memory_gib == 64.0
    assert load_cluster(str(path), nodes=2).gpu.name == "my-h100"


def test_a_user_cluster_preset_may_name_its_gpu_file_relative_to_itself(tmp_path):
    _write(tmp_path, "gpu.yaml", _h100_dict() | {"name": "lab-gpu", "aliases": []})
    preset = yaml.safe_load((specs_dir() / "dgx-h100.yaml").read_text())
    path = _write(tmp_path, "lab.yaml", preset | {"name": "lab", "aliases": [], "gpu": "./gpu.yaml"})
    cluster = load_cluster(path, nodes=3, gpus_per_node=4)
    assert cluster.gpu.name == "lab-gpu" and cluster.world_size == 12


def test_an_edited_file_is_reread(tmp_path):
    path = _write(tmp_path, "x.yaml", _h100_dict() | {"memory_gib": 10.0})
    assert load_spec(path).memory_gib == 10.0
    _write(tmp_path, "x.yaml", _h100_dict() | {"memory_gib": 20.0})
    assert load_spec(path).memory_gib == 20.0


def test_the_specs_folder_can_be_overridden(tmp_path, monkeypatch):
    _write(tmp_path, "tiny.yaml", _h100_dict() | {"name": "tiny", "aliases": ["t1"]})
    monkeypatch.setenv("PLANNER_SPECS_DIR", str(tmp_path))
    assert specs_dir() == tmp_path
    assert [s.name for s in list_specs()] == ["tiny"] and load_spec("t1").name == "tiny"


def test_returned_specs_cannot_corrupt_the_cache():
    spec = load_spec("h100")
    spec.peak_tflops["bf16"] = 1.0
    assert load_spec("h100").peak_tflops["bf16"] == 989.4


# --- errors -----------------------------------------------------------------------------------------------


def test_unknown_name_lists_known_names_and_suggests_the_closest():
    with pytest.raises(SpecError) as info:
        load_spec("h10")
    message = str(info.value)
    assert "Did you mean 'h100'" in message and "a100-sxm4-80gb" in message and "dgx-h100" in message


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="does not exist"):
        load_spec("specs/nope.yaml")


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = _write(tmp_path, "bad.yaml", "name: x\nvendor: y\npeak_tflops: {fp32: 1\nmemory_gib: 2\n")
    with pytest.raises(SpecError, match=r"not valid YAML.*line \d+"):
        load_spec(path)
    path = _write(tmp_path, "bad2.yaml", "name: x\n  vendor: y: z\n")
    with pytest.raises(SpecError, match="line 2"):
        load_spec(path)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"peak_tflops": {"fp32": 67.0, "bf16": -1}}, "peak_tflops.bf16"),
        ({"peak_tflops": {"fp32": 67.0, "fp4": 9000.0}}, "peak_tflops.fp4"),
        ({"memory_gib": "lots"}, "memory_gib"),
        ({"unexpected": 1}, "unexpected"),
        ({"topology": {"gpus_per_node": 8}}, "topology.intra_node_link"),
        ({"memory_gib": float("inf")}, "memory_gib"),
    ],
)
def test_validation_errors_name_the_field(tmp_path, change, field):
    path = _write(tmp_path, "bad.yaml", _h100_dict() | change)
    with pytest.raises(SpecError, match=f"'{field}'"):
        load_spec(path)


def test_missing_field_and_missing_fp32_are_explained(tmp_path):
    data = _h100_dict()
    del data["memory_gib"]
    with pytest.raises(SpecError, match="'memory_gib': Field required"):
        load_spec(_write(tmp_path, "a.yaml", data))
    with pytest.raises(SpecError, match="fp32"):
        load_spec(_write(tmp_path, "b.yaml", _h100_dict() | {"peak_tflops": {"bf16": 1.0}}))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", "mapping"), ("- a\n- b\n", "mapping"), ("just text\n", "mapping"), ("kind: tpu\n", "kind must be")],
)
def test_wrong_document_shapes(tmp_path, text, expected):
    with pytest.raises(SpecError, match=expected):
        load_spec(_write(tmp_path, "x.yaml", text))


def test_binary_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(SpecError, match="UTF-8"):
        load_spec(path)


def test_a_preset_naming_a_cluster_as_its_gpu(tmp_path):
    preset = yaml.safe_load((specs_dir() / "dgx-h100.yaml").read_text())
    path = _write(tmp_path, "p.yaml", preset | {"name": "p", "aliases": [], "gpu": "dgx-a100"})
    with pytest.raises(SpecError, match="not a GPU spec"):
        load_cluster(path, nodes=1)
    path = _write(tmp_path, "q.yaml", preset | {"name": "q", "aliases": [], "gpu": "h1000"})
    with pytest.raises(SpecError, match="names gpu 'h1000'.*Did you mean"):
        load_cluster(path, nodes=1)


def test_duplicate_names_in_the_specs_folder(tmp_path, monkeypatch):
    _write(tmp_path, "a.yaml", _h100_dict() | {"name": "a", "aliases": ["same"]})
    _write(tmp_path, "b.yaml", _h100_dict() | {"name": "b", "aliases": ["same"]})
    monkeypatch.setenv("PLANNER_SPECS_DIR", str(tmp_path))
    with pytest.raises(SpecError, match="'same' is claimed by both"):
        load_spec("a")


def test_missing_specs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_SPECS_DIR", str(tmp_path / "absent"))
    with pytest.raises(SpecError, match="PLANNER_SPECS_DIR"):
        load_spec("h100")


def test_a_non_string_name():
    with pytest.raises(SpecError, match="string or a path"):
        load_spec(100)  # type: ignore[arg-type]


# --- fuzzing: whatever is in the file, the only exception is SpecError -------------------------------------

_counter = itertools.count()
_yaml_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_yaml_values = st.recursive(
    _yaml_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def _load_or_spec_error(folder: Path, content: str | bytes):
    path = folder / f"fuzz-{next(_counter)}.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")
    try:
        spec = load_spec(path)
    except SpecError as e:
        assert str(e)
    else:
        assert isinstance(spec, (GPUSpec, ClusterPreset))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


_fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fuzz
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_fuzz_random_text(fuzz_dir, text):
    _load_or_spec_error(fuzz_dir, text)


@_fuzz
@given(data=st.binary(max_size=200))
def test_fuzz_random_bytes(fuzz_dir, data):
    _load_or_spec_error(fuzz_dir, data)


@_fuzz
@given(value=_yaml_values)
def test_fuzz_random_yaml_documents(fuzz_dir, value):
    _load_or_spec_error(fuzz_dir, yaml.safe_dump(value))


_FIELDS = [
    ("name",), ("kind",), ("aliases",), ("peak_tflops",), ("peak_tflops", "fp32"), ("peak_tflops", "bf16"),
    ("memory_gib",), ("memory_bandwidth_gbps",), ("topology",), ("topology", "gpus_per_node"),
    ("topology", "intra_node_bandwidth_gbps"), ("sources",), ("efficiency",), ("efficiency", "matmul"),
]  # fmt: skip


@_fuzz
@given(field=st.sampled_from(_FIELDS), value=_yaml_values, delete=st.booleans())
def test_fuzz_mutated_valid_spec(fuzz_dir, field, value, delete):
    data = copy.deepcopy(_h100_dict())
    target = data
    for key in field[:-1]:
        target = target.setdefault(key, {})
    if delete:
        target.pop(field[-1], None)
    else:
        target[field[-1]] = value
    _load_or_spec_error(fuzz_dir, yaml.safe_dump(data))


@_fuzz
@given(
    cut=st.integers(min_value=0, max_value=2000),
    junk=st.sampled_from(["", ":", "- ", "{", "]", "\t", "&a *b"]),
)
def test_fuzz_truncated_and_corrupted_shipped_file(fuzz_dir, cut, junk):
    text = (specs_dir() / "dgx-a100.yaml").read_text()
    _load_or_spec_error(fuzz_dir, text[:cut] + junk + text[cut:])


# --- the memory reserve -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPU_NAMES)
def test_every_gpu_spec_has_a_sourced_memory_reserve(name):
    spec = load_spec(name)
    text = (specs_dir() / f"{spec.name}.yaml").read_text()
    block = text.split("memory_reserve:", 1)[1].split("\nsources:")[0]
    for field in ("cuda_context_gib", "nccl_gib_per_group", "fragmentation"):
        line = next(ln for ln in block.splitlines() if ln.strip().startswith(field + ":"))
        assert "# source:" in line, (name, field)
    assert "memory_reserve" in spec.sources
    reserve = load_cluster(name, 2).memory_reserve_bytes(3)  # a plan with dp, tp and pp groups
    if name == "cpu":
        assert 0 < reserve < 0.01 * spec.memory_bytes  # small: local CPU plans stay as they were
    else:
        assert 2**30 < reserve < 0.1 * spec.memory_bytes


def test_reserve_grows_with_process_groups():
    from planner.cost.candidate import Candidate
    from planner.cost.terms import rank_capacity

    many = load_cluster("h100-sxm5-80gb", 4)
    r = many.gpu.memory_reserve
    per_group = r.nccl_gib_per_group * 2**30
    assert many.fixed_reserve_bytes == int(r.cuda_context_gib * 2**30)  # fragmentation is the peak's share
    # NCCL buffers for each process group of more than one rank the plan communicates in
    assert many.memory_reserve_bytes(3) - many.memory_reserve_bytes(1) == int(2 * per_group)
    assert many.nccl_bytes_per_group == 0  # the spec's cluster: the search would plan against all of it
    reduced = many.within_reserve()
    assert reduced.gpu.memory_bytes == pytest.approx(many.gpu.memory_bytes - many.fixed_reserve_bytes, abs=1)
    assert reduced.fixed_reserve_bytes == 0 and reduced.nccl_bytes_per_group == per_group
    assert reduced.reserved_gib == pytest.approx(many.fixed_reserve_bytes / 2**30)
    twice = reduced.within_reserve()
    assert twice.gpu.memory_bytes == reduced.gpu.memory_bytes and twice.nccl_bytes_per_group == per_group
    # the fragmentation share is not a reserve: the plan's cluster keeps it for the cost model's peak
    assert reduced.gpu.memory_reserve.fragmentation == twice.gpu.memory_reserve.fragmentation == r.fragmentation
    # what a plan may fill: one GPU alone keeps no NCCL buffers, dp x tp x pp keeps three groups' worth
    alone = Candidate(1, 1, 1, 1, 1, 8, "1f1b", 0, False)
    dp_only = Candidate(32, 1, 1, 1, 1, 8, "1f1b", 0, False)
    three = Candidate(4, 4, 2, 1, 1, 8, "1f1b", 0, False)
    experts = Candidate(16, 1, 2, 1, 1, 8, "1f1b", 0, False, ep=4)  # dp, pp, ep and the experts' replicas
    cap = reduced.gpu.memory_bytes
    for cand, groups in ((alone, 0), (dp_only, 1), (three, 3), (experts, 4)):
        assert rank_capacity(reduced, cand) == pytest.approx(cap - groups * per_group)
    # an override is the whole reserve: taken off once, nothing per group
    fixed = many.with_memory_reserve(3.0).within_reserve()
    assert fixed.gpu.memory_bytes == pytest.approx(many.gpu.memory_bytes - 3 * 2**30, abs=1)
    assert rank_capacity(fixed, three) == fixed.gpu.memory_bytes


def test_a_reserve_that_leaves_nothing_is_refused():
    data = _h100_dict()
    data["memory_reserve"] = {"cuda_context_gib": 90.0}
    with pytest.raises(ValueError, match="leaves nothing"):
        GPUSpec.model_validate(data)
    data["memory_reserve"] = {"fragmentation": 0.7}
    with pytest.raises(ValueError):
        GPUSpec.model_validate(data)


def test_memory_reserve_override_is_checked():
    from planner.errors import ConfigError

    cl = load_cluster("h100-sxm5-80gb", 2)
    assert cl.with_memory_reserve(None) is cl
    assert cl.with_memory_reserve(10).memory_reserve_bytes(3) == 10 * 2**30
    assert cl.with_memory_reserve(0).memory_reserve_bytes(3) == 0
    with pytest.raises(ConfigError, match="--memory-reserve 80 GiB"):
        cl.with_memory_reserve(80)


def test_plans_keep_the_reserve_free_and_report_it(tmp_path):
    from planner.pipeline import PlanRequest, analyse, plan_model
    from planner.plan import Plan

    model = str(Path(__file__).resolve().parents[1] / "sample_models" / "gpt.py")
    request = PlanRequest(model_path=model, gpu="cpu", nodes=1, gpus_per_node=4, global_batch_size=8, top_k=30)
    graph = analyse(request)
    free, _, _ = plan_model(request.model_copy(update={"memory_reserve_gib": 0.0}), graph)
    assert free.predicted.memory_reserve_bytes == 0
    peaks = sorted({free.predicted.peak_memory_bytes} | {a.predicted.peak_memory_bytes for a in free.alternatives})
    assert len(peaks) >= 3
    # a reserve that leaves room for the leanest plans only: the rest are refused, the reason says why.
    # Midway to the chosen plan's peak (not the list's largest, which depends on which runners-up the
    # search ranks: by the reported figure a faster, fuller interleaved partition joined the list)
    usable = (peaks[0] + free.predicted.peak_memory_bytes) / 2
    assert usable < free.predicted.peak_memory_bytes
    reserve_gib = (free.predicted.memory_capacity_bytes - usable) / 2**30
    tight, _, _ = plan_model(request.model_copy(update={"memory_reserve_gib": reserve_gib}), graph)
    pred = tight.predicted
    assert pred.memory_reserve_bytes == int(reserve_gib * 2**30)
    assert pred.peak_memory_bytes <= pred.memory_capacity_bytes - pred.memory_reserve_bytes
    assert all(a.predicted.peak_memory_bytes <= usable for a in tight.alternatives)
    assert any(r.reason.startswith("within the memory reserve") for r in tight.rejected)
    # plan.json carries the reserve; one written before it existed still loads (reserve 0)
    doc = tight.model_dump(mode="json")
    assert Plan.model_validate(doc).predicted.memory_reserve_bytes == pred.memory_reserve_bytes
    del doc["predicted"]["memory_reserve_bytes"]
    assert Plan.model_validate(doc).predicted.memory_reserve_bytes == 0
    # the spec's reserve: its fixed part plus NCCL buffers for each group of more than one rank, plan by plan
    from planner.cost.terms import group_sizes
    from planner.hardware.load import load_cluster

    spec, _, _ = plan_model(request, graph)
    cluster = load_cluster("cpu", 1, 4)
    per_group = cluster.gpu.memory_reserve.nccl_gib_per_group * 2**30
    seen = set()
    for par, pred in [(spec.parallel, spec.predicted)] + [(a.parallel, a.predicted) for a in spec.alternatives]:
        groups = len(group_sizes(par.dp, par.tp, par.pp, par.ep))
        seen.add(groups)
        assert pred.memory_reserve_bytes == cluster.fixed_reserve_bytes + int(groups * per_group)
        assert pred.peak_memory_bytes <= pred.memory_capacity_bytes - pred.memory_reserve_bytes
    assert len(seen) >= 2  # plans of different groups keep different reserves


def test_memory_reserve_option_on_the_command_line():
    import json

    from typer.testing import CliRunner

    from planner.cli.main import app

    model = str(Path(__file__).resolve().parents[1] / "sample_models" / "mlp.py")
    base = ["dry-run", model, "--gpu", "cpu", "--gpus-per-node", "2", "--global-batch-size", "4", "--json"]
    runner = CliRunner()
    res = runner.invoke(app, [*base, "--memory-reserve", "2.5"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["predicted"]["memory_reserve_bytes"] == int(2.5 * 2**30)
    res = runner.invoke(app, [*base, "--memory-reserve", "16"])
    assert res.exit_code == 2 and "--memory-reserve 16 GiB is not possible" in res.output


def test_nothing_fits_message_names_the_reserve():
    from planner.errors import InfeasibleError
    from planner.pipeline import PlanRequest, plan_model

    model = str(Path(__file__).resolve().parents[1] / "sample_models" / "mlp.py")
    request = PlanRequest(model_path=model, gpu="cpu", gpus_per_node=2, global_batch_size=4, memory_reserve_gib=15.5)
    with pytest.raises(InfeasibleError, match=r"left after its 15.50 GiB memory reserve.*smaller --memory-reserve"):
        plan_model(request)


def test_fragmentation_is_one_knob_read_by_the_search_the_report_and_plan_json(tmp_path):
    """The spec's memory_reserve.fragmentation is the one fragmentation share: `CostOptions.for_cluster` reads
    it, and a plan's peak (plan.json's predicted memory, each stage's workspace) moves with it alone."""
    import json

    from typer.testing import CliRunner

    from planner.cli.main import app
    from planner.cost.candidate import CostOptions

    cl = load_cluster("h100-sxm5-80gb", 1)
    frag = cl.gpu.memory_reserve.fragmentation
    assert CostOptions.for_cluster(cl).fragmentation == frag
    assert CostOptions.for_cluster(cl.within_reserve()).fragmentation == frag  # what the search is given
    data = _h100_dict()
    data["memory_reserve"]["fragmentation"] = 0.3
    heavy = tmp_path / "heavy.yaml"
    heavy.write_text(yaml.safe_dump(data))
    model = str(Path(__file__).resolve().parents[1] / "sample_models" / "mlp.py")

    def planned(gpu: str) -> dict:
        args = ["dry-run", model, "--gpu", gpu, "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "8",
                "--dp", "2", "--json"]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    base, more = planned("h100-sxm5-80gb"), planned(str(heavy))
    assert more["predicted"]["memory_reserve_bytes"] == base["predicted"]["memory_reserve_bytes"]  # not a reserve
    assert more["predicted"]["peak_memory_bytes"] > base["predicted"]["peak_memory_bytes"]
    for a, b in zip(base["stages"], more["stages"]):
        m = a["memory"]
        held = m["weights"] + m["gradients"] + m["optimizer"] + m["activations"] + m["comm_buffers"]
        assert b["memory"]["workspace"] - m["workspace"] == pytest.approx((0.3 - frag) * held, rel=1e-3, abs=2)


@pytest.mark.parametrize(("recompute", "words"), [("none", "no recomputation"), ("full", "full recomputation")])
def test_nothing_fits_message_names_the_pinned_recomputation(recompute, words):
    # The bound is taken under the pinned mode: a pinned run must not read as "even full recomputation does
    # not fit" (torchtitan's 8B rows, pinned selective, read so before)
    from planner.errors import InfeasibleError
    from planner.pipeline import PlanRequest, plan_model

    model = str(Path(__file__).resolve().parents[1] / "sample_models" / "mlp.py")
    request = PlanRequest(
        model_path=model,
        gpu="cpu",
        gpus_per_node=2,
        global_batch_size=4,
        memory_reserve_gib=15.5,
        pins={"recompute": recompute},
    )
    with pytest.raises(InfeasibleError, match=rf"most memory-frugal layout \([^)]*, {words}\)"):
        plan_model(request)
